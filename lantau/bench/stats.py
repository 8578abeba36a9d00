"""The statistics of `lantau bench serve`: per-request records, percentiles, the SLO and
goodput, and the run's summary (plain Python: no numpy, no torch)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the two closest ranks:
    numpy.percentile's default ("linear") method. NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """One latency's distribution over a run, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencyStats:
        ms = [1000 * v for v in values_s]
        if not ms:
            return cls(0, *([math.nan] * 6))
        p50, p90, p95, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(len(ms), sum(ms) / len(ms), p50, p90, p95, p99, max(ms))

    def at(self, q: int) -> float:
        return {50: self.p50, 90: self.p90, 95: self.p95, 99: self.p99}[q]


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    index: int  # the request's place in the workload
    start_s: float  # when it was sent, from the run's start
    ok: bool
    error: str | None = None  # kind: "http_429", "http_500", "timeout", "connection", "stream"
    ttft_s: float = math.nan  # send to the first chunk with text
    e2e_s: float = math.nan  # send to the end of the stream
    itl_s: tuple[float, ...] = ()  # every gap between chunks with text, after the first
    num_prompt_tokens: int = 0  # the server's usage if it sent one, else the ids sent
    num_output_tokens: int = 0  # the server's usage if it sent one, else the text chunks

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: (e2e - ttft) / (n_out - 1)."""
        if not self.ok or self.num_output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Bounds in seconds (None: unbounded). A request meets the SLO when each of its latencies
    is within its bound; a run meets it when it had no error and the P95 of each is."""

    ttft_s: float | None = 0.350
    tpot_s: float | None = 0.050
    itl_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """From "ttft=350ms,tpot=50ms" (also vLLM's --goodput form "ttft:350 tpot:50"; a bare
        number is in ms)."""
        bounds: dict[str, float | None] = {"ttft_s": None, "tpot_s": None}
        for item in re.split(r"[,\s]+", text.strip()):
            m = re.fullmatch(r"(ttft|tpot|itl|e2e|e2el)[=:]([\d.]+)(ms|s)?", item)
            if m is None:
                raise ValueError(f"slo: {item!r} is not NAME=VALUE[ms|s] (ttft, tpot, itl, e2e)")
            name = "e2e" if m[1] == "e2el" else m[1]
            bounds[f"{name}_s"] = float(m[2]) / (1 if m[3] == "s" else 1000)
        return cls(**bounds)

    def items(self) -> list[tuple[str, float]]:
        names = ("ttft", "tpot", "itl", "e2e")
        return [(n, b) for n in names if (b := getattr(self, f"{n}_s")) is not None]

    def is_met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        worst_itl = max(record.itl_s, default=0.0)
        values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "itl": worst_itl}
        values["e2e"] = record.e2e_s
        # NOTE: a one-token reply has no TPOT; NaN compares false, so test "not above"
        return all(not values[name] > bound for name, bound in self.items())

    def describe(self) -> str:
        return ", ".join(f"{n} P95 <= {1000 * b:g} ms" for n, b in self.items()) or "none"


