"""Where the host's time goes in an offline engine's steps, by phase, and whether the device or
the host sets the pace: `lantau bench offline`'s run (run_lantau) with the engine's phases
timed (the scheduler, the runner's launch / sample / collect, the output processing).

A step overlaps the one before it (EngineCore.step launches step N + 1 before collecting step
N), so the device stays busy as long as the host's work for a step fits in the device's time
for it. The collect of a step waits on its sampled ids; whether it had to wait (the device was
behind: device-bound) or found them ready (the host was behind: host-bound) is counted per step.
Steps are grouped by kind (decode: every row one token; mixed: prompt tokens too) and batch.

    python benchmarks/host_step.py [--model random:tiny] [--dtype auto] [--workload W3-128]
        [--num-prompts 1536] [--max-num-seqs 384,768] [--engine-args '{"kv_cache_dtype": "fp8"}']

On CPU (random:tiny, the default) the model's own time is CPU time too, so only the host
phases read as they would beside a GPU; on a GPU use --model random:llama3-8b --dtype fp8.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

PHASES = ("schedule", "launch", "sample", "collect_wait", "collect", "update", "process")


class PhaseClock:
    """Wraps methods so that each call's seconds add to the current step's phase."""

    def __init__(self) -> None:
        self.step: dict[str, float] = collections.defaultdict(float)
        self.waited = False

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)
        step = self

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                step.step[phase] += time.perf_counter() - t

        setattr(owner, name, timed)


def run(llm, workload, clock: PhaseClock) -> dict:
    """run_lantau's loop, each step's phases and kind kept; returns the summary by kind."""
    from lantau.bench.offline import warm_up

    engine = llm.engine
    core = engine.core
    params = warm_up(llm, workload)
    steps = []
    start = time.perf_counter()
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests:
        clock.step = collections.defaultdict(float)
        clock.waited = False
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        kind = "decode" if core.last_num_batched_tokens == core.last_batch_size else "mixed"
        steps.append((kind, core.last_batch_size, wall, dict(clock.step), clock.waited))
    elapsed = time.perf_counter() - start
    by_kind = collections.defaultdict(list)
    for kind, batch, wall, phases, waited in steps:
        by_kind[(kind, batch)].append((wall, phases, waited))
    rows = []
    for (kind, batch), group in sorted(by_kind.items(), key=lambda kv: -len(kv[1]))[:6]:
        row = {"kind": kind, "batch": batch, "steps": len(group)}
        row["wall_ms"] = 1000 * statistics.median(w for w, _, _ in group)
        for phase in PHASES:
            row[phase] = 1000 * statistics.median(p.get(phase, 0.0) for _, p, _ in group)
        # the host's own work: every phase but the wait, which collect's time includes
        row["host_ms"] = sum(row[p] for p in PHASES if p != "collect_wait") - row["collect_wait"]
        row["waited"] = sum(w for _, _, w in group) / len(group)
        rows.append(row)
    return {"elapsed_s": elapsed, "steps": len(steps), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", default="W3-128")
    parser.add_argument("--num-prompts", type=int, default=1536)
    parser.add_argument("--max-num-seqs", default="384,768", help="one engine each")
    parser.add_argument("--engine-args", default="{}", help="more LLM(...) arguments, JSON")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU runs)")
    args = parser.parse_args()
    import torch

    from lantau import LLM
    from lantau.bench.workloads import make_workload
    from lantau.engine.llm_engine import OutputProcessor
    from lantau.runner.model_runner import ModelRunner
    from lantau.sampling.sampler import PendingSample
    from lantau.scheduler.scheduler import Scheduler

    torch.set_num_threads(args.threads)
    clock = PhaseClock()
    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Scheduler, "update", "update")
    clock.wrap(ModelRunner, "launch", "launch")
    clock.wrap(ModelRunner, "sample", "sample")
    clock.wrap(ModelRunner, "collect", "collect")
    clock.wrap(OutputProcessor, "process", "process")
    resolve = PendingSample.resolve

    def timed_resolve(self):
        t = time.perf_counter()
        if self.event is not None and not self.event.query():
            clock.waited = True
            self.event.synchronize()
        clock.step["collect_wait"] += time.perf_counter() - t
        return resolve(self)

    PendingSample.resolve = timed_resolve
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.model} {args.dtype} {args.workload} x{args.num_prompts} on {device}", flush=True)
    results = {}
    for seqs in [int(s) for s in args.max_num_seqs.split(",")]:
        llm = LLM(
            args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=seqs,
            max_num_batched_tokens=65536, **json.loads(args.engine_args),
        )  # fmt: skip
        workload = make_workload(
            args.workload, llm.config.model_config.vocab_size, args.num_prompts
        )
        out = run(llm, workload, clock)
        results[seqs] = out
        print(f"max_num_seqs {seqs}: {out['steps']} steps in {out['elapsed_s']:.2f} s", flush=True)
        del llm
    head = ["seqs", "kind", "batch", "steps", "wall", *PHASES, "host", "waited"]
    print("\nmedian ms a step by phase (collect includes collect_wait: the wait for the device)")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for seqs, out in results.items():
        for r in out["rows"]:
            cells = [seqs, r["kind"], r["batch"], r["steps"], f"{r['wall_ms']:.2f}"]
            cells += [f"{r[p]:.2f}" for p in PHASES]
            cells += [f"{r['host_ms']:.2f}", f"{100 * r['waited']:.0f} %"]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    path = os.path.join(os.environ.get("OUT", "."), "host_step.json")
    with open(path, "w") as f:
        json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
