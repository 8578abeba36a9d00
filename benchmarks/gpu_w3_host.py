"""Host or device: what sets a W3-1000 decode step's wall time in the engine, on the lent GPU.

376 W3-1000 prompts run together; once all are decoding, 60 overlapped steps are timed. Per
step: wall time, time blocked waiting for the device's token ids (PendingSample.resolve), and
host time in each stage (schedule, launch, collect + update, sample). Compared in the same run
with the decode CUDA graph replayed alone at that batch (gpu_w3_decode.py: ~25 ms at 376 rows
against ~29 ms per decode step in the W3-1000 run).

Then 5 steps under torch.profiler: GPU busy time per step (the union of kernels and copies)
against wall time, the largest idle gaps on the device with what ran before and after them,
and the SM clock and board power over the timed steps and over a 200-replay run of the graph
alone (is the engine slower, or the card under sustained load?). The trace goes to $OUT.

    PYTHONPATH=. python3 benchmarks/gpu_w3_host.py
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time
from collections import defaultdict

import torch

from lantau import LLM, SamplingParams
from lantau.bench.offline import replay_ms
from lantau.bench.workloads import make_workload
from lantau.sampling import sampler as sampler_mod

BS = 376
OUT = os.environ.get("OUT", ".")


class Clocks:
    """SM clock (MHz) and board power (W) sampled every 20 ms while open."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.sm: list[int] = []
        self.watts: list[float] = []
        self._stop = threading.Event()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self.sm.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            self.watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        if not self.sm:
            return "no samples"
        return (
            f"SM {min(self.sm)}-{max(self.sm)} MHz (mean {sum(self.sm) / len(self.sm):.0f}), "
            f"power mean {sum(self.watts) / len(self.watts):.0f} W max {max(self.watts):.0f} W"
        )


def export_trace_gz(prof, path: str) -> None:
    """The profiler's chrome trace, gzipped, at path (ending .gz)."""
    raw = path.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def steps_ms(engine, steps: int) -> float:
    """Mean wall time of `steps` engine steps, the device drained at the end."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


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


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    llm = LLM(
        "random:llama3-8b", max_model_len=4096, max_num_seqs=384, max_num_batched_tokens=16384
    )
    engine, core = llm.engine, llm.engine.core
    prompts = make_workload("W3-1000", 128256, BS).prompts
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while core.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    # time spent blocked on the device
    waits: list[float] = []
    original = sampler_mod.PendingSample.resolve

    def timed_resolve(self):
        t = time.perf_counter()
        out = original(self)
        waits.append(time.perf_counter() - t)
        return out

    sampler_mod.PendingSample.resolve = timed_resolve
    stages: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            stages[name] += time.perf_counter() - t
            return out

        return wrapper

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.runner.launch = timed("launch", core.runner.launch)
    core._update = timed("collect+update", core._update)
    core.runner.sample = timed("sample", core.runner.sample)
    steps = 60
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps * 1e3
    sampler_mod.PendingSample.resolve = original
    rows = len(core.scheduler.running)
    res = {
        "rows": rows,
        "wall_ms_per_step": wall,
        "blocked_ms_per_step": sum(waits[-steps:]) / steps * 1e3,
        "host_ms_per_step": {k: v / steps * 1e3 for k, v in stages.items()},
    }
    # the device's timeline over 5 steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prof_wall = steps_ms(engine, 5)
    res["profiled"] = device_timeline(prof, 5, prof_wall)
    export_trace_gz(prof, os.path.join(OUT, "w3_host_trace.json.gz"))
    res["top_cpu_ops"] = [
        (e.key[:70], round(e.self_cpu_time_total / 5 / 1e3, 3), e.count // 5)
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    ]
    # under load again, with clocks: 30 engine steps, then the graph alone, short and long
    with Clocks() as engine_clocks:
        res["wall_ms_per_step_2"] = steps_ms(engine, 30)
    res["clocks_engine"] = engine_clocks.summary()
    graphs = core.runner.graphs
    # turn 0's graph: a recent step's batch, as its buffer holds
    graph = graphs.graphs[graphs.bucket(rows)][0]
    res["graph_alone_ms_last_batch"] = replay_ms(graph, 10)
    with Clocks() as graph_clocks:
        res["graph_alone_ms_200"] = replay_ms(graph, 200)
    res["clocks_graph_alone"] = graph_clocks.summary()
    # decode attention's grid order in the engine: wall per step (contexts grow, so the order
    # is on, off, on) and the graph alone on the same last-batch buffers
    ops = core.runner.model.ops
    for heads_first in (True, False, True):
        ops.attn_heads_first = heads_first
        old = core.runner.graphs
        torch.cuda.synchronize()
        core.runner.capture_cuda_graphs()
        new = core.runner.graphs
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            getattr(new, name).copy_(getattr(old, name))
        graph = new.graphs[new.bucket(rows)][0]
        alone = replay_ms(graph, 20)  # rewrites the last step's KV slots with the same values
        del old
        steps_ms(engine, 3)  # settle
        wall_hf = steps_ms(engine, 30)
        res.setdefault("heads_first", []).append(
            {"heads_first": heads_first, "graph_alone_ms": alone, "wall_ms_per_step": wall_hf}
        )
    print(json.dumps(res, indent=1))
    with open(os.path.join(OUT, "gpu_w3_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    host = ", ".join(f"{k} {v:.2f}" for k, v in res["host_ms_per_step"].items())
    print(f"\n| W3-1000 decode, {rows} rows | {wall:.2f} ms/step | blocked on the device "
          f"{res['blocked_ms_per_step']:.2f} ms; host ms: {host}; graph alone "
          f"{res['graph_alone_ms_last_batch']:.2f} ms |")  # fmt: skip
    p = res["profiled"]
    print(f"| profiled 5 steps | {p['wall_ms_per_step']:.2f} ms/step | device busy "
          f"{p['busy_ms_per_step']:.2f} ms, idle {p['idle_ms_per_step']:.2f} ms a step, "
          f"{p['gaps_over_20us']} gaps over 20 us |")  # fmt: skip
    print(f"| 30 steps, clocks | {res['wall_ms_per_step_2']:.2f} ms/step | "
          f"{res['clocks_engine']} |")  # fmt: skip
    print(f"| graph alone x200 | {res['graph_alone_ms_200']:.2f} ms | "
          f"{res['clocks_graph_alone']} |")  # fmt: skip
    for r in res["heads_first"]:
        print(
            f"| decode attention heads first: {r['heads_first']} | graph alone "
            f"{r['graph_alone_ms']:.2f} ms | engine {r['wall_ms_per_step']:.2f} ms/step |"
        )


if __name__ == "__main__":
    main()
