"""Reading a model's weight files into the page cache while its engine core starts.

The engine core spends seconds starting its process, importing torch and creating the CUDA
context before it reads a weight; from a cold disk, reading the weights then takes as long
again. The frontend (no torch) starts reading them the moment it spawns the core, so the
core's loader finds them in memory. Plain reads, not posix_fadvise: a hint some filesystems
ignore would leave the disk idle. Nothing is kept but the page cache; files that would not
fit in half the available memory are not read ahead (their first pages would be evicted by
their last before the loader reads them).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from lantau.errors import ModelLoadError
from lantau.model.source import ModelSource

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
MAX_THREADS = 8


def weight_files(source: ModelSource) -> list[Path]:
    """The files the engine core's loader reads, in the order it reads them."""
    if source.kind == "engine":
        from lantau.model.manifest import read_manifest

        return [source.path / shard for shard in read_manifest(source.path).shards]
    if source.kind == "hf":
        return sorted(source.path.glob("*.safetensors"))
    if source.kind == "gguf":
        return [source.path]
    return []


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ReadAhead:
    """Background threads reading `paths` once, front to back; `stop()` ends them at their
    next chunk. `num_bytes` read so far; `seconds` from start to the end (or to now)."""

    def __init__(self, paths: list[Path], num_threads: int = MAX_THREADS) -> None:
        self.paths = list(paths)
        self.num_bytes = 0
        self._next = 0  # index into paths of the next file to take
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._started = time.perf_counter()
        self._ended: float | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"lantau-readahead-{i}", daemon=True)
            for i in range(max(1, min(num_threads, len(self.paths))))
        ]
        self._num_running = len(self._threads)
        for thread in self._threads:
            thread.start()

    @classmethod
    def for_source(cls, source: ModelSource) -> ReadAhead | None:
        """Read-ahead of `source`'s weight files, or None: nothing to read, or too much for
        the page cache to hold."""
        try:
            paths = weight_files(source)
            total = sum(p.stat().st_size for p in paths)
        except (OSError, ValueError, ModelLoadError) as e:  # the loader reports a bad folder
            logger.debug("no read-ahead: %s", e)
            return None
        if not paths:
            return None
        available = available_memory_bytes()
        if available is not None and total > available // 2:
            logger.info(
                "weights not read ahead: %.1f GB, more than half the %.1f GB of available memory",
                total / 1e9,
                available / 1e9,
            )
            return None
        return cls(paths)

    @property
    def seconds(self) -> float:
        return (self._ended or time.perf_counter()) - self._started

    @property
    def done(self) -> bool:
        return self._ended is not None

    def stop(self) -> None:
        self._stopped.set()

    def join(self, timeout: float | None = None) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def _take(self) -> Path | None:
        with self._lock:
            if self._next >= len(self.paths) or self._stopped.is_set():
                return None
            self._next += 1
            return self.paths[self._next - 1]

    def _run(self) -> None:
        buf = bytearray(CHUNK_BYTES)
        try:
            while (path := self._take()) is not None:
                self._read(path, buf)
        finally:
            with self._lock:
                self._num_running -= 1
                if self._num_running == 0:
                    self._ended = time.perf_counter()

    def _read(self, path: Path, buf: bytearray) -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                while not self._stopped.is_set() and (n := f.readinto(buf)):
                    with self._lock:
                        self.num_bytes += n
        except OSError as e:  # a hint only: the loader reads (and reports) the file itself
            logger.debug("read-ahead of %s stopped: %s", path, e)
