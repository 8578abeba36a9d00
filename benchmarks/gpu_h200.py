"""One run on the lent H200: kernel checks at real shapes, triton-vs-torch end to end, the
card's ceilings, HF peers, and the W2 / W5 / W3 workloads. Prints a short table last and
writes everything as JSON to $OUT/gpu_h200.json.

    PYTHONPATH=. python3 benchmarks/gpu_h200.py [--w3-scale 0.1] [--skip-peers]

Each stage runs on its own: a failure is reported and the next stage still runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from _stages import Stages, rel_err

stage = Stages()
RESULTS, TABLE = stage.results, stage.table


@stage("kernels")
def check_kernels() -> None:
    import triton.testing

    from lantau.kernels import activation, embedding, rms_norm, rotary
    from lantau.kernels import reference as ref
    from lantau.model.llama import rope_inv_freq
    from lantau.model.ops import build_cos_sin_cache
    from lantau.model.random_weights import RANDOM_SHAPES

    dev, bf16 = "cuda", torch.bfloat16
    res = {}
    t = 8192
    x = torch.randn(t, 4096, device=dev, dtype=bf16)
    w = torch.randn(4096, device=dev, dtype=bf16)
    res["rms_norm"] = rel_err(rms_norm.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5))
    r1, x1 = torch.randn_like(x), x.clone()
    x2, r2 = ref.add_rms_norm_ref(x, r1, w, 1e-5)
    rms_norm.fused_add_rms_norm(x1, r1, w, 1e-5)
    res["fused_add_rms_norm"] = max(rel_err(x1, x2), rel_err(r1, r2))
    g = torch.randn(t, 2 * 14336, device=dev, dtype=bf16)
    res["silu_and_mul"] = rel_err(activation.silu_and_mul(g), ref.silu_and_mul_ref(g))
    ms = triton.testing.do_bench(lambda: activation.silu_and_mul(g), return_mode="median")
    res["silu_and_mul_tb_s"] = (g.numel() * 2 * 1.5) / ms / 1e9

    cfg = RANDOM_SHAPES["llama3-8b"]
    inv = rope_inv_freq(128, cfg.rope_theta, cfg.rope_scaling).to(dev)
    cache = build_cos_sin_cache(inv, 16384)
    qkv = torch.randn(t, 6144, device=dev, dtype=bf16)
    q, k = qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128)
    v = qkv[:, 5120:].view(t, 8, 128)
    pos = torch.randint(0, 16384, (t,), device=dev)
    num_blocks, bs = 4096, 16
    kv = torch.randn(2, num_blocks, bs, 8, 128, device=dev, dtype=bf16)
    kv2 = kv.clone()
    slots = torch.randperm(num_blocks * bs, device=dev)[:t]
    q_ref, k_ref = ref.rotary_ref(q, k, pos, cache)
    ref.write_kv_cache_ref(k_ref, v, kv2, slots)
    rotary.apply_rotary_and_write_kv(q, k, v, pos, cache, kv, slots)
    res["rotary_write_kv"] = max(rel_err(q, q_ref), rel_err(kv, kv2))
    table = torch.randn(128256, 4096, device=dev, dtype=bf16)
    ids = torch.randint(0, 128256, (t,), device=dev)
    prev = torch.randint(0, 128256, (512,), device=dev)
    src = torch.where(torch.rand(t, device=dev) < 0.5, torch.randint(0, 512, (t,), device=dev), -1)
    res["embedding_pick"] = rel_err(
        embedding.embedding(ids, table, src, prev), ref.embedding_ref(ids, table, src, prev)
    )
    res.update(check_attention(dev, bf16))
    RESULTS["kernels"] = res
    worst = max(v for k_, v in res.items() if not k_.endswith(("_tb_s", "_ms", "_us")))
    TABLE.append(("kernels max rel err (bf16)", f"{worst:.2e}", "vs torch refs, tol 1e-2"))
    print(json.dumps(res, indent=1), flush=True)


def check_attention(dev, dtype) -> dict:
    import triton.testing

    from lantau.kernels import decode_attention as da
    from lantau.kernels import unified_attention as ua
    from lantau.kernels.reference import paged_attention_ref, paged_decode_attention_ref
    from lantau.model.forward_context import AttentionMetadata

    res = {}
    num_blocks, bs, hq, hk, d = 8192, 16, 32, 8, 128
    kv = torch.randn(2, num_blocks, bs, hk, d, device=dev, dtype=dtype)
    # mixed batch: prefills, continuations after a cached prefix, decodes
    num_q = [512, 300, 64, 1, 1, 1, 1, 1]
    seq = [512, 1324, 2112, 4000, 37, 1, 900, 2048]
    max_blocks = -(-max(seq) // bs)
    perm = torch.randperm(num_blocks, device=dev, dtype=torch.int32)
    tables = perm[: len(seq) * max_blocks].view(len(seq), max_blocks)
    qsl = torch.tensor([0] + list(torch.tensor(num_q).cumsum(0)), dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        block_tables=tables,
        max_query_len=max(num_q),
        max_seq_len=max(seq),
    )
    q = torch.randn(sum(num_q), hq, d, device=dev, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    args = (
        q,
        kv,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        tables,
        meta.max_query_len,
        meta.max_seq_len,
        scale,
    )
    ua.unified_attention(*args)
    ref = paged_attention_ref(q.float(), kv.float(), *args[3:8], scale)
    res["unified_attention"] = rel_err(out, ref)
    res["unified_attention_ms"] = triton.testing.do_bench(
        lambda: ua.unified_attention(*args), return_mode="median"
    )

    # decode-only: 128 requests of 2,048 context, and 8 of 32,768
    for num_reqs, ctx in ((128, 2048), (8, 32768)):
        blocks_per = ctx // bs
        kvd = torch.randn(2, num_reqs * blocks_per, bs, hk, d, device=dev, dtype=dtype)
        tables = torch.randperm(num_reqs * blocks_per, device=dev, dtype=torch.int32).view(
            num_reqs, blocks_per
        )
        seq_lens = torch.randint(ctx // 2, ctx + 1, (num_reqs,), device=dev, dtype=torch.int32)
        q = torch.randn(num_reqs, hq, d, device=dev, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        dargs = (q, kvd, out, seq_lens, tables, ctx, scale)
        da.paged_decode_attention(*dargs)
        ref = paged_decode_attention_ref(q.float(), kvd.float(), seq_lens, tables, scale)
        key = f"decode_{num_reqs}x{ctx}"
        res[key] = rel_err(out, ref)
        ms = triton.testing.do_bench(
            lambda dargs=dargs: da.paged_decode_attention(*dargs), return_mode="median"
        )
        kv_bytes = int(seq_lens.sum()) * hk * d * 2 * 2
        res[key + "_ms"] = ms
        res[key + "_tb_s"] = kv_bytes / ms / 1e9
        TABLE.append(
            (
                f"decode attn {num_reqs}x{ctx}",
                f"{kv_bytes / ms / 1e9:.2f} TB/s",
                "KV bytes / time vs copy ceiling",
            )
        )
        del kvd
    return res


@stage("ceilings")
def ceilings() -> None:
    from lantau.bench.offline import measure_ceilings

    RESULTS["ceilings"] = measure_ceilings(torch.device("cuda"))
    c = RESULTS["ceilings"]
    TABLE.append(
        ("ceilings", f"{c['copy_tb_s']} TB/s copy", f"{c['bf16_matmul_tflop_s']} TFLOP/s bf16 mm")
    )


@stage("hf-peers")
def hf_peers(peer_prompts_w5: int) -> None:
    from lantau.bench.offline import run_hf_peer
    from lantau.bench.workloads import Workload, make_workload
    from lantau.model.random_weights import RANDOM_SHAPES

    cfg = RANDOM_SHAPES["llama3-8b"]
    w2 = make_workload("W2", cfg.vocab_size)
    out = {}
    out["W2-hf"] = run_hf_peer(cfg, w2, torch.device("cuda"), static=False).summary()
    out["W2-hf-static"] = run_hf_peer(cfg, w2, torch.device("cuda"), static=True).summary()
    w5 = make_workload("W5", cfg.vocab_size)
    w5 = Workload("W5", w5.prompts[:peer_prompts_w5], w5.max_tokens, 16)
    out["W5-hf"] = run_hf_peer(cfg, w5, torch.device("cuda"), static=False).summary()
    RESULTS["hf"] = out
    print(json.dumps(out, indent=1), flush=True)


@stage("e2e-parity")
def e2e_parity() -> None:
    """Triton backend (eager, and with CUDA graphs) vs torch backend on the same GPU and
    weights: logits of the first (prefill) and second (decode) step on identical histories,
    and greedy tokens up to the first divergence with the reference's top-2 gap there."""
    from lantau import LLM, SamplingParams
    from lantau.bench.workloads import make_workload

    prompts = make_workload("in:100/out:32", 49152, 8).prompts
    prompts = [{"prompt_token_ids": p[: 20 + 10 * i]} for i, p in enumerate(prompts)]

    def params(n):
        return SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True, logprobs=2, detokenize=False
        )

    runs = {}
    # triton-bs1: one prompt at a time, so decode steps take the batch-1 path (GEMVs, small
    # decode attention with rotary inside)
    variants = [("torch", True), ("triton", True), ("triton", False), ("triton-bs1", False)]
    if os.environ.get("PARITY_FP32"):  # which of the bf16 runs is nearer fp32 truth?
        variants = [("torch", True), ("triton", True), ("torch-fp32", True)]
    if not torch.cuda.is_available():  # a CPU dry run of this stage's logic
        variants = variants[:2]
    for backend, eager in variants:
        llm = LLM(
            os.environ.get("PARITY_MODEL", "random:llama3-8b"),
            dtype="float32" if backend.endswith("fp32") else "auto",
            attention_backend=backend.split("-")[0],
            enforce_eager=eager,
            num_kv_blocks=2048,
            max_model_len=4096,
            enable_prefix_caching=False,
            max_num_seqs=16,
        )
        runner = llm.engine.core.runner
        one_at_a_time = "-bs1" in backend

        def generate(n, llm=llm, runner=runner, one=one_at_a_time):
            """(outputs, last logits of each request)"""
            outputs, logits = [], {}
            for batch in [[p] for p in prompts] if one else [prompts]:
                outputs += llm.generate(batch, params(n))
                logits.update({k: v.float().clone() for k, v in runner.last_logits.items()})
            return outputs, logits

        first, prefill = generate(1)
        two, decode = generate(2)
        full, _ = generate(32)
        runs[f"{backend}{'' if eager else '+graphs'}"] = (first, prefill, two, decode, full)
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    ref = runs.pop("torch-fp32" if "torch-fp32" in runs else "torch")
    out = {}
    for name, run in runs.items():
        pre = max(rel_err(run[1][k], ref[1][k]) for k in ref[1])
        same = [  # decode logits compare only where both took the same first token
            (a.request_id, b.request_id)
            for a, b in zip(ref[2], run[2], strict=True)
            if a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        ]
        dec = max(
            (rel_err(run[3][f"{b}#0"], ref[3][f"{a}#0"]) for a, b in same), default=float("nan")
        )
        agree, gaps = 0, []
        for a, b in zip(ref[4], run[4], strict=True):
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            n = next((i for i in range(len(ta)) if ta[i] != tb[i]), len(ta))
            agree += n
            if n < len(ta):
                top = sorted(a.outputs[0].logprobs[n].values(), key=lambda x: x.rank)
                gaps.append(round(top[0].logprob - top[1].logprob, 4))
        out[name] = {
            "prefill_logits_rel_err": pre,
            "decode_logits_rel_err": dec,
            "decode_compared": len(same),
            "greedy_tokens_equal": agree,
            "greedy_tokens": 32 * len(prompts),
            "top2_gap_at_divergence": gaps,
        }
        TABLE.append(
            (
                f"{name} vs torch logits",
                f"prefill {pre:.2e}, decode {dec:.2e}",
                f"tokens equal {agree}/{32 * len(prompts)}, gaps {gaps[:4]} (tol 2e-2)",
            )
        )
    RESULTS["e2e_parity"] = out
    print(json.dumps(out, indent=1), flush=True)


