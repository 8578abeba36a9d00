"""GPU figures from NVML (nvidia-ml-py), read when asked (at scrape time), never in a loop.

No NVML library, no driver or no GPU: `GpuReader.start()` returns None and logs one line
saying why; the GPU metrics are then absent. A reading NVML refuses on one device (power on
some cards) is left out, never an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One device at one moment; None where NVML has no answer. Base units."""

    index: int
    uuid: str
    utilization: float | None  # % of the last sample period a kernel ran (0-100)
    memory_used: float | None  # bytes
    memory_total: float | None  # bytes
    power: float | None  # watts
    temperature: float | None  # degrees Celsius
    sm_clock: float | None  # hertz


class GpuReader:
    def __init__(self, nvml, handles: list) -> None:
        self.nvml, self.handles = nvml, handles

    @classmethod
    def start(cls) -> GpuReader | None:
        """NVML initialised with its devices, or None (one log line says why)."""
        try:
            import pynvml
        except ImportError:
            logger.warning("GPU metrics off: nvidia-ml-py (pynvml) is not installed")
            return None
        try:
            pynvml.nvmlInit()
            handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            logger.warning("GPU metrics off: NVML unavailable (%s)", e)
            return None
        if not handles:
            logger.warning("GPU metrics off: NVML sees no GPU")
            return None
        return cls(pynvml, handles)

    def read(self) -> list[GpuReading]:
        return [self._read_one(i, h) for i, h in enumerate(self.handles)]

    def _read_one(self, index: int, handle) -> GpuReading:
        nvml = self.nvml

        def ask(fn, *args):
            try:
                return fn(handle, *args)
            except Exception:  # NOTE: NVMLError_NotSupported and kin: that figure is absent
                return None

        util = ask(nvml.nvmlDeviceGetUtilizationRates)
        memory = ask(nvml.nvmlDeviceGetMemoryInfo)
        power_mw = ask(nvml.nvmlDeviceGetPowerUsage)
        clock_mhz = ask(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        uuid = ask(nvml.nvmlDeviceGetUUID)
        return GpuReading(
            index=index,
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid or ""),
            utilization=None if util is None else float(util.gpu),
            memory_used=None if memory is None else float(memory.used),
            memory_total=None if memory is None else float(memory.total),
            power=None if power_mw is None else power_mw / 1000.0,
            temperature=ask(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
            sm_clock=None if clock_mhz is None else clock_mhz * 1e6,
        )
