"""Host or device: what sets a W3-1000 decode step's wall time in the engine, on the lent GPU.

376 W3-1000 prompts run together; once all are decoding, 60 overlapped steps are timed. Per
step: wall time, time blocked waiting for the device's token ids (PendingSample.resolve), and
host time in each stage (schedule, launch, collect + update, sample). Compared in the same run
with the decode CUDA graph replayed alone at that batch (gpu_w3_decode.py: ~25 ms at 376 rows
against ~29 ms per decode step in the W3-1000 run).

    PYTHONPATH=. python3 benchmarks/gpu_w3_host.py
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import torch

from lantau import LLM, SamplingParams
from lantau.bench.offline import replay_ms
from lantau.bench.workloads import make_workload
from lantau.sampling import sampler as sampler_mod

BS = 376


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
    # the graph alone afterwards, on whatever the buffers hold (the last step's batch)
    res["graph_alone_ms_last_batch"] = replay_ms(
        core.runner.graphs.graphs[next(b for b in core.runner.graphs.batch_sizes if b >= rows)][0],
        10,
    )
    print(json.dumps(res, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_w3_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    host = ", ".join(f"{k} {v:.2f}" for k, v in res["host_ms_per_step"].items())
    print(f"\n| W3-1000 decode, {rows} rows | {wall:.2f} ms/step | blocked on the device "
          f"{res['blocked_ms_per_step']:.2f} ms; host ms: {host}; graph alone "
          f"{res['graph_alone_ms_last_batch']:.2f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
