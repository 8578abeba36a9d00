"""FP8 weights on one H200, in one call of about 9 minutes: accuracy against bf16 on a random
llama3-8b, the fp8 GEMV's tilings, and the W2 / W3 / W4 workloads through the offline path.

    PYTHONPATH=. python3 benchmarks/gpu_fp8.py [--budget-s 480] [--skip sweep,w4]
        [--fp8-engine-args '{"kv_cache_dtype": "fp8"}'] [--w3-seqs 384,768] [--w4-seqs 128,512]
        [--scaling-rows 171,256,512] [--scaling-shapes 70b]

--w3-seqs / --w4-seqs: max_num_seqs of the 8B / 70B fp8 engines; the first runs every workload
of its section, each further one a fresh engine for the throughput rows only (W3-fp8-128 and
-1000; W4-128 and W4-1000), labelled with its size (e.g. "W4-128 s512").

Sections, in order (each on its own: an error is printed and the next section runs):
  ceilings  copy bandwidth, bf16 and row-wise fp8 matmul rates (8192^3)
  kernels   at llama3-8b's projection shapes: the fp8 GEMV vs `_scaled_mm` vs the dequantized
            fp32 reference; the per-token quantization kernel vs torch
  quant     the writers of an fp8 projection's input (SiLU-and-mul, the residual add +
            RMSNorm, each with `quant`) against the unfused pair, and quantize_rows alone, at
            W3's and W4's decode rows and a prefill chunk: us a launch, bit-equality
  silu-passes  the quantizing SiLU-and-mul unstored in one pass (the row in registers) against
            two, 8B and 70B widths, 128 to 8,192 rows, with and without a tensor-wise
            product's scales: us a launch, bit-equality
  accum     `_scaled_mm` with and without fast accumulation at the 8B and 70B projection
            shapes and 128 to 16,384 rows: TFLOP/s and error against the dequantized product
  scaling   row-wise scaled `_scaled_mm` (CUTLASS) against tensor-wise (cuBLASLt, scales 1)
            and bf16 at the same shapes, 256 to 16,384 rows: TFLOP/s
  w2-bf16   random:llama3-8b bf16: W2 (ms/token), and the reference logits / greedy tokens
  fp8-8b    random:llama3-8b fp8 (the same draws, quantized): logits rel. error, top-1 and
            greedy agreement against bf16; W2-fp8; W3-fp8-128, -1000, -2048 (trimmed)
  w4        random:llama3-70b fp8, created on the GPU layer by layer: W4-bs1, W4-128, W4-1000
  sweep     the fp8 GEMV's tilings at the 8B and 70B shapes, GB/s against the bf16 GEMV
Request counts are trimmed from WORKLOADS.md's to fit the budget (printed); a section that
would start past --budget-s is skipped (printed). `--only W3-fp8-2048,W4-128` runs just those
workloads of the sections left (their engines still start). A short table comes last;
everything goes to $OUT/gpu_fp8.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch
from _stages import Stages, rel_err

from lantau.bench.step_log import wall_step_times
from lantau.metrics.gc_pauses import GcPauses
from lantau.model.kernel_cache import CompileWatch

section = Stages()
section.budget_s = 480.0  # --budget-s
RESULTS, TABLE, elapsed = section.results, section.table, section.elapsed
# more LLM(...) arguments for the fp8 engines (--fp8-engine-args), e.g. the fp8 KV cache's
FP8_ENGINE_ARGS: dict = {}
ONLY: set[str] = set()  # --only: the workload labels to run, their max_num_seqs suffix aside
# llama3-8b / -70b projections (N, K); lm_head stays bf16
SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
SHAPES_70B = {
    "70b qkv": (10240, 8192),
    "70b o": (8192, 8192),
    "70b gate_up": (57344, 8192),
    "70b down": (8192, 28672),
}
# the fp8 GEMV's K-loop tilings (BLOCK_N, BLOCK_K, num_warps, num_stages): 16-byte loads of
# one-byte weights want BLOCK_K twice the bf16 kernel's for the same bytes a program
LOOP_TILES = [
    (4, 1024, 2, 4), (8, 512, 4, 4), (16, 256, 4, 4), (8, 1024, 4, 4), (16, 512, 4, 4),
    (4, 2048, 4, 4), (8, 2048, 4, 3), (16, 1024, 8, 3), (32, 512, 8, 3), (2, 2048, 2, 4),
    (4, 4096, 4, 3), (32, 1024, 8, 3),
]  # fmt: skip
# issue 20's targets (TensorRT-LLM's best published figures on one H200 are the bar)
TARGETS = {
    "W3-fp8-128": ">= 29,526 tok/s",
    "W3-fp8-1000": ">= 17,744 tok/s",
    "W3-fp8-2048": ">= 3,794 tok/s",
    "W4-bs1": "<= 18 ms/tok (floor 16.4)",
    "W4-128": ">= 4,100 tok/s",
    "W4-1000": ">= 3,000 tok/s",
}
PRELOAD_TILES = [(2, 0, 2, 1), (2, 0, 4, 1), (4, 0, 4, 1), (4, 0, 8, 1), (8, 0, 8, 1)]
# the accum section's rows: decode batches (W4's 128, W3's 384, 512) and prefill steps
ACCUM_ROWS = (128, 384, 512, 2048, 16384)
SCALING_ROWS = [256, 384, 1024, 4096, 16384]  # --scaling-rows
SCALING_SHAPES: list[str] = []  # --scaling-shapes: names containing one of these (all: empty)


@section("ceilings")
def ceilings() -> None:
    from lantau.bench.offline import measure_ceilings

    c = RESULTS["ceilings"] = measure_ceilings(torch.device("cuda"))
    TABLE.append(
        (
            "ceilings",
            f"{c['copy_tb_s']} TB/s copy",
            f"mm bf16 {c['bf16_matmul_tflop_s']}, fp8 {c.get('fp8_matmul_tflop_s')} (fast accum "
            f"{c.get('fp8_fast_matmul_tflop_s')}) TFLOP/s",
        )
    )


@section("kernels")
def kernels() -> None:
    """Each 8B projection with weights N(0, 0.02) quantized: the fp8 GEMV (as the model calls
    it: preload up to K 8,192) and `_scaled_mm` (x quantized by the kernel) against the
    dequantized fp32 product (x quantized too for _scaled_mm), and both against the bf16
    weights' product (fp8's own error)."""
    from lantau.kernels import fp8_quant
    from lantau.kernels.gemv import gemv
    from lantau.kernels.reference import gemv_ref
    from lantau.model import fp8

    res = {}
    for name, (n, k) in SHAPES_8B.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_rows(w)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dequantized = gemv_ref(x, wq, weight_scale=ws)
        exact = gemv_ref(x, w)
        y_gemv = gemv(x, wq, weight_scale=ws, preload=k <= 8192)
        xq, xs = fp8_quant.quantize_rows(x)
        y_mm = fp8.scaled_mm(xq, xs, wq, ws)
        # _scaled_mm's reference quantizes x too (the GEMV reads x as it is)
        both_dequantized = gemv_ref(fp8.dequantize_rows(xq, xs), wq, weight_scale=ws)
        res[name] = {
            "gemv_vs_dequantized": rel_err(y_gemv, dequantized),
            "scaled_mm_vs_dequantized": rel_err(y_mm, both_dequantized),
            "gemv_vs_bf16_weights": rel_err(y_gemv, exact),
            "scaled_mm_vs_bf16_weights": rel_err(y_mm, exact),
        }
        xb = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        q1, s1 = fp8_quant.quantize_rows(xb)
        q2, s2 = fp8.quantize_rows(xb)
        res[name]["quant_kernel_mismatches"] = int((q1.float() != q2.float()).sum())
        res[name]["quant_kernel_scale_err"] = rel_err(s1, s2)
        del w, wq
    RESULTS["kernels"] = res
    print(json.dumps(res, indent=1), flush=True)
    worst_gemv = max(r["gemv_vs_dequantized"] for r in res.values())
    worst_mm = max(r["scaled_mm_vs_dequantized"] for r in res.values())
    worst_fp8 = max(r["gemv_vs_bf16_weights"] for r in res.values())
    TABLE.append(
        (
            "fp8 GEMV / _scaled_mm vs dequantized (8B shapes)",
            f"{worst_gemv:.1e} / {worst_mm:.1e}",
            f"GEMV vs bf16 weights {worst_fp8:.3f} (fp8's own error)",
        )
    )


def silu_inputs(rows: int, inter: int):
    """SiLU-and-mul's inputs at `rows` x 2 * inter in enough copies (~256 MB) that L2 holds
    none: (copies, gate_up, outs, quantized-row buffers, a tensor-wise product's row and
    column scales as decode batches apply them)."""
    from lantau.kernels import fp8_quant

    copies = max(2, (256 << 20) // (rows * 4 * inter))
    gate_up = [
        torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) for _ in range(copies)
    ]
    outs = [torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16) for _ in gate_up]
    quants = [fp8_quant.empty_quantized(rows, inter, "cuda") for _ in gate_up]
    scales = dict(
        row_scale=torch.rand(rows, device="cuda") + 0.5,
        col_scale=torch.rand(2 * inter, device="cuda") + 0.5,
    )
    return copies, gate_up, outs, quants, scales


@section("quant")
def quant() -> None:
    """The writers of an fp8 projection's input (KernelConfig.fuse_fp8_quant) against the
    unfused pair each replaces, in CUDA graphs over inputs rotated past L2: SiLU-and-mul with
    `quant` (storing its output too and not, store=False, and unstored with a tensor-wise
    product's row and column scales, as decode batches run it) against silu_and_mul then
    quantize_rows (down_proj's input), the residual add +
    RMSNorm with `quant` against it then quantize_rows (qkv's and gate_up's), and quantize_rows
    alone (o_proj's input); W3's and W4's decode rows and a prefill chunk, 8B and 70B widths;
    each fused output checked bit-equal to the pair's."""
    from lantau.bench.offline import graph_ms
    from lantau.kernels import activation, fp8_quant, rms_norm

    def timed(fn, copies: int) -> float:  # us a launch (or a pair)
        return round(1e3 * graph_ms(fn) / copies, 2)

    def bit_equal(quant, out) -> bool:  # a writer's quantized rows against quantize_rows(out)
        q_ref, s_ref = fp8_quant.quantize_rows(out)
        same_q = torch.equal(quant[0].view(torch.uint8), q_ref.view(torch.uint8))
        return bool(same_q and torch.equal(quant[1], s_ref))

    res = {}
    for model, hidden, inter in (("8b", 4096, 14336), ("70b", 8192, 28672)):
        for rows in (384, 172, 8192):
            row = res[f"{model} x{rows}"] = {}
            copies, gate_up, outs, quants, scales = silu_inputs(rows, inter)

            def silu_fused(gate_up=gate_up, outs=outs, quants=quants):
                for g, o, q in zip(gate_up, outs, quants, strict=True):
                    activation.silu_and_mul(g, out=o, quant=q)

            def silu_pair(gate_up=gate_up, outs=outs):
                for g, o in zip(gate_up, outs, strict=True):
                    fp8_quant.quantize_rows(activation.silu_and_mul(g, out=o))

            def silu_alone(gate_up=gate_up, outs=outs, quants=quants):  # store=False
                for g, o, q in zip(gate_up, outs, quants, strict=True):
                    activation.silu_and_mul(g, out=o, quant=q, store=False)

            def silu_scaled(gate_up=gate_up, outs=outs, quants=quants, scales=scales):
                for g, o, q in zip(gate_up, outs, quants, strict=True):
                    activation.silu_and_mul(g, out=o, quant=q, store=False, **scales)

            silu_alone()
            alone = [t.clone() for t in quants[0]]
            silu_fused()
            row["silu_bit_equal"] = bit_equal(quants[0], outs[0])
            row["silu_unstored_bit_equal"] = bit_equal(alone, outs[0])
            silu_scaled()
            scaled = [t.clone() for t in quants[0]]
            row["silu_scaled_bit_equal"] = bit_equal(
                scaled, activation.silu_and_mul(gate_up[0], **scales)
            )
            row["silu_quant_us"] = timed(silu_fused, copies)
            row["silu_quant_unstored_us"] = timed(silu_alone, copies)
            row["silu_quant_scaled_us"] = timed(silu_scaled, copies)
            row["silu_then_quantize_us"] = timed(silu_pair, copies)
            del gate_up, outs, quants
            copies = max(2, (256 << 20) // (rows * 8 * hidden))
            xs = [
                torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
                for _ in range(copies)
            ]
            residuals = [torch.randn_like(x) for x in xs]
            weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
            quants = [fp8_quant.empty_quantized(rows, hidden, "cuda") for _ in xs]

            def norm_fused(xs=xs, residuals=residuals, weight=weight, quants=quants):
                for x, r, q in zip(xs, residuals, quants, strict=True):
                    rms_norm.fused_add_rms_norm(x, r, weight, 1e-5, quant=q)

            def norm_pair(xs=xs, residuals=residuals, weight=weight):
                for x, r in zip(xs, residuals, strict=True):
                    rms_norm.fused_add_rms_norm(x, r, weight, 1e-5)
                    fp8_quant.quantize_rows(x)

            def quantize(xs=xs):
                for x in xs:
                    fp8_quant.quantize_rows(x)

            norm_fused()
            row["norm_bit_equal"] = bit_equal(quants[0], xs[0])
            row["norm_quant_us"] = timed(norm_fused, copies)
            row["norm_then_quantize_us"] = timed(norm_pair, copies)
            row["quantize_rows_us"] = timed(quantize, copies)
            del xs, residuals, quants
            torch.cuda.empty_cache()
            print(model, rows, row, flush=True)
            TABLE.append(
                (
                    f"fp8 input writers {model} x{rows}",
                    f"SiLU+quant {row['silu_quant_us']} us (pair {row['silu_then_quantize_us']}"
                    f", unstored {row['silu_quant_unstored_us']}"
                    f", scaled unstored {row['silu_quant_scaled_us']})",
                    f"norm+quant {row['norm_quant_us']} (pair {row['norm_then_quantize_us']}); "
                    f"quantize_rows {row['quantize_rows_us']}; bit-equal "
                    f"{row['silu_bit_equal'] and row['silu_unstored_bit_equal']}"
                    f" {row['silu_scaled_bit_equal']}"
                    f" {row['norm_bit_equal']}",
                )
            )
    RESULTS["quant"] = res


SILU_ROWS = [128, 172, 256, 384, 512, 768, 8192]


@section("silu-passes")
def silu_passes() -> None:
    """The quantizing SiLU-and-mul unstored (as the engine runs it) with its row held in
    registers (one pass) against two passes (the row stored, then read back), forced through
    activation.MAX_QUANT_ROW, at 8B's and 70B's widths and 128 to 8,192 rows, unscaled (a
    row-wise product) and with a tensor-wise product's row and column scales, in CUDA graphs
    over inputs rotated past L2; the two ways' e4m3 bits checked equal."""
    from lantau.bench.offline import graph_ms
    from lantau.kernels import activation

    res, widest = {}, activation.MAX_QUANT_ROW
    for model, inter in (("8b", 14336), ("70b", 28672)):
        width = 1 << (inter - 1).bit_length()  # the one-pass block
        for rows in SILU_ROWS:
            copies, gate_up, outs, quants, scales = silu_inputs(rows, inter)
            row = res[f"{model} x{rows}"] = {}
            for scaled in (False, True):
                kw = scales if scaled else {}

                def run(gate_up=gate_up, outs=outs, quants=quants, kw=kw):
                    for g, o, q in zip(gate_up, outs, quants, strict=True):
                        activation.silu_and_mul(g, out=o, quant=q, store=False, **kw)

                bits = []
                for name, max_row in (("one", width), ("two", width // 2)):
                    activation.MAX_QUANT_ROW = max_row
                    try:
                        run()
                        bits.append([t.clone() for t in quants[0]])
                        key = f"{'scaled' if scaled else 'plain'} {name}-pass us"
                        row[key] = round(1e3 * graph_ms(run) / copies, 2)
                    finally:
                        activation.MAX_QUANT_ROW = widest
                row[f"{'scaled' if scaled else 'plain'} bit_equal"] = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(*bits, strict=True)
                )
            del gate_up, outs, quants
            torch.cuda.empty_cache()
            print(model, rows, row, flush=True)
            TABLE.append(
                (
                    f"SiLU+quant unstored {model} x{rows}",
                    f"plain one {row['plain one-pass us']} / two {row['plain two-pass us']} us",
                    f"scaled one {row['scaled one-pass us']} / two {row['scaled two-pass us']};"
                    f" bit-equal {row['plain bit_equal']} {row['scaled bit_equal']}",
                )
            )
    RESULTS["silu_passes"] = res


@section("accum")
def accum() -> None:
    """Each projection shape at each row count: `_scaled_mm` (x quantized by the engine's kernel)
    with use_fast_accum False and True, timed in one CUDA graph over enough weight copies that
    L2 holds none (decode sizes); TFLOP/s, GB/s of weights, and each one's error against the
    dequantized fp32 product on the first 256 rows."""
    from lantau.bench.offline import graph_ms
    from lantau.kernels import fp8_quant
    from lantau.model import fp8

    res = {}
    for name, (n, k) in {**SHAPES_8B, **SHAPES_70B}.items():
        copies = max(2, (1 << 30) // (n * k))  # about 1 GB of e4m3 weights
        ws = [fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        w_ref = fp8.dequantize_rows(*ws[0])  # [N, K] fp32
        for m in ACCUM_ROWS:
            used = ws if m < 2048 else ws[:2]  # prefill sizes are compute-bound
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_quant.quantize_rows(x)
            ref = fp8.dequantize_rows(xq[:256], xs[:256]) @ w_ref.T
            row = {}
            for fast in (False, True):

                def run(fast=fast, used=used, xq=xq, xs=xs):
                    return [fp8.scaled_mm(xq, xs, q, s, fast) for q, s in used]

                err = rel_err(run()[0][:256], ref)
                ms = graph_ms(run) / len(used)
                key = "fast" if fast else "slow"
                row[key] = {
                    "us": round(1e3 * ms, 2),
                    "tflop_s": round(2 * m * n * k / ms / 1e9, 1),
                    "weight_gb_s": round(n * k / ms / 1e6, 1),
                    "rel_err": err,
                }
                torch.cuda.empty_cache()
            res[f"{name} x{m}"] = row
            slow, fast_ = row["slow"], row["fast"]
            TABLE.append(
                (
                    f"_scaled_mm {name} {n}x{k}, {m} rows",
                    f"fast {fast_['tflop_s']:.0f} vs {slow['tflop_s']:.0f} TFLOP/s "
                    f"({fast_['weight_gb_s']:.0f} vs {slow['weight_gb_s']:.0f} GB/s)",
                    f"err {fast_['rel_err']:.1e} vs {slow['rel_err']:.1e}",
                )
            )
            print(TABLE[-1], flush=True)
            del x, xq, xs, ref
        del ws, w_ref
        torch.cuda.empty_cache()
    RESULTS["accum"] = res


@section("scaling")
def scaling() -> None:
    """Whether the row-wise scaled fp8 GEMM (`_scaled_mm` with [M, 1] and [1, N] scales: a
    CUTLASS kernel in torch) leaves speed behind cuBLASLt's tensor-wise one (scalar scales,
    here 1: the scales would then be applied by the kernels that read the product), and both
    against bf16 `torch.mm`, at the 8B and 70B shapes, fast accumulation, in CUDA graphs over
    weight copies L2 cannot hold: TFLOP/s, and the tensor-wise product's error against the
    row-wise one once scaled."""
    from lantau.bench.offline import graph_ms
    from lantau.kernels import fp8_quant
    from lantau.model import fp8

    one = torch.ones((), device="cuda")
    res = {}
    for name, (n, k) in {**SHAPES_8B, **SHAPES_70B}.items():
        if SCALING_SHAPES and not any(part in name for part in SCALING_SHAPES):
            continue
        copies = max(2, (1 << 30) // (n * k))
        ws = [fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for m in SCALING_ROWS:
            used = ws if m < 2048 else ws[:2]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_quant.quantize_rows(x)

            def rowwise(used=used, xq=xq, xs=xs):
                return [fp8.scaled_mm(xq, xs, q, s) for q, s in used]

            def tensorwise(used=used, xq=xq):
                return [
                    torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one,
                                     out_dtype=torch.bfloat16, use_fast_accum=True)
                    for q, _ in used
                ]  # fmt: skip

            def bf16(wb=wb, x=x):
                return [x @ w.t() for w in wb]

            scaled = tensorwise()[0].float() * xs[:, None] * ws[0][1][None, :]
            err = rel_err(scaled, rowwise()[0].float())
            row = {}
            for key, fn, count in (("rowwise", rowwise, len(used)),
                                   ("tensorwise", tensorwise, len(used)),
                                   ("bf16", bf16, len(wb))):  # fmt: skip
                ms = graph_ms(fn) / count
                row[key] = round(2 * m * n * k / ms / 1e9, 1)
            row["tensorwise_rel_err"] = err
            res[f"{name} x{m}"] = row
            TABLE.append((
                f"fp8 scaling {name} {n}x{k}, {m} rows",
                f"tensor-wise {row['tensorwise']:.0f} vs row-wise {row['rowwise']:.0f} TFLOP/s",
                f"bf16 {row['bf16']:.0f}; err {err:.1e}",
            ))  # fmt: skip
            print(TABLE[-1], flush=True)
            del x, xq, xs, scaled
            torch.cuda.empty_cache()
        del ws, wb
        torch.cuda.empty_cache()
    RESULTS["scaling"] = res


def run_workload(llm, spec: str, num_prompts: int | None, label: str, default_n: int) -> dict:
    if ONLY and label.split()[0] not in ONLY:
        return {}
    from lantau.bench.offline import run_lantau
    from lantau.bench.workloads import make_workload

    w = make_workload(spec, llm.config.model_config.vocab_size, num_prompts)
    if num_prompts and num_prompts < default_n:
        print(f"{label}: {num_prompts} prompts, trimmed from {default_n}", flush=True)
    records: list[dict] = []
    core = llm.engine.core
    heap = {}  # the collector's view: objects frozen at the start and mid-run, gen 2's size

    def record(step: dict) -> None:
        records.append(step)
        if len(records) == 100:
            heap.update(frozen_mid=gc.get_freeze_count(), gen2_mid=len(gc.get_objects(2)))

    def record_steps():
        heap["frozen_at_start"] = gc.get_freeze_count()
        core.on_step = record

    pauses = GcPauses().install()  # the host's collections during the run (a stall each)
    compiles = CompileWatch().install()  # Triton's during the run: a step waited on each
    try:
        stats = run_lantau(llm, w, on_start=record_steps).summary()
    finally:
        core.on_step = None
        pauses.uninstall()
        compiles.uninstall()
    stats["num_prompts_default"] = default_n
    stats["steps"] = wall_step_times(records)
    collected = pauses.drain()
    stats["gc"] = {
        "collections": len(collected),
        "s": round(sum(s for _, s in collected), 3),
        "max_ms": round(1e3 * max((s for _, s in collected), default=0.0), 2),
        "full": sum(g == 2 for g, _ in collected),
        **heap,
    }
    stats["compiles"] = compiles.summary()
    RESULTS[label] = stats
    print(label, json.dumps(stats), flush=True)
    trimmed = f" (of {default_n})" if w.num_prompts < default_n else ""
    if spec in ("W2",) or label.endswith("bs1"):
        fig = f"{stats['ms_per_token']:.2f} ms/tok"
    else:
        fig = f"{stats['output_tok_s']:.0f} tok/s"
    TABLE.append(
        (
            f"{label} x{w.num_prompts}{trimmed}",
            fig,
            f"target {TARGETS.get(label.split()[0], '-')}; gpu {stats['gpu_util_pct']}%, "
            f"p95 e2e {stats['e2e_p95_s']} s, at {elapsed():.0f} s; gc {stats['gc']['s']} s "
            f"(longest {stats['gc']['max_ms']} ms); Triton compiles "
            f"{stats['compiles']['compiles']} ({stats['compiles']['s']} s); steps "
            + ", ".join(
                f"{kind} {k['steps']} x {k['ms']} ms (p50 {k['p50_ms']}, {k['slow']} slow "
                f"+{k['slow_s']} s, {k['behind']} behind; {k['reqs']} reqs, {k['tokens']} tokens)"
                for kind, k in stats["steps"].items()
            ),
        )
    )
    return stats


def reference_inputs(vocab: int):
    """A fixed 512-token sequence and eight 64-token prompts of random ids."""
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(256, vocab, (512,), generator=gen).tolist()
    prompts = [torch.randint(256, vocab, (64,), generator=gen).tolist() for _ in range(8)]
    return text, prompts


def one_at_a_time(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt alone: batch-1 decode, the GEMV path."""
    from lantau.bench import accuracy

    return [accuracy.greedy_tokens(llm, [p], num_tokens)[0] for p in prompts]


@section("w2-bf16")
def w2_bf16(ref: dict) -> None:
    from lantau import LLM
    from lantau.bench import accuracy

    t = time.perf_counter()
    llm = LLM("random:llama3-8b", dtype="bfloat16", max_model_len=4096, max_num_seqs=8)
    print(f"engine up in {time.perf_counter() - t:.1f} s", flush=True)
    run_workload(llm, "W2", None, "W2-bf16", 1)
    text, prompts = reference_inputs(llm.config.model_config.vocab_size)
    ref["logits"] = accuracy.sequence_logits(llm.engine.core.runner.model, text)
    ref["tokens"] = one_at_a_time(llm, prompts, 32)
    del llm


def fp8_8b_engine(max_num_seqs: int):
    from lantau import LLM

    args = {"max_num_batched_tokens": 65536, **FP8_ENGINE_ARGS}  # --fp8-engine-args may set it
    return LLM(
        "random:llama3-8b", dtype="fp8", max_model_len=4096, max_num_seqs=max_num_seqs, **args
    )


def more_sizes(make, sizes: list[int], runs) -> None:
    """A fresh engine for each further max_num_seqs (`make(size)`, the last one freed first)
    and its throughput rows: `runs` of (workload, label, count, default count), labelled
    "LABEL sN"."""
    for size in sizes:
        gc.collect()
        torch.cuda.empty_cache()
        if elapsed() > section.budget_s - 60:
            TABLE.append((f"max_num_seqs {size}", "skipped", f"budget at {elapsed():.0f} s"))
            continue
        try:
            llm = make(size)
            for spec, label, num_prompts, default_n in runs:
                run_workload(llm, spec, num_prompts, f"{label} s{size}", default_n)
        except Exception as e:
            traceback.print_exc()
            TABLE.append((f"max_num_seqs {size}", "FAILED", f"{type(e).__name__}: {str(e)[:70]}"))
        llm = None


@section("fp8-8b")
def fp8_8b(ref: dict, counts: dict[str, int], seqs: list[int]) -> None:
    from lantau.bench import accuracy

    t = time.perf_counter()
    llm = fp8_8b_engine(seqs[0])
    RESULTS["fp8_8b_start_s"] = time.perf_counter() - t
    print(f"engine up in {RESULTS['fp8_8b_start_s']:.1f} s", flush=True)
    if "logits" in ref:
        text, prompts = reference_inputs(llm.config.model_config.vocab_size)
        logits = accuracy.sequence_logits(llm.engine.core.runner.model, text)
        tokens = one_at_a_time(llm, prompts, 32)
        acc = {
            "logits_rel_err": rel_err(logits, ref["logits"]),
            "top1_agreement": (logits.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item(),
            "greedy_agreement_bs1": accuracy.leading_agreement(tokens, ref["tokens"]),
            "perplexity_of_random_text": accuracy.perplexity(logits, text),
            "bf16_perplexity_of_random_text": accuracy.perplexity(ref["logits"], text),
        }
        RESULTS["fp8_vs_bf16_8b"] = acc
        print(json.dumps(acc), flush=True)
        TABLE.append(
            (
                "llama3-8b fp8 vs bf16 (random)",
                f"logits rel err {acc['logits_rel_err']:.3f}",
                f"top-1 {acc['top1_agreement']:.3f}, greedy bs1 {acc['greedy_agreement_bs1']:.3f}",
            )
        )
    run_workload(llm, "W2", None, "W2-fp8", 1)
    if "W2-bf16" in RESULTS and "W2-fp8" in RESULTS and "ms_per_token" in RESULTS["W2-bf16"]:
        ratio = RESULTS["W2-fp8"]["ms_per_token"] / RESULTS["W2-bf16"]["ms_per_token"]
        TABLE.append(("W2-fp8 / W2-bf16", f"{100 * ratio:.1f} %", "target <= 55 %"))
    defaults = {"W3-128": 30000, "W3-1000": 3000, "W3-2048": 3000}
    for spec in ("W3-128", "W3-1000", "W3-2048"):
        label = spec.replace("W3-", "W3-fp8-")
        if elapsed() > section.budget_s - 200:  # leave the 70B its time
            TABLE.append((label, "skipped", f"budget at {elapsed():.0f} s"))
            continue
        try:
            run_workload(llm, spec, counts[spec], label, defaults[spec])
        except Exception as e:
            traceback.print_exc()
            TABLE.append((label, "FAILED", f"{type(e).__name__}: {str(e)[:70]}"))
    del llm
    runs = [("W3-128", "W3-fp8-128", counts["W3-128"], 30000),
            ("W3-1000", "W3-fp8-1000", counts["W3-1000"], 3000)]  # fmt: skip
    more_sizes(fp8_8b_engine, seqs[1:], runs)


@section("w4")
def w4(counts: dict[str, int], seqs: list[int]) -> None:
    from lantau import LLM

    def make(max_num_seqs: int, max_num_batched_tokens: int = 16384):
        # --fp8-engine-args may set max_num_batched_tokens (a smaller step's activations leave
        # the KV cache more of the card)
        args = {"max_num_batched_tokens": max_num_batched_tokens, **FP8_ENGINE_ARGS}
        return LLM(
            "random:llama3-70b", dtype="fp8", max_model_len=2048, max_num_seqs=max_num_seqs,
            scheduling_policy="guaranteed_no_evict", **args,
        )  # fmt: skip

    t = time.perf_counter()
    sizes = {"max_num_seqs": seqs[0], "max_num_batched_tokens": 16384}
    llm = None
    try:
        llm = make(**sizes)
    except torch.OutOfMemoryError:
        traceback.print_exc()
    if llm is None:  # once more, smaller steps and fewer graphs (the failed one's frames gone)
        gc.collect()
        torch.cuda.empty_cache()
        sizes = {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
        print(f"70B engine out of memory: once more with {sizes}", flush=True)
        llm = make(**sizes)
    sizes["max_num_batched_tokens"] = llm.config.scheduler.max_num_batched_tokens
    RESULTS["w4_engine"] = sizes
    start_s = RESULTS["w4_start_s"] = time.perf_counter() - t
    used = torch.cuda.memory_allocated() / 1e9
    blocks = llm.config.cache.num_blocks
    print(f"70B fp8 engine up in {start_s:.1f} s, {used:.1f} GB, {blocks} KV blocks", flush=True)
    TABLE.append(("llama3-70b fp8 engine", f"up in {start_s:.0f} s", f"{blocks} KV blocks"))
    run_workload(llm, "in:128/out:512", 1, "W4-bs1", 1)
    # W4-1000: no more than the KV cache holds at once, twice (a count of 0: once, one wave)
    held = max(blocks * llm.config.cache.block_size // 2000, 1)
    n_1000 = min(counts["W4-1000"], 2 * held) if counts["W4-1000"] > 0 else held
    runs = [("W3-128", "W4-128", counts["W4-128"], 30000), ("W3-1000", "W4-1000", n_1000, 3000)]
    for spec, label, n, default_n in runs:
        if elapsed() > section.budget_s - 30:
            TABLE.append((label, "skipped", f"budget at {elapsed():.0f} s"))
            continue
        try:
            run_workload(llm, spec, n, label, default_n)
        except Exception as e:
            traceback.print_exc()
            TABLE.append((label, "FAILED", f"{type(e).__name__}: {str(e)[:70]}"))
    del llm
    more_sizes(make, seqs[1:], runs)


@section("sweep")
def sweep() -> None:
    """Each shape: its weights rotated through enough copies that L2 holds none, chained in
    one CUDA graph; GB/s = weight bytes read / time."""
    from lantau.bench.offline import graph_ms
    from lantau.kernels.gemv import PRELOAD_MAX_K, default_config, gemv, preload_config
    from lantau.kernels.reference import gemv_ref
    from lantau.model import fp8

    results = {}
    for name, (n, k) in {**SHAPES_8B, **SHAPES_70B}.items():
        if elapsed() > section.budget_s + 40:
            TABLE.append((f"sweep {name}", "skipped", f"budget at {elapsed():.0f} s"))
            continue
        copies = max(2, (1 << 30) // (n * k))  # about 1 GB of fp8 weights
        wide = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        quant = [fp8.quantize_rows(w) for w in wide]
        xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in wide]
        ref = gemv_ref(xs[0], quant[0][0], weight_scale=quant[0][1])
        fp8_gb, bf16_gb = copies * n * (k + 4) / 1e6, copies * n * k * 2 / 1e6  # / ms: GB/s
        # rows of at most 8 KB preload, as the model calls it (KernelConfig.gemv_preload_max_bytes)
        preload, bf16_preload = k <= 8192, k <= 4096
        base = preload_config(n, k) if bf16_preload else default_config(n, k)

        def bf16_run(wide=wide, xs=xs, preload=bf16_preload):
            return [gemv(x, w, preload=preload) for x, w in zip(xs, wide, strict=True)]

        row = {"bf16 default": bf16_gb / graph_ms(bf16_run)}
        tiles = [(t, False) for t in LOOP_TILES]
        tiles += [(t, True) for t in PRELOAD_TILES] if k <= PRELOAD_MAX_K else []
        for tile, pre in [(None, preload), *tiles]:
            key = f"{'preload ' if pre else ''}{tile}" if tile else "default"

            def run(tile=tile, pre=pre, quant=quant, xs=xs):
                return [
                    gemv(x, q, config=tile, preload=pre, weight_scale=s)
                    for x, (q, s) in zip(xs, quant, strict=True)
                ]

            try:
                if rel_err(run()[0], ref) > 1e-2:
                    print(name, key, "wrong result: skipped", flush=True)
                    continue
                row[key] = fp8_gb / graph_ms(run)
            except Exception as e:  # a tiling that does not build: skipped
                print(name, key, type(e).__name__, str(e)[:80], flush=True)
        results[name] = row
        best = max((key for key in row if key != "bf16 default"), key=row.get)
        default_gb = row.get("default", float("nan"))
        TABLE.append(
            (
                f"fp8 GEMV {name} {n}x{k}",
                f"default {default_gb:.0f} GB/s, best {best} {row[best]:.0f}",
                f"bf16 GEMV {row['bf16 default']:.0f} GB/s (default {base})",
            )
        )
        print(TABLE[-1], json.dumps({k_: round(v, 1) for k_, v in row.items()}), flush=True)
        del wide, quant, xs
        torch.cuda.empty_cache()
    RESULTS["sweep"] = results


def parse_counts(spec: str) -> dict[str, int]:
    """ "W3-128=6144,W4-1000=128" -> counts, over the defaults."""
    counts = {"W3-128": 4608, "W3-1000": 768, "W3-2048": 400, "W4-128": 1024, "W4-1000": 128}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        counts[key] = int(value)
    return counts


def main() -> None:
    global FP8_ENGINE_ARGS, ONLY
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-s", type=float, default=section.budget_s, help="start no section after"
    )
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument(
        "--counts",
        default="",
        help="request counts, e.g. W3-128=4608,W3-1000=768,W4-1000=128 (W4-1000=0: one wave)",
    )
    parser.add_argument(
        "--fp8-engine-args",
        default="{}",
        help='JSON of more LLM() arguments for the fp8 engines, e.g. \'{"kv_cache_dtype": "fp8"}\'',
    )
    parser.add_argument("--w3-seqs", default="384", help="the 8B fp8 engines' max_num_seqs")
    parser.add_argument("--w4-seqs", default="512", help="the 70B fp8 engines' max_num_seqs")
    parser.add_argument("--only", default="", help="workload labels to run, e.g. W4-128,W2-fp8")
    parser.add_argument(
        "--scaling-rows", default="", help="the scaling section's rows, e.g. 171,192,256"
    )
    parser.add_argument(
        "--scaling-shapes",
        default="",
        help="scaling shapes: names containing, e.g. 70b",
    )
    args = parser.parse_args()
    if args.scaling_rows:
        SCALING_ROWS[:] = [int(v) for v in args.scaling_rows.split(",")]
    SCALING_SHAPES[:] = [v for v in args.scaling_shapes.split(",") if v]
    ONLY = {v for v in args.only.split(",") if v}
    w3_seqs = [int(v) for v in args.w3_seqs.split(",")]
    w4_seqs = [int(v) for v in args.w4_seqs.split(",")]
    section.budget_s = args.budget_s
    FP8_ENGINE_ARGS = json.loads(args.fp8_engine_args)
    skip = set(args.skip.split(","))
    counts = parse_counts(args.counts)
    print(torch.__version__, torch.cuda.get_device_name(), counts, FP8_ENGINE_ARGS, flush=True)
    RESULTS["fp8_engine_args"] = FP8_ENGINE_ARGS
    ref: dict = {}
    for name, fn, fn_args in [
        ("ceilings", ceilings, ()),
        ("kernels", kernels, ()),
        ("quant", quant, ()),
        ("silu-passes", silu_passes, ()),
        ("accum", accum, ()),
        ("scaling", scaling, ()),
        ("w2-bf16", w2_bf16, (ref,)),
        ("fp8-8b", fp8_8b, (ref, counts, w3_seqs)),
        ("w4", w4, (counts, w4_seqs)),
        ("sweep", sweep, ()),
    ]:
        if name not in skip:
            fn(*fn_args)
        if name == "fp8-8b":
            ref.clear()
    RESULTS["total_s"] = elapsed()
    print(f"\ntotal {elapsed():.0f} s")
    section.report("gpu_fp8.json")


if __name__ == "__main__":
    main()
