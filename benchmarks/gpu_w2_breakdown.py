"""Where W2's time goes (llama3-8b bf16, batch 1, 128 in / 512 out) on the lent GPU: each
engine stage's host time per step, the captured decode graph's GPU time replayed back to back,
and the weight-read floor from the card's copy bandwidth, all in one run.

    PYTHONPATH=. python3 benchmarks/gpu_w2_breakdown.py
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from lantau import LLM, SamplingParams
from lantau.bench.offline import measure_ceilings, replay_ms
from lantau.bench.workloads import make_workload

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(obj, name: str, label: str) -> None:
    """Wrap obj.name so each call's host time is recorded under label."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def main() -> None:
    ceilings = measure_ceilings(torch.device("cuda"))
    torch.cuda.empty_cache()
    llm = LLM("random:llama3-8b", max_model_len=1024, max_num_seqs=8)
    core = llm.engine.core
    weight_bytes = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    floor_ms = weight_bytes / (ceilings["copy_tb_s"] * 1e12) * 1e3
    w2 = make_workload("W2", 128256)
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": w2.prompts[0]}
    llm.generate(prompt, params)  # warm-up

    start = time.perf_counter()
    llm.generate(prompt, params)
    plain_ms = (time.perf_counter() - start) * 1e3 / 512

    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update", "scheduler.update")
    timed(core.runner, "_prepare_inputs", "prepare_inputs")
    timed(core.runner.graphs, "run", "graph copy-in + replay launch")
    timed(core.runner, "sampler", "sample (incl. GPU wait)")
    timed(llm.engine.processor, "process", "output processor")
    timed(core, "step", "engine step total")
    start = time.perf_counter()
    llm.generate(prompt, params)
    instrumented_ms = (time.perf_counter() - start) * 1e3 / 512

    # the decode graph alone, replayed back to back: the GPU's own time per token
    graph_ms = replay_ms(core.runner.graphs.graphs[1][0], 200)

    print(f"\nceilings {ceilings}; weights {weight_bytes / 1e9:.2f} GB")
    print("| stage | ms per step (median) | calls |")
    for label, values in TIMES.items():
        print(f"| {label} | {1e3 * statistics.median(values):.3f} | {len(values)} |")
    print(f"| decode graph GPU time, back to back | {graph_ms:.3f} | 200 |")
    print(f"| weight-read floor (bytes / copy bandwidth) | {floor_ms:.3f} | |")
    print(f"| W2 end to end, plain | {plain_ms:.3f} | 512 |")
    print(f"| W2 end to end, instrumented | {instrumented_ms:.3f} | 512 |")


if __name__ == "__main__":
    main()
