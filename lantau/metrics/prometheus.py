"""The one module that imports prometheus_client: /metrics in the text exposition format.

Nothing is recorded through prometheus_client. A custom collector reads, at scrape time, the
plain figures of each engine's `EngineMetrics` (the frontend's, and its core's last
`StepStats`) and NVML's readings (`gpu.GpuReader`), so the hot path never touches a
prometheus_client lock. Names follow the Gateway API Inference Extension model-server contract
under `lantau:` (vLLM's `vllm:` names); docs/metrics.md lists each with its vLLM, Triton and
DCGM counterparts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from lantau.engine.protocol import StepStats
from lantau.metrics.gc_pauses import PROCESS_GC
from lantau.metrics.gpu import GpuReader
from lantau.metrics.stats import EngineFigures

__all__ = [
    "CONTENT_TYPE_LATEST", "MetricsExporter", "counter_family", "gauge_family", "gc_pause_family",
    "render_collectors",
]  # fmt: skip

# histogram name -> (EngineMetrics.latency key, help)
LATENCY_HELP = {
    "time_to_first_token_seconds": ("ttft", "Time from arrival to the first output token."),
    "time_per_output_token_seconds": (
        "tpot",
        "A request's mean time between its output tokens (decode time / (tokens - 1)).",
    ),
    "inter_token_latency_seconds": ("itl", "Time between two output chunks of a request."),
    "e2e_request_latency_seconds": ("e2e", "Time from arrival to the last output token."),
    "request_dispatch_time_seconds": (
        "dispatch",
        "Time from arrival to the engine core taking the request (tokenization, admission, "
        "the frontend-to-core message, the rest of the core's step then running).",
    ),
    "request_queue_time_seconds": ("queue", "Time from arrival to the first scheduling."),
    "request_prefill_time_seconds": (
        "prefill",
        "Time from the first scheduling to the first output token.",
    ),
    "request_decode_time_seconds": ("decode", "Time from the first to the last output token."),
    "request_http_in_time_seconds": (
        "http_in",
        "Time from an HTTP request's start to its arrival at the engine (body read, parsing, "
        "validation).",
    ),
    "request_http_first_chunk_time_seconds": (
        "http_first_chunk",
        "Time from a streamed HTTP request's first output token reaching the frontend to its "
        "first response bytes sent (detokenization, the response's start, SSE encoding).",
    ),
}


def histogram_family(name: str, doc: str, label_names: list[str], samples) -> Metric:
    """A histogram family from (label values, Histogram) pairs."""
    family = HistogramMetricFamily(name, doc, labels=label_names)
    for labels, hist in samples:
        buckets, total = [], 0
        for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
            total += count
            buckets.append((_bound_text(bound), total))
        family.add_metric(list(labels), buckets, hist.sum)
    return family


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def gc_pause_family(label_names: list[str], processes) -> Metric:
    """lantau:gc_pause_seconds from (label values ending with the process kind, its
    histograms by generation) pairs: `label_names`, then process and generation."""
    samples = [
        ([*labels, str(generation)], hist)
        for labels, histograms in processes
        for generation, hist in histograms.items()
    ]
    return histogram_family(
        "lantau:gc_pause_seconds",
        "Time a garbage collection stopped its process (engine core, frontend or gateway), by "
        "the collector's generation (2: a full collection).",
        [*label_names, "process", "generation"],
        samples,
    )


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


def _hit_rate(s: StepStats) -> float:
    queried = s.num_prefix_queried_tokens
    return s.num_prefix_hit_tokens / queried if queried else 0.0


# (metric, help, its value from the core's last StepStats)
CORE_GAUGES = (
    ("lantau:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("lantau:num_requests_waiting", "Requests waiting to be scheduled.",
     lambda s: s.num_waiting),
    ("lantau:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = 100%).",
     lambda s: s.kv_cache_usage),
    ("lantau:prefix_cache_hit_rate",
     "Share of admitted prompt tokens found in the prefix cache, since start.", _hit_rate),
    ("lantau:batch_size", "Requests scheduled in the last engine step.", lambda s: s.batch_size),
    ("lantau:num_batched_tokens", "Tokens scheduled in the last engine step.",
     lambda s: s.num_batched_tokens),
    ("lantau:step_time_seconds", "Wall time of the last engine step.", lambda s: s.step_time_s),
)  # fmt: skip
CORE_COUNTERS = (
    ("lantau:num_preemptions", "Requests preempted (to be recomputed).",
     lambda s: s.num_preemptions),
    ("lantau:prefix_cache_queries", "Prompt tokens looked up in the cache.",
     lambda s: s.num_prefix_queried_tokens),
    ("lantau:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.num_prefix_hit_tokens),
    ("lantau:engine_steps", "Engine steps run.", lambda s: s.num_steps),
    ("lantau:engine_step_time_seconds", "Wall time spent in engine steps.",
     lambda s: s.step_time_total_s),
    ("lantau:engine_generated_tokens", "Tokens sampled by the engine.",
     lambda s: s.num_generated_tokens),
)  # fmt: skip
# (metric, help, its value from the frontend's EngineMetrics)
REQUEST_COUNTERS = (
    ("lantau:prompt_tokens", "Prompt tokens of finished requests.",
     lambda m: m.num_prompt_tokens),
    ("lantau:generation_tokens", "Output tokens of finished requests.",
     lambda m: m.num_output_tokens),
    ("lantau:prompt_tokens_cached",
     "Prompt tokens of finished requests served by the prefix cache.",
     lambda m: m.num_cached_tokens),
    ("lantau:request_aborted", "Requests that left before they finished.",
     lambda m: m.finished.get("abort", 0)),
)  # fmt: skip
# each LoRA adapter's usage, EngineMetrics.lora_usage's columns in order
LORA_USAGE = (
    ("lantau:lora_requests", "Finished requests that ran through each LoRA adapter."),
    ("lantau:lora_prompt_tokens", "Prompt tokens of finished requests, by LoRA adapter."),
    ("lantau:lora_generation_tokens", "Output tokens of finished requests, by LoRA adapter."),
)
# histograms of EngineMetrics other than the latencies: (metric, help, the histogram)
LENGTH_HISTOGRAMS = (
    ("lantau:request_prompt_tokens", "Prompt tokens a request.", lambda m: m.prompt_tokens),
    ("lantau:request_generation_tokens", "Output tokens a request (all its n sequences).",
     lambda m: m.output_tokens),
)  # fmt: skip
# lantau:request_rejected's reasons and the codes that count as each
REJECTED_CODES = (
    ("overloaded", ("429", "RESOURCE_EXHAUSTED")),
    ("unavailable", ("503", "UNAVAILABLE")),
)


class EngineCollector:
    """Renders, at scrape time, every engine's EngineMetrics and latest StepStats as
    `sources()` gives them (one for a single model; a repository's loaded and draining
    versions): one family a metric, one sample an engine, `label_names` first on each."""

    def __init__(self, sources: Callable[[], list[EngineFigures]], label_names: list[str]):
        self.sources, self.label_names = sources, label_names

    def collect(self) -> Iterator[Metric]:
        names, sources = self.label_names, self.sources()
        engines = [(list(f.metrics.labels.values()), f) for f in sources if f.stats is not None]
        for name, doc, value in CORE_GAUGES:
            yield gauge_family(name, doc, names, [(k, value(f.stats)) for k, f in engines])
        for name, doc, value in CORE_COUNTERS:
            yield counter_family(name, doc, names, [(k, value(f.stats)) for k, f in engines])
        for name, doc, value in REQUEST_COUNTERS:
            yield counter_family(name, doc, names, [(k, value(f.metrics)) for k, f in engines])
        success = []
        for k, f in engines:
            for reason in sorted({"stop", "length", "abort", *f.metrics.finished}):
                success.append(([*k, reason], f.metrics.finished.get(reason, 0)))
        yield counter_family(
            "lantau:request_success",
            "Requests that left the engine, by finish reason (abort: left early).",
            [*names, "finished_reason"],
            success,
        )
        yield from self._statuses(sources)
        for name, (key, doc) in LATENCY_HELP.items():
            samples = [(k, f.metrics.latency[key]) for k, f in engines]
            yield histogram_family(f"lantau:{name}", doc, names, samples)
        for name, doc, hist in LENGTH_HISTOGRAMS:
            yield histogram_family(name, doc, names, [(k, hist(f.metrics)) for k, f in engines])
        yield self._gc_pauses(engines)
        yield gauge_family(
            "lantau:cache_config_info",
            "The KV cache's configuration (value 1).",
            [*names, "block_size", "num_gpu_blocks"],
            [([*k, str(f.metrics.block_size), str(f.metrics.num_blocks)], 1) for k, f in engines],
        )
        lora = [(k, f.metrics) for k, f in engines if f.metrics.max_loras]
        for i, (name, doc) in enumerate(LORA_USAGE):
            yield counter_family(name, doc, [*names, "lora_name"], [
                ([*k, adapter], usage[i]) for k, m in lora
                for adapter, usage in sorted(m.lora_usage.items())
            ])  # fmt: skip
        if lora:
            yield gauge_family(
                "lantau:lora_requests_info",
                "LoRA adapters with requests running and waiting (vLLM's lora_requests_info; "
                "value: the scrape's Unix time).",
                [*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                [([*k, str(m.max_loras), *(",".join(a) for a in m.lora_requests())], time.time())
                 for k, m in lora],
            )  # fmt: skip

    def _gc_pauses(self, engines) -> Metric:
        """Each engine core's collections, and this frontend's own (its engine labels empty)
        once it froze its start-up heap."""
        samples = [([*k, "core"], f.metrics.core_gc) for k, f in engines]
        if PROCESS_GC.started:
            samples.append(([""] * len(self.label_names) + ["frontend"], PROCESS_GC.histograms))
        return gc_pause_family(self.label_names, samples)

    def _statuses(self, sources: list[EngineFigures]) -> Iterator[Metric]:
        """Answers by status, of every source: a repository's requests that no version took
        too (their `model_name` empty)."""
        names = self.label_names
        status, rejected = [], []
        for f in sources:
            labels, counts = list(f.metrics.labels.values()), f.metrics.status
            for (protocol, code), count in sorted(counts.items()):
                status.append(([*labels, protocol, code], count))
            for reason, codes in REJECTED_CODES:
                count = sum(n for (_, code), n in counts.items() if code in codes)
                rejected.append(([*labels, reason], count))
        yield counter_family(
            "lantau:request_status",
            "Inference requests answered, by protocol and status (HTTP code or gRPC status).",
            [*names, "protocol", "code"],
            status,
        )
        yield counter_family(
            "lantau:request_rejected",
            "Requests refused: overloaded (429, RESOURCE_EXHAUSTED) or unavailable (503, "
            "UNAVAILABLE: draining, engine down).",
            [*names, "reason"],
            rejected,
        )


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
    """The /metrics page: a registry of the engines' collector, the GPUs' and any `extra`."""

    def __init__(
        self,
        sources: Callable[[], list[EngineFigures]],
        label_names: list[str],
        gpus: GpuReader | None,
        extra: list | tuple = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(sources, label_names))
        for collector in extra:  # objects with collect() yielding families (the repository's)
            self.registry.register(collector)
        if gpus is not None:
            self.registry.register(GpuCollector(gpus))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_collectors(collectors: list | tuple) -> bytes:
    """The text exposition of objects with collect() yielding families (the gateway's)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry)
