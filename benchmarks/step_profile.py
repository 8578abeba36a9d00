"""Step profiler: W2's decode step inside the GPU, from a profiler trace (llama3-8b bf16, batch 1).

1. The batch-1 decode CUDA graph at 384 keys, 5 replays under torch.profiler: per kernel
   (grouped by name) its time per step, and the device's busy time (the union of the kernel
   intervals; PDL overlaps a kernel's start with its predecessor's end) against the replay.
2. 20 steps of W2 generation in the engine under the profiler: what runs on the device
   between two replays, and for how long.

3. `--mixed`: instead, the eager mixed steps (a prompt's chunk beside running decodes, as
   served): the host's time to queue one step, the wall time of steps back to back, and the
   same forward captured as one CUDA graph (its device time without launch gaps), by shape.

Arms of the step (other KernelConfig values) are benchmarks/decode_arms.py's.

    PYTHONPATH=. python3 benchmarks/step_profile.py [--mixed]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import time
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from lantau import LLM, SamplingParams
from lantau.bench.offline import batch1_graph, graph_ms, replay_ms
from lantau.bench.workloads import make_workload
from lantau.kv_cache.manager import cdiv
from lantau.runner.step_inputs import StepInputs
from lantau.sampling.sampler import to_device

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


# (prompt tokens in the step, running decodes, their context): W1 at 16 req/s (an arriving
# 467-token prompt, or a chunk of it, beside ~22 decodes), W1 all at once (a 4,096-token step
# beside 260), a lone prompt (W1 at 2 req/s's TTFT), decodes alone
MIXED_SHAPES = [(467, 22, 600), (256, 22, 600), (128, 22, 600), (0, 22, 600), (467, 0, 0),
                (3800, 260, 600), (0, 260, 600)]  # fmt: skip


def mixed_inputs(prefill: int, decodes: int, context: int, block_size: int) -> StepInputs:
    """A step of one prompt's first `prefill` tokens and `decodes` one-token rows at position
    `context`, on distinct cache blocks."""
    counts = ([prefill] if prefill else []) + [1] * decodes
    starts = ([0] if prefill else []) + [context] * decodes
    seq_lens = np.array(starts, np.int64) + counts
    needs = [cdiv(int(n), block_size) for n in seq_lens]
    tables = np.zeros((len(counts), max(needs)), np.int32)
    for row, (first, need) in enumerate(zip(np.cumsum([0, *needs]), needs, strict=False)):
        tables[row, :need] = np.arange(first, first + need)
    positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    req = np.repeat(np.arange(len(counts)), counts)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size
    qsl = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=qsl[1:])
    return StepInputs(
        np.arange(len(positions), dtype=np.int64) % 1000, positions, slots + positions % block_size,
        qsl, seq_lens.astype(np.int32), tables, [str(i) for i in range(len(counts))],
        (qsl[1:] - 1).astype(np.int64),
    )  # fmt: skip


def mixed_parity(max_tokens: int = 24) -> str:
    """Greedy tokens of prompts that arrive together (mixed steps of many buckets and chunks)
    with the mixed-step graphs and without (enforce_eager), on random:smollm2-135m."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 40000, n).tolist()}
               for n in (30, 200, 700, 90, 1500, 5)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM("random:smollm2-135m", enforce_eager=eager, max_num_batched_tokens=512)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for x, y in zip(*runs, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(map(len, runs[0]))
    return f"greedy tokens equal with and without the mixed-step graphs: {same}/{total}"


def mixed_steps(iters: int = 20) -> None:
    parity = mixed_parity()
    print(parity, flush=True)
    llm = LLM("random:llama3-8b", max_model_len=2048, max_num_seqs=384, enforce_eager=True)
    runner = llm.engine.core.runner
    rows = []
    for shape in MIXED_SHAPES:
        inputs = mixed_inputs(*shape, llm.config.cache.block_size)
        input_ids, ctx = runner._to_device(inputs)
        indices = to_device(inputs.logits_indices, runner.device)

        def forward(input_ids=input_ids, ctx=ctx, indices=indices):
            return runner.model.compute_logits(runner.model(input_ids, ctx)[indices])

        with torch.inference_mode():
            forward()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                forward()
            host = (time.perf_counter() - start) * 1e3 / iters
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3 / iters
            graph = graph_ms(forward, iters)
        rows.append((*shape, host, wall, graph))
        print(rows[-1], flush=True)
    print("\n| prompt tokens | decodes | context | host ms to queue | eager ms a step | "
          "as one CUDA graph ms |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for p, d, c, host, wall, graph in rows:
        print(f"| {p} | {d} | {c} | {host:.2f} | {wall:.2f} | {graph:.2f} |")
    print(parity)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed", action="store_true", help="the eager mixed steps instead")
    if p.parse_args().mixed:
        return mixed_steps()
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