@stage("workloads")
def workloads(w3_scale: float) -> None:
    from lantau import LLM
    from lantau.bench.offline import _num_segments, run_lantau
    from lantau.bench.workloads import make_workload

    t = time.perf_counter()
    llm = LLM("random:llama3-8b", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    RESULTS["engine_start_s"] = time.perf_counter() - t
    RESULTS["kv_blocks"] = llm.config.cache.num_blocks
    print(
        f"engine up in {RESULTS['engine_start_s']:.1f}s, {llm.config.cache.num_blocks} blocks",
        flush=True,
    )
    specs = [("W2", None), ("W5", None)]
    specs += [
        ("W3-1000", int(3000 * w3_scale)),
        ("W3-128", int(30000 * w3_scale)),
        ("W3-2048", int(3000 * w3_scale)),
    ]
    for spec, n in specs:
        w = make_workload(spec, 128256, n)
        before = _num_segments(torch.device("cuda"))
        stats = run_lantau(llm, w).summary()
        stats["new_segments"] = _num_segments(torch.device("cuda")) - before
        RESULTS[spec] = stats
        print(spec, json.dumps(stats), flush=True)
        fig = (
            f"{stats['ms_per_token']:.2f} ms/tok"
            if spec == "W2"
            else f"{stats['output_tok_s']:.0f} tok/s"
        )
        TABLE.append(
            (
                f"{spec} x{w.num_prompts}",
                fig,
                f"gpu {stats['gpu_util_pct']}%, p95 e2e {stats['e2e_p95_s']}s, "
                f"+seg {stats['new_segments']}",
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--w3-scale", type=float, default=0.1)
    parser.add_argument("--peer-prompts-w5", type=int, default=64)
    parser.add_argument("--skip", default="", help="comma-separated stages to skip")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if "ceilings" not in skip:
        ceilings()
    if "kernels" not in skip:
        check_kernels()
    if "parity" not in skip:
        e2e_parity()
    if "peers" not in skip:
        hf_peers(args.peer_prompts_w5)
    if "workloads" not in skip:
        workloads(args.w3_scale)
    stage.report("gpu_h200.json")


if __name__ == "__main__":
    main()
