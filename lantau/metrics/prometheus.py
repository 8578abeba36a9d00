"""The one module that imports prometheus_client: /metrics in the text exposition format.

Nothing is recorded through prometheus_client. A custom collector reads, at scrape time, the
plain figures of `EngineMetrics` (the frontend's, and the core's last `StepStats`) and NVML's
readings (`gpu.GpuReader`), so the hot path never touches a prometheus_client lock. Names follow
the Gateway API Inference Extension model-server contract under `lantau:` (vLLM's `vllm:` names);
docs/metrics.md lists each with its vLLM, Triton and DCGM counterparts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from lantau.engine.protocol import StepStats
from lantau.metrics.gpu import GpuReader
from lantau.metrics.stats import EngineMetrics, Histogram

__all__ = ["CONTENT_TYPE_LATEST", "MetricsExporter", "counter_family", "gauge_family"]

# histogram name -> (EngineMetrics.latency key, help)
LATENCY_HELP = {
    "time_to_first_token_seconds": ("ttft", "Time from arrival to the first output token."),
    "time_per_output_token_seconds": (
        "tpot",
        "A request's mean time between its output tokens (decode time / (tokens - 1)).",
    ),
    "inter_token_latency_seconds": ("itl", "Time between two output chunks of a request."),
    "e2e_request_latency_seconds": ("e2e", "Time from arrival to the last output token."),
    "request_queue_time_seconds": ("queue", "Time from arrival to the first scheduling."),
    "request_prefill_time_seconds": (
        "prefill",
        "Time from the first scheduling to the first output token.",
    ),
    "request_decode_time_seconds": ("decode", "Time from the first to the last output token."),
}


def histogram_family(name: str, doc: str, hist: Histogram, labels: dict) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    buckets, total = [], 0
    for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        total += count
        buckets.append((_bound_text(bound), total))
    family.add_metric(list(labels.values()), buckets, hist.sum)
    return family


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _counter(name: str, doc: str, value: float, labels: dict) -> Metric:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _gauge(name: str, doc: str, value: float, labels: dict) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter_family(name: str, doc: str, label_names: list[str], samples) -> Metric:
    """A counter family from (label values, value) pairs."""
    family = CounterMetricFamily(name, doc, labels=label_names)
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family


def gauge_family(name: str, doc: str, label_names: list[str], samples) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=label_names)
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family


class EngineCollector:
    """Renders EngineMetrics and the latest StepStats (read through `stats`) at scrape time."""

    def __init__(self, metrics: EngineMetrics, stats: Callable[[], StepStats]) -> None:
        self.metrics, self.stats = metrics, stats

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        labels = {"model_name": m.model_name}
        yield from self._core_gauges(self.stats(), labels)
        yield from self._core_counters(self.stats(), labels)
        yield from self._request_counters(labels)
        for name, (key, doc) in LATENCY_HELP.items():
            yield histogram_family(f"lantau:{name}", doc, m.latency[key], labels)
        yield histogram_family(
            "lantau:request_prompt_tokens", "Prompt tokens a request.", m.prompt_tokens, labels
        )
        yield histogram_family(
            "lantau:request_generation_tokens",
            "Output tokens a request (all its n sequences).",
            m.output_tokens,
            labels,
        )
        info = GaugeMetricFamily(
            "lantau:cache_config_info",
            "The KV cache's configuration (value 1).",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([m.model_name, str(m.block_size), str(m.num_blocks)], 1)
        yield info

    def _core_gauges(self, s: StepStats, labels: dict) -> Iterator[Metric]:
        yield _gauge("lantau:num_requests_running", "Requests in the running batch.",
                     s.num_running, labels)  # fmt: skip
        yield _gauge("lantau:num_requests_waiting", "Requests waiting to be scheduled.",
                     s.num_waiting, labels)  # fmt: skip
        yield _gauge("lantau:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = 100%).",
                     s.kv_cache_usage, labels)  # fmt: skip
        queried = s.num_prefix_queried_tokens
        yield _gauge("lantau:prefix_cache_hit_rate",
                     "Share of admitted prompt tokens found in the prefix cache, since start.",
                     s.num_prefix_hit_tokens / queried if queried else 0.0, labels)  # fmt: skip
        yield _gauge("lantau:batch_size", "Requests scheduled in the last engine step.",
                     s.batch_size, labels)  # fmt: skip
        yield _gauge("lantau:num_batched_tokens", "Tokens scheduled in the last engine step.",
                     s.num_batched_tokens, labels)  # fmt: skip
        yield _gauge("lantau:step_time_seconds", "Wall time of the last engine step.",
                     s.step_time_s, labels)  # fmt: skip

    def _core_counters(self, s: StepStats, labels: dict) -> Iterator[Metric]:
        yield _counter("lantau:num_preemptions", "Requests preempted (to be recomputed).",
                       s.num_preemptions, labels)  # fmt: skip
        yield _counter("lantau:prefix_cache_queries", "Prompt tokens looked up in the cache.",
                       s.num_prefix_queried_tokens, labels)  # fmt: skip
        yield _counter("lantau:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       s.num_prefix_hit_tokens, labels)  # fmt: skip
        yield _counter("lantau:engine_steps", "Engine steps run.", s.num_steps, labels)
        yield _counter("lantau:engine_step_time_seconds", "Wall time spent in engine steps.",
                       s.step_time_total_s, labels)  # fmt: skip
        yield _counter("lantau:engine_generated_tokens", "Tokens sampled by the engine.",
                       s.num_generated_tokens, labels)  # fmt: skip

    def _request_counters(self, labels: dict) -> Iterator[Metric]:
        m = self.metrics
        yield _counter("lantau:prompt_tokens", "Prompt tokens of finished requests.",
                       m.num_prompt_tokens, labels)  # fmt: skip
        yield _counter("lantau:generation_tokens", "Output tokens of finished requests.",
                       m.num_output_tokens, labels)  # fmt: skip
        yield _counter("lantau:prompt_tokens_cached",
                       "Prompt tokens of finished requests served by the prefix cache.",
                       m.num_cached_tokens, labels)  # fmt: skip
        success = CounterMetricFamily(
            "lantau:request_success",
            "Requests that left the engine, by finish reason (abort: left early).",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", *m.finished}):
            success.add_metric([m.model_name, reason], m.finished.get(reason, 0))
        yield success
        yield _counter("lantau:request_aborted", "Requests that left before they finished.",
                       m.finished.get("abort", 0), labels)  # fmt: skip
        status = CounterMetricFamily(
            "lantau:request_status",
            "Inference requests answered, by protocol and status (HTTP code or gRPC status).",
            labels=["model_name", "protocol", "code"],
        )
        for (protocol, code), count in sorted(m.status.items()):
            status.add_metric([m.model_name, protocol, code], count)
        yield status
        rejected = CounterMetricFamily(
            "lantau:request_rejected",
            "Requests refused: overloaded (429, RESOURCE_EXHAUSTED) or unavailable (503, "
            "UNAVAILABLE: draining, engine down).",
            labels=["model_name", "reason"],
        )
        for reason, codes in (("overloaded", ("429", "RESOURCE_EXHAUSTED")),
                              ("unavailable", ("503", "UNAVAILABLE"))):  # fmt: skip
            count = sum(n for (_, code), n in m.status.items() if code in codes)
            rejected.add_metric([m.model_name, reason], count)
        yield rejected


# (GpuReading field, metric, help with DCGM-exporter's field and unit)
GPU_GAUGES = (
    ("utilization", "lantau:gpu_utilization_perc",
     "Share of the last sample period a kernel ran, 0-100 (DCGM_FI_DEV_GPU_UTIL)."),
    ("memory_used", "lantau:gpu_memory_used_bytes",
     "Device memory used (DCGM_FI_DEV_FB_USED, MiB)."),
    ("memory_total", "lantau:gpu_memory_total_bytes",
     "Device memory in all (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE, MiB)."),
    ("power", "lantau:gpu_power_watts", "Power draw (DCGM_FI_DEV_POWER_USAGE)."),
    ("temperature", "lantau:gpu_temperature_celsius", "GPU temperature (DCGM_FI_DEV_GPU_TEMP)."),
    ("sm_clock", "lantau:gpu_sm_clock_hertz", "SM clock (DCGM_FI_DEV_SM_CLOCK, MHz)."),
)  # fmt: skip


class GpuCollector:
    """NVML's readings of every GPU, read at scrape time (DCGM-exporter's meanings)."""

    def __init__(self, reader: GpuReader) -> None:
        self.reader = reader

    def collect(self) -> Iterator[Metric]:
        readings = self.reader.read()
        if not readings:
            return
        families = {
            key: GaugeMetricFamily(name, help_text, labels=["gpu", "uuid"])
            for key, name, help_text in GPU_GAUGES
        }
        for r in readings:
            for key, family in families.items():
                value = getattr(r, key)
                if value is not None:
                    family.add_metric([str(r.index), r.uuid], value)
        yield from families.values()


class MetricsExporter:
    """The /metrics page: a registry of the two collectors."""

    def __init__(
        self,
        metrics: EngineMetrics,
        stats: Callable[[], StepStats],
        gpus: GpuReader | None,
        extra: list | tuple = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(metrics, stats))
        for collector in extra:  # objects with collect() yielding families (the repository's)
            self.registry.register(collector)
        if gpus is not None:
            self.registry.register(GpuCollector(gpus))

    def render(self) -> bytes:
        return generate_latest(self.registry)
