"""What the GPU scripts share (not a tool): stages that run on their own, a failure printed,
recorded and passed over so that one call yields all it can; the results and the table they
fill, written and printed at the end (`Stages.report`); the relative error they report."""

from __future__ import annotations

import gc
import json
import math
import os
import time
import traceback

import torch


class Stages:
    """`@stages("name")` makes a function a stage. With `budget_s` set, no stage starts once
    that many seconds have passed since the script began (it is recorded as skipped)."""

    def __init__(self) -> None:
        self.results: dict = {}
        self.table: list[tuple[str, str, str]] = []  # (what, figure, comparison)
        self.start = time.perf_counter()
        self.budget_s = math.inf

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, name: str):
        def wrap(fn):
            def run(*args, **kwargs):
                if self.elapsed() > self.budget_s:
                    print(f"\n=== {name}: SKIPPED, {self.elapsed():.0f} s spent of "
                          f"{self.budget_s:.0f}")  # fmt: skip
                    self.table.append((name, "skipped", f"budget spent at {self.elapsed():.0f} s"))
                    return None
                t = time.perf_counter()
                print(f"\n=== {name} (at {self.elapsed():.0f} s)", flush=True)
                try:
                    out = fn(*args, **kwargs)
                except Exception as e:  # report and go on: one run should yield all it can
                    traceback.print_exc()
                    self.results[name] = {"error": f"{type(e).__name__}: {e}"}
                    self.table.append((name, "FAILED", f"{type(e).__name__}: {str(e)[:70]}"))
                    out = None
                print(f"=== {name}: {time.perf_counter() - t:.1f} s", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                return out

            return run

        return wrap

    def report(self, filename: str) -> None:
        """The results as JSON in $OUT/filename, then the table, printed last."""
        with open(os.path.join(os.environ.get("OUT", "."), filename), "w") as f:
            json.dump(self.results, f, indent=1)
        print("\n| what | figure | comparison |\n| --- | --- | --- |")
        for row in self.table:
            print(f"| {' | '.join(row)} |")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
