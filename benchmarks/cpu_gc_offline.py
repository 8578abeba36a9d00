"""The garbage collector's pauses inside an offline run (`lantau bench offline`'s run_lantau) on
CPU: random:tiny, a W3 workload, every collection timed by generation (GcPauses), with the
engine's heap frozen while it is busy (LLMEngine.gc, as shipped) and, in the other arm, with
that freeze patched out (what the engine did before). Arms interleaved, one engine.

A full collection stalls the host for as long as it walks the heap; on a GPU a step waiting
on the host then leaves the device idle, so the pauses' total is GPU time lost by a
host-overlapped engine.

    python benchmarks/cpu_gc_offline.py [--workload W3-128] [--num-prompts 2304]
        [--max-num-seqs 384] [--runs 2]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json


def run_arm(llm, workload, frozen: bool) -> dict:
    from lantau.bench.offline import run_lantau
    from lantau.metrics.gc_pauses import FrozenWhileBusy, GcPauses

    track = FrozenWhileBusy.track
    if not frozen:
        FrozenWhileBusy.track = lambda self, busy: None
    gc.collect()
    pauses = GcPauses()
    try:
        stats = run_lantau(llm, workload, on_start=pauses.install)
    finally:
        pauses.uninstall()
        FrozenWhileBusy.track = track
    by_gen = collections.defaultdict(list)
    for generation, seconds in pauses.drain():
        by_gen[generation].append(seconds)
    return {
        "elapsed_s": round(stats.elapsed_s, 2),
        "output_tok_s": round(stats.output_tok_s, 1),
        "gc": {
            g: {
                "count": len(s),
                "total_ms": round(1000 * sum(s), 1),
                "max_ms": round(1000 * max(s), 1),
            }
            for g, s in sorted(by_gen.items())
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W3-128")
    parser.add_argument("--num-prompts", type=int, default=2304)
    parser.add_argument("--max-num-seqs", type=int, default=384)
    parser.add_argument("--runs", type=int, default=2, help="runs an arm, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    from lantau import LLM
    from lantau.bench.workloads import make_workload

    torch.set_num_threads(args.threads)
    llm = LLM(
        "random:tiny", max_num_seqs=args.max_num_seqs, max_model_len=4096,
        max_num_batched_tokens=65536,
    )  # fmt: skip
    workload = make_workload(args.workload, llm.config.model_config.vocab_size, args.num_prompts)
    results = collections.defaultdict(list)
    for _ in range(args.runs):
        for name, frozen in (("frozen", True), ("unfrozen", False)):
            arm = run_arm(llm, workload, frozen)
            results[name].append(arm)
            print(name, json.dumps(arm), flush=True)
    print(f"\n{args.workload} x{args.num_prompts}, max_num_seqs {args.max_num_seqs}, random:tiny")
    head = ("arm", "run s", "full collections", "their ms", "max ms", "all ms")
    print(f"{head[0]:10} {head[1]:>7} {head[2]:>17} {head[3]:>9} {head[4]:>7} {head[5]:>7}")
    for name, arms in results.items():
        for arm in arms:
            full = arm["gc"].get(2, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
            total = sum(g["total_ms"] for g in arm["gc"].values())
            print(
                f"{name:10} {arm['elapsed_s']:7.1f} {full['count']:17d} {full['total_ms']:9.0f} "
                f"{full['max_ms']:7.0f} {total:7.0f}"
            )


if __name__ == "__main__":
    main()
