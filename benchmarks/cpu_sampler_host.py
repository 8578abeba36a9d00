"""The sampler's host time a step on its fast path (an all-greedy batch taking the CUDA graph's
pick): `Sampler.sample` over N greedy rows of random logits, on CPU, microseconds a call.

    .venv/bin/python benchmarks/cpu_sampler_host.py [--rows 384] [--calls 2000]

Run it from two trees (PYTHONPATH=TREE PYTHONSAFEPATH=1) for a same-run comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

from lantau.request import SamplingParams
from lantau.sampling import Sampler, SamplingRow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=128)
    rows = [SamplingRow(params, None, [], []) for _ in range(args.rows)]
    logits = torch.randn(args.rows, 1000)
    picked = logits.argmax(-1)
    sampler = Sampler()
    for _ in range(50):
        sampler.sample(logits, rows, greedy_ids=picked)
    start = time.perf_counter()
    for _ in range(args.calls):
        sampler.sample(logits, rows, greedy_ids=picked)
    per_call = (time.perf_counter() - start) / args.calls * 1e6
    print(f"sample(), {args.rows} greedy rows on the fast path: {per_call:.1f} us")


if __name__ == "__main__":
    main()
