"""A watch on the test process itself: how late a thread that wakes every 2 ms woke, at worst,
while a block ran. A timed assertion is only fair on a run in which the process did not stall
(a full GC of a worker that has loaded torch, the other test worker holding both cores); the
timed tests run again when it did."""

from __future__ import annotations

import threading
import time


class StallWatch:
    """The longest lateness (ms) of a thread's 2 ms sleeps while the block runs."""

    def __enter__(self) -> StallWatch:
        self.worst_ms = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            if self._stop.wait(0.002):
                return
            late_ms = 1000 * (time.perf_counter() - before) - 2.0
            self.worst_ms = max(self.worst_ms, late_ms)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
