"""Decode arms: W2's batch-1 decode graph and W2 itself under KernelConfig variants, same
engine, same run (llama3-8b random weights, bf16).

Each arm is a KernelConfig: the engine's ops are rebuilt under it and its graphs recaptured.
1. The batch-1 decode graph at 384 keys per arm: min of 3 x 50 replays, and the arm's first
   32 greedy tokens of W2's first prompt against the first arm's (another tiling changes the
   sums' order, so random weights may diverge early).
2. W2 with the fastest arm against the default, alternated twice.

    PYTHONPATH=. python3 benchmarks/decode_arms.py [--arms tiles|fusions]

Results go to $OUT/decode_arms.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from lantau import LLM
from lantau.bench.offline import batch1_graph, greedy_agreement, replay_ms, run_lantau
from lantau.bench.workloads import make_workload
from lantau.config import AttnMerge, KernelConfig

DEFAULT = KernelConfig()
DOWN = (4096, 14336)  # llama3-8b's down_proj (N, K)


def arm(**changes) -> KernelConfig:
    return dataclasses.replace(DEFAULT, **changes)


ARMS = {  # name -> [(label, KernelConfig)]; the first arm of each is the default
    "tiles": [
        ("default", DEFAULT),
        ("down 32 x 1024, 8 warps, 4 stages", arm(gemv_tiles=((DOWN, (32, 1024, 8, 4)),))),
        ("down 8 x 1024, 4 warps, 4 stages", arm(gemv_tiles=((DOWN, (8, 1024, 4, 4)),))),
        ("small attention 64 x 4 x 2", arm(attn_small_tile=(64, 4, 2))),
        ("short attention 128 x 8", arm(attn_short_tile=(128, 8, 1))),
        ("short attention 32 x 8", arm(attn_short_tile=(32, 8, 1))),
        ("no short-context graphs", arm(attn_short_keys=0)),
    ],
    "fusions": [
        ("default", DEFAULT),
        ("no PDL", arm(enable_pdl=False)),
        ("no SiLU in gate_up's GEMV", arm(enable_gate_silu=False)),
        ("no GEMV preload", arm(gemv_preload_max_bytes=0)),
        ("cuBLAS at batch 1", arm(enable_gemv=False)),
        ("chunked merge for small batches", arm(attn_small_merge=AttnMerge.CHUNKED)),
    ],
}


def use(llm: LLM, kernels: KernelConfig) -> None:
    """The engine's model ops rebuilt under `kernels`, its graphs recaptured."""
    from lantau.model.ops import TritonOps

    runner = llm.engine.core.runner
    runner.model.ops = TritonOps(kernels)
    runner.sampler.use_pdl = kernels.enable_pdl
    runner.capture_cuda_graphs()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", choices=sorted(ARMS), default="tiles")
    arms = ARMS[p.parse_args().arms]
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    llm = LLM("random:llama3-8b", max_model_len=1152, max_num_seqs=8)
    w2 = make_workload("W2", 128256)
    res, table, timed, reference = {"card": torch.cuda.get_device_name()}, [], [], None
    for label, kernels in arms:
        try:
            use(llm, kernels)
            tokens, same = greedy_agreement(llm, w2.prompts[0], reference)
            graph = batch1_graph(llm.engine.core.runner.graphs, 384, llm.config.cache.block_size)
            ms = min(replay_ms(graph, 50) for _ in range(3))
        except Exception as e:  # an arm that does not build: reported, skipped
            table.append(f"| decode graph bs1, 384 keys, {label} | failed | {e!r:.120} |")
            print(table[-1], flush=True)
            continue
        reference = reference or tokens
        timed.append((ms, label, kernels))
        res.setdefault("graph", []).append({"arm": label, "graph_ms": ms, "same": same})
        table.append(f"| decode graph bs1, 384 keys, {label} | {ms:.4f} ms | {same}/32 tokens |")
        print(table[-1], flush=True)
    best = min(timed[1:], key=lambda t: t[0]) if len(timed) > 1 else timed[0]
    for _, label, kernels in [timed[0], best] * 2:
        use(llm, kernels)
        stats = run_lantau(llm, w2).summary()
        res.setdefault("w2", []).append({"arm": label, **stats})
        table.append(
            f"| W2, {label} | {stats['ms_per_token']:.3f} ms/token | GPU util "
            f"{stats['gpu_util_pct']}% |"
        )
        print(table[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_arms.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| what | figure | comparison |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
