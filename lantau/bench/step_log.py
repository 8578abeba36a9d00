"""`lantau serve --step-log FILE` read back (plain Python): a run's engine steps by kind, with
the device time each kind took (CUDA events, served on a GPU) and the host's, so that a
request's time in the engine can be set against what the device spent on it.

A record (engine/core.py's EngineCore._step_record) describes one overlapped step: when the
host began it (time.monotonic(), one clock for every process of the machine), the host's
time to launch it and the whole call's, its requests and tokens, and the device time of the
step it collected (`timed_step`, `device_ms`).
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

MIXED_BUCKET = 64  # tokens: the mixed steps' CUDA-graph buckets


def read_step_log(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def step_kind(record: dict) -> str:
    """ "decode" (one token a request), "mixed" (prompt tokens in it) or "empty" (it only
    collected the step before it)."""
    if not record["reqs"]:
        return "empty"
    return "decode" if record["tokens"] == record["reqs"] else "mixed"


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def summarize_steps(records: list[dict], start: float, end: float) -> dict:
    """The steps that began in [start, end] (time.monotonic()): the device's busy share, and
    by kind their count, mean requests and tokens, device ms (where timed), host ms and how
    many were launched `behind` (the step before already over: the device idled for the
    host); the mixed steps' device ms by 64-token bucket too."""
    steps = [r for r in records if start <= r["t"] <= end]
    device_ms = {
        (r["pid"], r["timed_step"]): r["device_ms"]
        for r in records
        if r.get("device_ms") is not None
    }
    out: dict = {"steps": len(steps), "seconds": round(end - start, 3)}
    busy = [device_ms.get((r["pid"], r["step"])) for r in steps]
    timed = [ms for ms in busy if ms is not None]
    out["device_busy_share"] = round(sum(timed) / 1e3 / (end - start), 4) if timed else None
    by_kind: dict[str, dict] = {}
    buckets: dict[int, list[float]] = {}
    for kind in ("decode", "mixed", "empty"):
        rows = [r for r in steps if step_kind(r) == kind]
        if not rows:
            continue
        ms = [device_ms[(r["pid"], r["step"])] for r in rows if (r["pid"], r["step"]) in device_ms]
        by_kind[kind] = {
            "steps": len(rows),
            "reqs": _mean([r["reqs"] for r in rows]),
            "tokens": _mean([r["tokens"] for r in rows]),
            "device_ms": _mean(ms),
            "host_ms": _mean([r["host_ms"] for r in rows]),
            "call_ms": _mean([r["call_ms"] for r in rows]),
            "behind": sum(bool(r.get("behind")) for r in rows),
        }
    for r in steps:
        ms = device_ms.get((r["pid"], r["step"]))
        if step_kind(r) == "mixed" and ms is not None:
            buckets.setdefault(-(-r["tokens"] // MIXED_BUCKET) * MIXED_BUCKET, []).append(ms)
    out["by_kind"] = by_kind
    out["mixed_device_ms_by_tokens"] = {
        str(b): {"steps": len(v), "device_ms": _mean(v)} for b, v in sorted(buckets.items())
    }
    return out


def describe(summary: dict) -> str:
    """One line: busy share, then each kind's count, batch and times."""
    parts = [f"{summary['steps']} steps"]
    if summary["device_busy_share"] is not None:
        parts.append(f"device busy {100 * summary['device_busy_share']:.1f} %")
    for kind, k in summary["by_kind"].items():
        device = f", device {k['device_ms']} ms" if k["device_ms"] is not None else ""
        parts.append(f"{kind} {k['steps']} x {k['reqs']} reqs / {k['tokens']} tokens{device}, "
                     f"host {k['host_ms']} ms, call {k['call_ms']} ms, "
                     f"{k['behind']} launched behind")  # fmt: skip
    return "; ".join(parts)


def wall_step_times(records: list[dict]) -> dict:
    """The steps by kind from the host's clock alone (no CUDA events: an offline engine's
    `on_step` records): count, wall seconds, mean / median / longest ms, requests and tokens,
    and where the mean exceeds the median the `slow` ones (over twice the median) with the
    seconds they took past it, `behind` (launches that found the step before already over: the
    device idled for the host) and the host's mean ms a call.

    With overlapped steps a call waits for the step in flight and returns when it is done, so
    the gap from the call that collected step i to the next call is step i's time (the
    device's, when it is the slower side). A step that sampled nothing (a prompt's chunk
    alone) is collected by no call: the device runs it and the step after it before anyone
    waits, so both are one interval, counted as one step of the longer kind (mixed) rather
    than a short mixed step and a decode step that seems to stall for the whole prefill.
    Records without `collected` (older logs) count as collecting the step before them."""
    by_step = {r["step"]: r for r in records}
    # by kind: each interval's lead step (its mixed one, else the step collected), its
    # seconds and the calls in it
    kinds: dict[str, list[tuple[dict, float, list[dict]]]] = {}
    last, calls = 0, []
    start = records[0]["t"] if records else 0.0  # the open interval's first call
    for a, b in itertools.pairwise(records):
        calls.append(a)
        done = a.get("collected", a["step"] - 1)
        if done is None or done < 1:
            continue  # nothing collected yet: the time belongs to the steps still in flight
        steps = [by_step[n] for n in range(last + 1, done + 1) if n in by_step]
        if steps:
            lead = next((r for r in steps if step_kind(r) == "mixed"), steps[-1])
            kinds.setdefault(step_kind(lead), []).append((lead, b["t"] - start, calls))
        last, start, calls = done, b["t"], []
    out = {}
    for kind, rows in kinds.items():
        times = [s for _, s, _ in rows]
        p50 = statistics.median(times)
        slow = [t - p50 for t in times if t > 2 * p50]
        group_calls = [c for _, _, cs in rows for c in cs]
        out[kind] = {
            "steps": len(rows),
            "s": round(sum(times), 2),
            "reqs": sum(lead["reqs"] for lead, _, _ in rows) // len(rows),
            "tokens": sum(lead["tokens"] for lead, _, _ in rows) // len(rows),
            "behind": sum(bool(c.get("behind")) for c in group_calls),
            "call_ms": round(sum(c["call_ms"] for c in group_calls) / len(group_calls), 2),
            "ms": round(1e3 * sum(times) / len(rows), 2),
            "p50_ms": round(1e3 * p50, 2),
            "max_ms": round(1e3 * max(times), 2),
            "slow": len(slow),
            "slow_s": round(sum(slow), 3),
        }
    return out
