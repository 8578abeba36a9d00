"""Step profiler: W2's decode step inside the GPU, from a profiler trace (llama3-8b bf16, batch 1).

1. The batch-1 decode CUDA graph at 384 keys, 5 replays under torch.profiler: per kernel
   (grouped by name) its time per step, and the device's busy time (the union of the kernel
   intervals; PDL overlaps a kernel's start with its predecessor's end) against the replay.
2. 20 steps of W2 generation in the engine under the profiler: what runs on the device
   between two replays, and for how long.

Arms of the step (other KernelConfig values) are benchmarks/decode_arms.py's.

    PYTHONPATH=. python3 benchmarks/step_profile.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from lantau import LLM, SamplingParams
from lantau.bench.offline import batch1_graph, replay_ms
from lantau.bench.workloads import make_workload

OUT = os.environ.get("OUT", ".")


def export_trace_gz(prof, path: str) -> None:
    """The profiler's chrome trace, gzipped, at path (ending .gz)."""
    raw = path.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def device_timeline(prof, steps: int, wall_ms: float) -> dict:
    """GPU busy time (union of kernel and copy intervals) and the largest idle gaps."""
    evs = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )
    busy, gaps, end, prev = 0.0, [], None, ""
    for start, stop, name in evs:
        if end is not None and start > end:
            gaps.append((start - end, prev, name))
        if end is None or start > end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        if end is None or stop > end:
            end, prev = stop, name
    gaps.sort(reverse=True)
    span = (evs[-1][1] - evs[0][0]) / 1e3 if evs else 0.0
    return {
        "gpu_events": len(evs),
        "span_ms": span,
        "busy_ms_per_step": busy / 1e3 / steps,
        "wall_ms_per_step": wall_ms,
        "idle_ms_per_step": (span - busy / 1e3) / steps,
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
        "largest_gaps_us": [(round(g, 1), a[:60], b[:60]) for g, a, b in gaps[:12]],
    }


def kernel_table(prof, steps: int) -> list[tuple[str, float, int]]:
    """(kernel name shortened, us per step, launches per step), largest first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = re.sub(r"_\d+d\d+de.*|<.*", "", e.name)[:60]
            total[name] += (e.time_range.end - e.time_range.start) / steps
            count[name] += 1
    return sorted(((n, round(t, 1), count[n] // steps) for n, t in total.items()),
                  key=lambda r: -r[1])  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    llm = LLM("random:llama3-8b", max_model_len=1024, max_num_seqs=8)
    core = llm.engine.core
    block_size = llm.config.cache.block_size
    graph = batch1_graph(core.runner.graphs, 384, block_size)
    res = {"graph_ms": replay_ms(graph, 50)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    res["graph_timeline"] = device_timeline(prof, 5, res["graph_ms"])
    res["graph_kernels"] = kernel_table(prof, 5)

    w2 = make_workload("W2", 128256)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": w2.prompts[0]}
    llm.generate(prompt, params)  # warm-up
    engine = llm.engine
    engine.add_request("p", prompt, params)
    for _ in range(20):  # past the prefill
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests:
        engine.step()
    steps = kernel_table(prof, 20)
    graph_names = {n for n, _, _ in res["graph_kernels"]}
    res["between_replays"] = [r for r in steps if r[0] not in graph_names]
    res["engine_timeline"] = device_timeline(prof, 20, 0.0)
    export_trace_gz(prof, os.path.join(OUT, "w2_engine_trace.json.gz"))
    with open(os.path.join(OUT, "step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    g = res["graph_timeline"]
    busy, idle = g["busy_ms_per_step"], g["idle_ms_per_step"]
    print(f"\n| W2 decode graph bs1, 384 keys | {res['graph_ms']:.3f} ms | device busy "
          f"{busy:.3f} ms a replay, idle {idle:.3f} |")  # fmt: skip
    for name, us, n in res["graph_kernels"][:14]:
        print(f"| {name} | {us:.1f} us a step | {n} launches |")
    e = res["engine_timeline"]
    between = sum(us for _, us, _ in res["between_replays"])
    n_ops = sum(n for *_, n in res["between_replays"])
    print(f"| W2 engine, 20 steps | {e['span_ms'] / 20:.3f} ms a step | busy "
          f"{e['busy_ms_per_step']:.3f}, idle {e['idle_ms_per_step']:.3f}; outside the graph "
          f"{between:.1f} us a step in {n_ops} ops |")  # fmt: skip


if __name__ == "__main__":
    main()