@dataclass(frozen=True)
class ServeSummary:
    """A run's figures: what the report prints and the sweep compares."""

    num_requests: int
    num_completed: int
    duration_s: float  # first send to the last request's end
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (prompt + output) tok/s
    goodput: float  # requests/s that met the SLO
    num_prompt_tokens: int
    num_output_tokens: int
    errors: dict[str, int]  # by kind
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    meets_slo: bool

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> ServeSummary:
    done = [r for r in records if r.ok]
    stats = {
        "ttft": LatencyStats.of([r.ttft_s for r in done]),
        "tpot": LatencyStats.of([r.tpot_s for r in done if not math.isnan(r.tpot_s)]),
        "itl": LatencyStats.of([gap for r in done for gap in r.itl_s]),
        "e2e": LatencyStats.of([r.e2e_s for r in done]),
    }
    errors = dict(sorted(Counter(r.error for r in records if not r.ok).items()))
    # NaN (no sample, e.g. no TPOT of one-token replies) does not break the SLO
    within = all(not stats[name].p95 > 1000 * bound for name, bound in slo.items())
    num_in = sum(r.num_prompt_tokens for r in done)
    num_out = sum(r.num_output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return ServeSummary(
        num_requests=len(records),
        num_completed=len(done),
        duration_s=duration_s,
        request_throughput=len(done) * per_s,
        output_throughput=num_out * per_s,
        total_token_throughput=(num_in + num_out) * per_s,
        goodput=sum(slo.is_met_by(r) for r in done) * per_s,
        num_prompt_tokens=num_in,
        num_output_tokens=num_out,
        errors=errors,
        meets_slo=within and not errors and bool(done),
        **stats,
    )


# lantau's server histograms the breakdown reads: key -> metric name (each with _sum, _count)
SERVER_LATENCIES = {
    "dispatch": "lantau:request_dispatch_time_seconds",  # arrival -> the core takes it
    "queue": "lantau:request_queue_time_seconds",  # arrival -> first scheduling
    "prefill": "lantau:request_prefill_time_seconds",  # first scheduling -> first token
    "ttft": "lantau:time_to_first_token_seconds",
    "itl": "lantau:inter_token_latency_seconds",
    "http_in": "lantau:request_http_in_time_seconds",  # HTTP request start -> arrival
    "http_first_chunk": "lantau:request_http_first_chunk_time_seconds",  # first token -> sent
}


def _matching(series: dict[str, dict], name: str, labels: dict[str, str]) -> list[dict]:
    """The series of metric `name` whose labels include `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [
        v for key, v in series.items()
        if key.split("{", 1)[0] == name and all(w in key for w in wanted)
    ]  # fmt: skip


def series_rise(series: dict[str, dict], name: str, **labels: str) -> float:
    """A counter's rise over the run (MetricsSampler.summary()["series"]), summed over its
    label sets (models, versions) that carry `labels`."""
    return sum(v.get("delta", 0.0) for v in _matching(series, name, labels))


def gc_rise(series: dict[str, dict], suffix: str, process: str, **labels: str) -> float:
    """lantau:gc_pause_seconds_{suffix}'s rise over the run in one kind of process (`core`,
    `frontend`); nan when the server exports none."""
    name = "lantau:gc_pause_seconds_" + suffix
    if not _matching(series, name, {"process": process}):
        return math.nan
    return series_rise(series, name, process=process, **labels)


def time_breakdown(summary: ServeSummary, series: dict[str, dict]) -> dict[str, float] | None:
    """Where a request's time went, means in ms: the server's own histograms over the run
    (queue, of which dispatch to the engine core, then prefill: together its TTFT) against the
    TTFT the client saw; the difference is spent outside the engine: in the server's HTTP
    layer before the engine (http_in) and between the first token and its bytes sent
    (http_first_chunk, streams), the rest in the network and the client. With
    the engine's steps (count, mean wall time, tokens sampled a step) and the garbage
    collector's pauses over the run (ms in all, full collections) in the engine cores and the
    frontend. None when the server exports none of lantau's histograms."""

    def mean_ms(name: str) -> float:
        count = series_rise(series, name + "_count")
        return 1000 * series_rise(series, name + "_sum") / count if count else math.nan

    server = {key: mean_ms(name) for key, name in SERVER_LATENCIES.items()}
    if all(math.isnan(v) for v in server.values()):
        return None
    server_total = server["ttft"] + server["http_in"] + server["http_first_chunk"]
    steps = series_rise(series, "lantau:engine_steps_total")
    step_s = series_rise(series, "lantau:engine_step_time_seconds_total")
    tokens = series_rise(series, "lantau:engine_generated_tokens_total")
    return {
        "client_ttft_ms": summary.ttft.mean,
        "server_dispatch_ms": server["dispatch"],
        "server_queue_ms": server["queue"],
        "server_prefill_ms": server["prefill"],
        "server_ttft_ms": server["ttft"],
        "outside_engine_ttft_ms": summary.ttft.mean - server["ttft"],
        "server_http_in_ms": server["http_in"],
        "server_http_first_chunk_ms": server["http_first_chunk"],
        "outside_server_ttft_ms": summary.ttft.mean - server_total,
        "client_itl_ms": summary.itl.mean,
        "server_itl_ms": server["itl"],
        "engine_steps": steps,
        "step_ms": 1000 * step_s / steps if steps else math.nan,
        "tokens_per_step": tokens / steps if steps else math.nan,
        **{
            f"{process}_{key}": value
            for process in ("core", "frontend")
            for key, value in (
                ("gc_paused_ms", 1000 * gc_rise(series, "sum", process)),
                ("gc_full_collections", gc_rise(series, "count", process, generation="2")),
            )
        },
    }
