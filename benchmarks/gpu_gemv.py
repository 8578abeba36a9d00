"""The decode GEMV kernel on the lent GPU, then W2 with it and without it in one run.

1. Each llama3-8b projection at M = 1, 2, 4, 8 (32 weight copies, one per layer, rotated through
   a CUDA graph so L2 holds none of them): cuBLAS (F.linear) against GEMV tile configurations,
   each checked against an fp32 reference; the best per shape is kept.
   With programmatic dependent launch (PDL) and without.
2. An engine (random:llama3-8b, bf16) with those tiles: the batch-1 decode graph at 384 keys and
   W2 with each piece of the batch-1 path turned off in turn (norms / SiLU / residual adds
   folded into the GEMVs, PDL, the decode attention's in-launch merge), graphs recaptured each
   time, same engine, same run, tokens and logits checked against the first.
3. Optionally W3-1000 (--w3 N prompts) on the same engine (max_num_seqs from --max-num-seqs).

    PYTHONPATH=. python3 benchmarks/gpu_gemv.py [--sweep] [--preload] [--engine-only] [--w3 1000]
        [--max-num-seqs 512]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from lantau.bench.offline import batch1_graph, graph_ms, replay_ms
from lantau.kernels import pdl
from lantau.kernels.gemv import PRELOAD_MAX_K, default_config, gemv, gemv_ref

SHAPES = {  # name -> (N, K, copies)
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}
CONFIGS = list(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (3, 4)))
SWEEP = False  # --sweep: all CONFIGS at M = 1 (the best reused at 2-8); else default_config
PRELOAD = False  # --preload: whole-slice loads before the PDL wait, A/B'd per shape and in W2
PRELOAD_CONFIGS = [(2, 0, 4, 1), (4, 0, 4, 1), (4, 0, 8, 1), (8, 0, 8, 1), (2, 0, 2, 1)]
PRELOAD_CONFIGS_LONG = [(2, 0, 8, 1), (1, 0, 4, 1), (1, 0, 8, 1), (2, 0, 16, 1)]  # K > 4096
BEST_PRELOAD: dict[tuple[int, int], tuple] = {}
TABLE: list[str] = []
RESULTS: dict = {}


def sweep() -> dict[tuple[int, int], tuple]:
    best_configs = {}
    for name, (n, k, copies) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = sum(w.numel() * 2 for w in ws)
        row = {}
        for m in (1,):  # 2-8 rows: slower than cuBLAS (runs/2026-12-03-gpu_gemv-sweep-peeled.log)
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = gemv_ref(xs[0], ws[0])

            def cublas(xs=xs, ws=ws):
                for w, x in zip(ws, xs, strict=True):
                    F.linear(x, w)

            base = graph_ms(cublas)
            if not SWEEP:
                cands = [default_config(n, k)]
            else:
                cands = CONFIGS if m == 1 else [best_configs[(n, k)]]
            timed = {}
            for cfg in cands:
                try:
                    out = gemv(xs[0], ws[0], config=cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        timed[cfg] = (float("inf"), err)
                        continue

                    def run(xs=xs, ws=ws, cfg=cfg):
                        for w, x in zip(ws, xs, strict=True):
                            gemv(x, w, config=cfg)

                    timed[cfg] = (graph_ms(run), err)
                except Exception as e:  # a config that fails to compile is skipped
                    print(name, m, cfg, type(e).__name__, str(e)[:80], flush=True)
            cfg = min(timed, key=lambda c: timed[c][0])
            if m == 1:
                best_configs[(n, k)] = cfg
            ms, err = timed[cfg]
            pdl.set_enabled(False)  # the same chain of launches without PDL

            def run_nopdl(xs=xs, ws=ws, cfg=cfg):
                for w, x in zip(ws, xs, strict=True):
                    gemv(x, w, config=cfg)

            ms_nopdl = graph_ms(run_nopdl)
            pdl.set_enabled(True)
            preloaded = {}
            pcfgs = PRELOAD_CONFIGS if k <= 4096 else PRELOAD_CONFIGS_LONG
            for pcfg in pcfgs if PRELOAD and k <= PRELOAD_MAX_K else []:

                def run_pre(xs=xs, ws=ws, pcfg=pcfg):
                    for w, x in zip(ws, xs, strict=True):
                        gemv(x, w, config=pcfg, preload=True)

                out = gemv(xs[0], ws[0], config=pcfg, preload=True)
                p_err = ((out.float() - ref).norm() / ref.norm()).item()
                preloaded[pcfg] = (round(nbytes / graph_ms(run_pre) / 1e9, 3), f"{p_err:.1e}")
            if preloaded:
                BEST_PRELOAD[(n, k)] = max(preloaded, key=lambda c: preloaded[c][0])
            row[m] = {
                "cublas_ms": round(base, 4),
                "cublas_tb_s": round(nbytes / base / 1e9, 3),
                "gemv_ms": round(ms, 4),
                "gemv_tb_s": round(nbytes / ms / 1e9, 3),
                "gemv_nopdl_tb_s": round(nbytes / ms_nopdl / 1e9, 3),
                "config": cfg,
                "rel_err": float(f"{err:.2e}"),
                "preload_tb_s_err": {str(c): v for c, v in preloaded.items()},
            }
            pre = "".join(f", preload {c[0]}x{c[2]}w: {t} TB/s err {e}"
                          for c, (t, e) in preloaded.items())  # fmt: skip
            TABLE.append(
                f"| {name} M={m} | cuBLAS {row[m]['cublas_tb_s']} TB/s | GEMV {cfg} "
                f"{row[m]['gemv_tb_s']} TB/s (without PDL {row[m]['gemv_nopdl_tb_s']}), "
                f"err {row[m]['rel_err']}{pre} |"
            )
            print(TABLE[-1], flush=True)
        RESULTS[name] = row
        del ws
        torch.cuda.empty_cache()
    return best_configs


def engine_runs(best_configs, w3: int, max_num_seqs: int) -> None:
    from lantau import LLM, SamplingParams
    from lantau.bench.offline import run_lantau
    from lantau.bench.workloads import make_workload

    llm = LLM(
        "random:llama3-8b", max_model_len=4096, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
    )  # fmt: skip
    core = llm.engine.core
    ops = core.runner.model.ops
    if SWEEP:
        ops.gemv_configs.update(best_configs)
    w2 = make_workload("W2", 128256)
    parity: dict = {}
    # the engine's path first (the parity reference), then each piece switched in turn, the
    # earlier path (GEMV, fused rope + KV write only), and the first again; or with --preload
    # the first with and without whole-slice preloading
    flags = (
        "use_gemv", "fuse_rope_kv", "fuse_decode", "fuse_qkv_rope", "fuse_attn_merge",
        "gemv_preload", "pdl",
    )  # fmt: skip
    today = {**{f: getattr(ops, f) for f in flags[:-1]}, "pdl": True}
    ops.preload_configs.update(BEST_PRELOAD)
    if PRELOAD:  # the engine as it is, then with the rotary and KV write in qkv_proj's
        # GEMV epilogue. Measured before (runs/2026-12-03g-gemv_fused.log):
        # down_proj preloaded (4.142 vs 4.126 ms/token) and the norms / SiLU / adds folded
        # into the preloading GEMVs (4.185; 5.6 with down_proj preloaded), both slower
        # then each split's first KV tile of decode attention loaded before the PDL wait
        # (runs/2026-12-03h-gemv_ab.log: early KV loads on since); then the greedy pick inside
        # the CUDA graph (runs/2026-12-03k-w2_greedy_ab.log: no gain, off since)
        # and the sampler's one-launch argmax kernel and the SiLU-and-mul in gate_up's
        # epilogue (runs/2026-12-03l-gemv_l2.log: both on since; the L2 prefetch of later
        # waves' rows by the first wave, 2b26ac9, was slower: 4.204 / 4.323 at 16 / 32 MB);
        # then (runs/2026-12-03m-gemv_ab.log) the norms' weights and rotary's inputs loaded
        # before the PDL wait (3.913 vs 3.907 off: noise, kept on) and the greedy pick inside
        # the graph through the argmax kernel (3.866, on since); now decode attention's merge
        # folding split partials one by one (as before), and its early-KV tiling at 8 warps
        # (no spills) and at 32 keys, and rotary + KV write inside decode attention
        variants = [
            today,
            {**today, "attn_merge_chunk": 1},
            {**today, "attn_early_config": (64, 8, 2)},
            {**today, "attn_early_config": (32, 4, 2)},
            {**today, "attn_early_config": (32, 8, 2)},
            {**today, "fuse_rope_attention": True},
            {**today, "fuse_rope_attention": True, "attn_early_config": (64, 8, 2)},
            {**today, "greedy_in_graph": False},
            today,
        ]
    else:
        variants = [
            today,
            {**today, "fuse_decode": not today["fuse_decode"]},
            {**today, "pdl": False},
            {**today, "fuse_attn_merge": False},
            {**today, "fuse_decode": False, "fuse_attn_merge": False, "pdl": False},
            today,
        ]
    for variant in variants:
        on = [f for f in flags if variant[f]]
        key = "W2-with-" + "-".join(on)
        for flag in flags[:-1]:
            setattr(ops, flag, variant[flag])
        ops.preload_max_k = variant.get("preload_max_k", 4096)
        key += "-down" if ops.gemv_preload and ops.preload_max_k > 4096 else ""
        ops.attn_early_kv_rows = variant.get("attn_early_kv_rows", 8)
        key += "-early_kv" if ops.attn_early_kv_rows else ""
        greedy_in_graph = variant.get("greedy_in_graph", True)
        key += "-greedy_in_graph" if greedy_in_graph else ""
        ops.attn_merge_chunk = variant.get("attn_merge_chunk")
        key += f"-merge_chunk{ops.attn_merge_chunk}" if ops.attn_merge_chunk else ""
        ops.attn_early_config = variant.get("attn_early_config")
        ops.fuse_rope_attention = variant.get("fuse_rope_attention", False)
        key += "-rope_in_attn" if ops.fuse_rope_attention else ""
        key += "-attn{}x{}x{}".format(*ops.attn_early_config) if ops.attn_early_config else ""
        core.runner.sampler.argmax_kernel = variant.get("argmax_kernel", True)
        key += "-argmax_kernel" if core.runner.sampler.argmax_kernel else ""
        ops.fuse_gate_silu = variant.get("fuse_gate_silu", True)
        key += "-fuse_gate_silu" if ops.fuse_gate_silu else ""
        ops.early_inputs = variant.get("early_inputs", True)
        key += "-early_inputs" if ops.early_inputs else ""
        pdl.set_enabled(variant["pdl"])
        try:
            core.runner.capture_cuda_graphs()
            if core.runner.graphs.greedy_in_graph != greedy_in_graph:  # recaptured
                core.runner.graphs.greedy_in_graph = greedy_in_graph
                core.runner.graphs.argmax_kernel = core.runner.sampler.argmax_kernel
                core.runner.graphs.graphs.clear()
                core.runner.graphs.capture()
        except Exception as e:  # e.g. PDL launches that graph capture refuses
            TABLE.append(f"| {key} | capture failed: {type(e).__name__} {str(e)[:200]} | |")
            print(TABLE[-1], flush=True)
            continue
        graph_1 = replay_ms(batch1_graph(core.runner.graphs, 384, llm.config.cache.block_size))
        # correctness in the engine: greedy tokens and last logits against the first variant
        check = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()  # the prompt computed afresh, as in the first variant
        out = llm.generate({"prompt_token_ids": w2.prompts[0]}, check)[0].outputs[0].token_ids
        last = next(iter(core.runner.last_logits.values())).float().clone()
        ref_tokens, ref_last = parity.setdefault("ref", (out, last))
        same = next(
            (i for i, (a, b) in enumerate(zip(out, ref_tokens, strict=True)) if a != b), len(out)
        )
        rel = ((last - ref_last).norm() / ref_last.norm()).item() if same == len(out) else None
        stats = run_lantau(llm, w2).summary()
        RESULTS.setdefault(key, []).append(
            {"graph_bs1_seq384_ms": graph_1, "tokens_equal": same, "last_logits_rel": rel, **stats}
        )
        TABLE.append(
            f"| {key} | {stats['ms_per_token']:.3f} ms/token | decode graph bs1 at 384 keys "
            f"{graph_1:.3f} ms, GPU util {stats['gpu_util_pct']}%; vs first variant: "
            f"{same}/32 greedy tokens equal, last logits rel err {rel} |"
        )
        print(TABLE[-1], flush=True)
    if w3:
        stats = run_lantau(llm, make_workload("W3-1000", 128256, w3)).summary()
        stats["preemptions"] = core.scheduler.num_preemptions
        RESULTS["W3-1000"] = stats
        TABLE.append(
            f"| W3-1000 x{w3}, max_num_seqs {max_num_seqs} | {stats['output_tok_s']:.0f} tok/s | "
            f"GPU util {stats['gpu_util_pct']}%, preemptions {stats['preemptions']}, "
            f"{llm.config.cache.num_blocks} KV blocks |"
        )
        print(TABLE[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--w3", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--preload", action="store_true")
    parser.add_argument("--engine-only", action="store_true", help="skip the kernel sweep")
    args = parser.parse_args()
    global SWEEP, PRELOAD
    SWEEP, PRELOAD = args.sweep, args.preload
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    best = {} if args.engine_only else sweep()
    RESULTS["best_configs"] = {f"{n}x{k}": c for (n, k), c in best.items()}
    try:
        engine_runs(best, args.w3, args.max_num_seqs)
    finally:
        with open(os.path.join(os.environ.get("OUT", "."), "gpu_gemv.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
        print("\n| what | baseline | result |")
        print("\n".join(TABLE))


if __name__ == "__main__":
    main()
