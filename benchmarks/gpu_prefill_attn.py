"""Prefill on the lent GPU: tile configurations of the unified attention kernel at the W3/W5
prefill shapes (llama3-8b heads, bf16, a paged cache with shuffled blocks), each checked
against the torch reference and timed; then where one 8192-token prefill step's GPU time goes
(torch.profiler, eager), by kernel kind.

    PYTHONPATH=. python3 benchmarks/gpu_prefill_attn.py
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict

import torch
import triton.testing

from lantau.kernels import paged_attention as pa

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run (TRITON_INTERPRET=1)
DTYPE = torch.bfloat16
CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is today's default
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (64, 128, 8, 2),
    (128, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
]
SHAPES = {  # name -> [(context before, new tokens)] per request
    "W3-2048 prefill 4x2048": [(0, 2048)] * 4,
    "W3-1000 prefill 8x1000": [(0, 1000)] * 8,
    "W3-128 prefill 64x128": [(0, 128)] * 64,
    "W5 chunk 16x512 after 512": [(512, 512)] * 16,
    "W3 mixed 8x1000 + 256 decodes at 1500": [(0, 1000)] * 8 + [(1499, 1)] * 256,
}


def make(requests, seed=0):
    dev, dt = DEVICE, DTYPE
    gen = torch.Generator(dev).manual_seed(seed)
    blocks_per = [-(-(c + n) // BLOCK) for c, n in requests]
    num_blocks = sum(blocks_per) + 1
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    width = max(blocks_per)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = torch.tensor(ids[pos : pos + nb])
        pos += nb
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen, device=dev).to(dt)
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, HEADS, DIM, generator=gen, device=dev).to(dt)
    qsl = torch.tensor([0] + [sum(n for _, n in requests[: i + 1]) for i in range(len(requests))])
    seq = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    return q, kv, qsl.to(dev, torch.int32), seq.to(dev), table.to(dev), requests


def flops(requests) -> float:
    total = 0
    for c, n in requests:
        total += sum(c + i + 1 for i in range(n))  # keys seen by each query row
    return 4.0 * HEADS * DIM * total


def sweep() -> dict:
    out = {}
    for name, requests in SHAPES.items():
        q, kv, qsl, seq, table, reqs = make(requests)
        max_q = max(n for _, n in reqs)
        max_s = max(c + n for c, n in reqs)
        ref = None
        rows = {}
        for cfg in CONFIGS:
            o = torch.full_like(q, float("nan"))

            def run(o=o, cfg=cfg, args=(q, kv, o, qsl, seq, table, max_q, max_s)):
                pa.unified_attention(*args, DIM**-0.5, tile=cfg)

            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile (shared memory) is noted
                rows[str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
                continue
            if ref is None:
                ref = pa.unified_attention_ref(q, kv, qsl, seq, table, DIM**-0.5).float()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            rows[str(cfg)] = {
                "ms": round(ms, 4),
                "tflop_s": round(flops(reqs) / ms / 1e9, 1),
                "rel_err": float(f"{err:.2e}"),
            }
        out[name] = rows
        print(name, json.dumps(rows), flush=True)
        ok = {k: v for k, v in rows.items() if "ms" in v and v["rel_err"] < 1e-2}
        if not ok:
            print(f"| {name} | no config passed | |", flush=True)
            continue
        best = min(ok, key=lambda k: ok[k]["ms"])
        base = rows[str(CONFIGS[0])]
        print(
            f"| {name} | default {base.get('ms')} ms ({base.get('tflop_s')} TFLOP/s) | "
            f"best {best} {ok[best]['ms']} ms ({ok[best]['tflop_s']} TFLOP/s), "
            f"err {ok[best]['rel_err']} |",
            flush=True,
        )
    return out


def prefill_profile() -> dict:
    from torch.profiler import ProfilerActivity, profile

    from lantau import LLM, SamplingParams

    llm = LLM(
        "random:llama3-8b", max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=8192,
        enforce_eager=True,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(128000) for _ in range(2048)]} for _ in range(4)]
    llm.generate(prompts, params)
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    kinds: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key.lower()
        kind = "other"
        for k, pats in (
            ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "splitk")),
            ("attention", ("attention",)),
            ("norm", ("rms",)),
            ("rotary", ("rotary",)),
            ("kv_write", ("kv_cache",)),
            ("silu", ("silu",)),
        ):
            if any(p in name for p in pats):
                kind = k
                break
        kinds[kind] += evt.device_time_total / 1e3
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12), flush=True)
    total = sum(kinds.values())
    res = {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda x: -x[1])}
    print(f"| 8192-token prefill step, GPU ms by kind | total {total:.2f} | {res} |", flush=True)
    return res


def main() -> None:
    print(torch.__version__, DEVICE, flush=True)
    print("| shape | default | best |")
    results = {"sweep": sweep()}
    if DEVICE == "cuda":
        results["prefill_profile_ms"] = prefill_profile()
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_prefill_attn.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
