"""Python's cyclic garbage collector on the serving path (plain Python, no torch).

A full (generation 2) collection walks every object the collector tracks. After start-up an
engine core or a server frontend tracks a few hundred thousand (torch's, transformers', the
app's): an offline engine of random:tiny, 354k objects, paused 108 ms in the one full collection
of 512 requests on a 2-core x86 box, and every stream of the process stalls with it. Python
starts one whenever the objects that survived into generation 2 have grown by a quarter, so
under steady load one comes every few hundred requests: the H200's W1-16 run of 300 requests
had a 104 ms inter-token gap and a 129 ms TTFT against a P95 of 9 and 46.

freeze_startup_heap() moves what start-up made into the permanent generation, which no
collection walks (what serving allocates is collected as before: a full collection then walks
only that); both served processes call it once ready. GcPauses times every collection through
gc.callbacks, for `lantau:gc_pause_seconds` (process "core" or "frontend", by generation).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from lantau.metrics.stats import gc_pause_histograms

MAX_PENDING = 4096  # the core's pauses not sent yet (a message goes out at least every second)


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left (gc.freeze): the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class FrozenWhileBusy:
    """An in-process engine's heap frozen while it has requests (LLM.generate, `lantau bench
    offline`): what existed when its steps began (start-up's objects and every request queued
    so far) out of the walks of the collections during them, until the last request is done.

    An offline engine's process is the user's, so nothing stays frozen for good: once idle it
    unfreezes, and cycles made garbage in between are collected after. On random:tiny with 2,304
    W3-128 requests at 384 a step (CPU), the full collections during the run took 1.0-1.2 s in
    7 pauses of up to 243 ms, 26-28 ms in all frozen (benchmarks/cpu_gc_offline.py); each
    stalls the host, and an engine whose next step waits on it leaves the GPU idle.

    A freeze made before the engine's (this GPU image's interpreter has 375 objects frozen
    once torch, Triton and lantau are imported) is frozen over while busy and thawed with the
    engine's when idle: left frozen, a dropped engine's reference cycles (its tensors) would
    never be collected. NOTE: standing aside for such a freeze, as this did before, left the
    GPU's heap unfrozen: W3-fp8-128 on an H100 ran 5 full collections of up to 280 ms in
    12.5 s, 23,561 tok/s against 26,083 frozen (RESULTS.md 2026-12-06). lantau's served
    processes freeze their start-up heaps themselves and run no LLMEngine."""

    def __init__(self) -> None:
        self.frozen = False

    def track(self, busy: bool) -> None:
        """The engine has requests (busy) or not: freeze or thaw to match."""
        if busy and not self.frozen:
            gc.freeze()
            self.frozen = True
        elif not busy and self.frozen:
            gc.unfreeze()
            self.frozen = False


class GcPauses:
    """Every collection of this process from install() on, as (generation, seconds): handed to
    `on_pause` as it ends (the frontend's own, observed at once), or kept for drain() (the
    core's, sent to the frontend with its next message)."""

    def __init__(self, on_pause: Callable[[int, float], None] | None = None) -> None:
        self.on_pause = on_pause
        self.pending: list[tuple[int, float]] = []
        self._started = 0.0

    def install(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation, seconds = info["generation"], time.perf_counter() - self._started
        if self.on_pause is not None:
            self.on_pause(generation, seconds)
        elif len(self.pending) < MAX_PENDING:
            self.pending.append((generation, seconds))

    def drain(self) -> list[tuple[int, float]]:
        """The pauses since the last drain (oldest first)."""
        pending, self.pending = self.pending, []
        return pending


class ProcessGc:
    """This process's own collections, observed into histograms by generation (the
    frontend's: one a process, whatever engines it serves)."""

    def __init__(self) -> None:
        self.histograms = gc_pause_histograms()
        self.frozen = 0  # objects frozen at start-up
        self._pauses: GcPauses | None = None

    def start(self) -> None:
        """Time every collection from now on, the first one the full collection of the
        start-up heap before it is frozen (once)."""
        if self._pauses is None:
            self._pauses = GcPauses(lambda g, s: self.histograms[g].observe(s)).install()
            self.frozen = freeze_startup_heap()

    def collect_released(self) -> None:
        """After objects frozen at start-up were released (a repository's version unloaded):
        thaw, collect, freeze again, so that their reference cycles do not outlive them.
        One full collection a unload: the other versions' streams pause for it once (~0.1 s
        on a CI core), where without the freeze they would every few hundred requests."""
        if self._pauses is not None:
            gc.unfreeze()
            self.frozen = freeze_startup_heap()

    def stop(self) -> None:
        if self._pauses is not None:
            self._pauses.uninstall()
            self._pauses = None

    @property
    def started(self) -> bool:
        return self._pauses is not None


# the process's own: the server frontend starts it once ready, /metrics reads it
PROCESS_GC = ProcessGc()
