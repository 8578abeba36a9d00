"""What benchmarks sample beside their requests: GPU utilisation through NVML (on a thread) and
a server's Prometheus `/metrics` (an asyncio task). No torch: `lantau bench serve` is a client."""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import threading
import time
from collections.abc import Sequence


class GpuUtilSampler:
    """NVML GPU utilisation of the given devices (their mean at each tick) every interval_s on a
    thread, with the time of each sample from __enter__; no samples without NVML or a GPU."""

    def __init__(self, device_index: int | Sequence[int] = 0, interval_s: float = 0.05) -> None:
        indices = [device_index] if isinstance(device_index, int) else list(device_index)
        self.interval_s = interval_s
        self.samples: list[float] = []  # % busy, the devices' mean
        self.times_s: list[float] = []  # when each was taken, from __enter__
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            self._nvml = pynvml
        except Exception:  # no NVML library or no GPU: report None
            self._nvml = None

    @property
    def is_available(self) -> bool:
        return self._nvml is not None

    def __enter__(self) -> GpuUtilSampler:
        self._start = time.perf_counter()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.times_s.append(time.perf_counter() - self._start)
            self.samples.append(sum(rates) / len(rates))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return round(statistics.mean(self.samples), 1) if self.samples else None


_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series (name + labels): value}; histogram buckets left
    out (their _sum and _count stay)."""
    series: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_LINE.fullmatch(line)
        if m is None or m[1].endswith("_bucket"):
            continue
        try:
            series[m[1] + (m[2] or "")] = float(m[3])
        except ValueError:
            continue
    return series


def _is_cumulative(series: str) -> bool:
    name = series.split("{", 1)[0]
    return name.endswith(("_total", "_count", "_sum"))


class MetricsSampler:
    """GETs a server's /metrics every interval_s while a run lasts. A server without it (404,
    or any answer but 200 the first time) is noted once and not asked again."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.status = "not sampled"
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time from start, series)

    async def run(self, session, start: float) -> None:
        """Samples until cancelled; `session` is an aiohttp.ClientSession, `start` the run's
        perf_counter origin."""
        while await self.sample(session, start):
            await asyncio.sleep(self.interval_s)

    async def sample(self, session, start: float) -> bool:
        """One scrape; False once the server proved to have no /metrics."""
        import aiohttp

        if self.status.startswith(("absent", "unreachable")):
            return False
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    if not self.samples:
                        self.status = f"absent (HTTP {r.status})"
                        return False
                else:
                    text = await r.text()
                    self.samples.append((time.perf_counter() - start, parse_prometheus(text)))
                    self.status = "sampled"
        except (aiohttp.ClientError, TimeoutError) as e:
            if not self.samples:
                self.status = f"unreachable ({type(e).__name__})"
                return False
        return True

    def summary(self) -> dict:
        """Counters (_total, _count, _sum) as their rise over the run; gauges as mean and max."""
        out: dict = {"status": self.status, "num_samples": len(self.samples), "series": {}}
        if not self.samples:
            return out
        first, last = self.samples[0][1], self.samples[-1][1]
        for key in sorted(last):
            if _is_cumulative(key):
                out["series"][key] = {"delta": last[key] - first.get(key, 0.0)}
                continue
            values = [s[key] for _, s in self.samples if key in s and not math.isnan(s[key])]
            if values:
                out["series"][key] = {"mean": statistics.mean(values), "max": max(values)}
        return out
