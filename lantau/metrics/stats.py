"""The server's figures as plain Python (no prometheus_client, no torch): histograms, counters,
per-request timings, the request context that carries `x-request-id`. The event loop owns all
of it (routes, the core's output loop and the /metrics handler run on it), so nothing is locked.

Recording is a few operations: a histogram observation is one bisect and two adds, and most
are made once per request, at its end; the inter-token latency once per output chunk.
`lantau/metrics/prometheus.py` turns these into the exposition format at scrape time.
"""

from __future__ import annotations

import contextvars
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lantau.engine.protocol import StepStats

# Default bucket bounds (seconds), vLLM's with the alerting thresholds (0.35 s TTFT, 0.8 s
# end-to-end) and millisecond steps for decode on fast cards added: a quantile interpolated
# between two bounds is exact at the bounds.
LATENCY_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.5,
             0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "itl": (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
            0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e": (0.1, 0.2, 0.3, 0.35, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
}  # fmt: skip
# which bucket set each latency histogram takes unless --metrics-buckets names it
LATENCY_HISTOGRAMS = {
    "ttft": "ttft",
    "itl": "itl",
    "tpot": "itl",
    "e2e": "e2e",
    "dispatch": "itl",
    "queue": "e2e",
    "prefill": "ttft",
    "decode": "e2e",
    "http_in": "itl",
    "http_first_chunk": "itl",
}


# seconds a garbage collection paused its process (lantau/metrics/gc_pauses.py): a young one
# tens of microseconds, a full one over a large heap a tenth of a second
GC_PAUSE_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0
)  # fmt: skip
GC_GENERATIONS = (0, 1, 2)


def gc_pause_histograms() -> dict[int, Histogram]:
    """A pause histogram for each of the collector's generations."""
    return {generation: Histogram(GC_PAUSE_BUCKETS) for generation in GC_GENERATIONS}


def length_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's token-count buckets)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(bounds)
            bounds.append(float(m * scale))
        scale *= 10


def parse_buckets(specs: list[str]) -> dict[str, tuple[float, ...]]:
    """`--metrics-buckets NAME=B1,B2,...` (repeatable; NAME one of LATENCY_HISTOGRAMS) to
    {name: sorted bounds}; ValueError names what is wrong."""
    out = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or name not in LATENCY_HISTOGRAMS:
            raise ValueError(
                f"--metrics-buckets {spec!r}: expected NAME=B1,B2,... with NAME one of "
                + ", ".join(LATENCY_HISTOGRAMS)
            )
        bounds = sorted({float(v) for v in values.split(",") if v.strip()})
        if not bounds or bounds[0] <= 0:
            raise ValueError(f"--metrics-buckets {spec!r}: bounds must be positive")
        out[name] = tuple(bounds)
    return out


class Histogram:
    """Counts per bucket (`le` bounds, +Inf last, not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # NOTE: bisect_left finds the first bound >= value: Prometheus' `le` semantics
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class RequestTiming:
    """One request's times (time.monotonic(), a clock the core process shares) and counts."""

    arrival_s: float  # generate() was called
    num_prompt_tokens: int
    received_s: float = 0.0  # the core took it off its socket (0: not yet)
    scheduled_s: float = 0.0  # the core first scheduled it (0: not yet)
    first_token_s: float = 0.0  # its first output arrived (0: not yet)
    last_token_s: float = 0.0
    finished_s: float = 0.0
    lora: str | None = None  # its LoRA adapter (None: the base model)


@dataclass(frozen=True)
class RequestRecord:
    """A request as it ended in the engine: the request log's fields (rounded seconds)."""

    engine_request_id: str
    finish_reason: str  # stop | length | abort (left early: disconnect, deadline, error)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    dispatch_s: float | None
    queue_s: float | None
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float
    lora_name: str | None = None  # the LoRA adapter it ran through (None: the base model)


@dataclass
class RequestContext:
    """One API request as the server sees it: its id (`x-request-id`) and, once its engine
    request ends, the engine's record of it."""

    request_id: str
    records: list[RequestRecord] = field(default_factory=list)
    # the figures of the engine that took the request, where one did (its answer counts
    # there); None: refused before one did (auth, drain, no such model): the server's
    metrics: EngineMetrics | None = None
    started_s: float = 0.0  # time.monotonic() of the HTTP request's start (0: not HTTP)
    timing: RequestTiming | None = None  # its (first) engine request's, once one arrived


# the API request being served in this task (set by the HTTP middleware and the gRPC service)
CURRENT_REQUEST: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "lantau_current_request", default=None
)


def _since(end: float, start: float) -> float | None:
    return round(end - start, 6) if start and end else None


class EngineMetrics:
    """Everything /metrics exports from one engine and the frontend's requests to it, as plain
    numbers. `model_version`: a repository's version (a label of every series), None for a
    single model (`model_name` its only label, as before repositories)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        buckets: dict[str, tuple[float, ...]] | None = None,
        model_version: str | None = None,
    ) -> None:
        self.labels = {"model_name": model_name}  # NOTE: in label order
        if model_version is not None:
            self.labels["model_version"] = model_version
        chosen = {**LATENCY_BUCKETS, **(buckets or {})}
        self.latency = {
            name: Histogram(chosen.get(name, chosen[default]))
            for name, default in LATENCY_HISTOGRAMS.items()
        }
        self.itl = self.latency["itl"]  # observed per output chunk: kept at hand
        self.prompt_tokens = Histogram(length_buckets(max_model_len))
        self.output_tokens = Histogram(length_buckets(max_model_len))
        self.finished: defaultdict[str, int] = defaultdict(int)  # finish reason -> requests
        self.status: defaultdict[tuple[str, str], int] = defaultdict(int)  # (protocol, code)
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        # requests ended with a stop or length / aborted, and their end-to-end seconds; when
        # the last one ended (ms since the epoch): Triton's statistics (server/statistics.py)
        self.success_count, self.success_s = 0, 0.0
        self.fail_count, self.fail_s = 0, 0.0
        self.last_finished_ms = 0
        self.core_gc = gc_pause_histograms()  # the engine core's collections, by generation
        self.block_size = 0  # the cache's shape, for cache_config_info (set on start)
        self.num_blocks = 0
        # LoRA adapter slots (0: no adapters, no lora_requests_info) and the requests in
        # flight (the engine's own dict of timings, set on start)
        self.max_loras = 0
        self.in_flight: dict[str, RequestTiming] = {}
        # each adapter's finished requests, prompt and output tokens (usage by adapter)
        self.lora_usage: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """(adapters with a request running, adapters with a request waiting for its first
        scheduling), each sorted: vLLM's lora_requests_info."""
        running, waiting = set(), set()
        for timing in list(self.in_flight.values()):
            if timing.lora is not None:
                (running if timing.scheduled_s else waiting).add(timing.lora)
        return sorted(running), sorted(waiting)

    def record_finished(self, request_id: str, timing: RequestTiming, output) -> RequestRecord:
        """Observe a request that left the engine (`output`: its last RequestOutput, or None
        when none came); returns its record for the request log."""
        t = timing
        num_out = sum(len(o.token_ids) for o in output.outputs) if output is not None else 0
        reason = "abort"
        if output is not None and output.finished:
            reason = output.outputs[0].finish_reason or "abort"
        num_cached = output.num_cached_tokens if output is not None else 0
        record = RequestRecord(
            request_id, reason, t.num_prompt_tokens, num_out, num_cached,
            dispatch_s=_since(t.received_s, t.arrival_s),
            queue_s=_since(t.scheduled_s, t.arrival_s),
            ttft_s=_since(t.first_token_s, t.arrival_s),
            prefill_s=_since(t.first_token_s, t.scheduled_s),
            decode_s=_since(t.finished_s, t.first_token_s),
            e2e_s=round(t.finished_s - t.arrival_s, 6), lora_name=t.lora,
        )  # fmt: skip
        seq_len = len(output.outputs[0].token_ids) if output is not None else 0
        self._observe(record, t, seq_len)
        return record

    def _observe(self, r: RequestRecord, t: RequestTiming, seq_len: int) -> None:
        """`seq_len`: the first sequence's output tokens (time per output token is a
        sequence's, whatever `n` is)."""
        lat = self.latency
        self.finished[r.finish_reason] += 1
        self.num_prompt_tokens += r.num_prompt_tokens
        self.num_output_tokens += r.num_output_tokens
        self.num_cached_tokens += r.num_cached_tokens
        self.prompt_tokens.observe(r.num_prompt_tokens)
        self.output_tokens.observe(r.num_output_tokens)
        if r.lora_name is not None:
            usage = self.lora_usage[r.lora_name]
            usage[0] += 1
            usage[1] += r.num_prompt_tokens
            usage[2] += r.num_output_tokens
        e2e = t.finished_s - t.arrival_s
        lat["e2e"].observe(e2e)
        if r.finish_reason == "abort":
            self.fail_count += 1
            self.fail_s += e2e
        else:
            self.success_count += 1
            self.success_s += e2e
        self.last_finished_ms = int(time.time() * 1000)
        if t.received_s:
            lat["dispatch"].observe(max(t.received_s - t.arrival_s, 0.0))
        if t.scheduled_s:
            lat["queue"].observe(max(t.scheduled_s - t.arrival_s, 0.0))
        if t.first_token_s:
            lat["ttft"].observe(t.first_token_s - t.arrival_s)
            lat["decode"].observe(t.finished_s - t.first_token_s)
            if t.scheduled_s:
                lat["prefill"].observe(max(t.first_token_s - t.scheduled_s, 0.0))
        if seq_len > 1:
            lat["tpot"].observe((t.last_token_s - t.first_token_s) / (seq_len - 1))

    def record_core_gc(self, pauses: list[tuple[int, float]]) -> None:
        """The core's collections since its last message: (generation, seconds) each."""
        for generation, seconds in pauses:
            self.core_gc[generation].observe(seconds)

    def record_status(self, protocol: str, code: str) -> None:
        self.status[(protocol, code)] += 1

    def record_http_in(self, context: RequestContext, timing: RequestTiming) -> None:
        """An HTTP request's time from its start to its engine request's arrival."""
        if context.started_s:
            self.latency["http_in"].observe(max(timing.arrival_s - context.started_s, 0.0))

    def record_first_chunk(self, timing: RequestTiming, sent_s: float) -> None:
        """A streamed answer's first bytes sent at `sent_s`: from its first token at the
        frontend (none yet: an error event, not counted)."""
        if timing.first_token_s:
            self.latency["http_first_chunk"].observe(max(sent_s - timing.first_token_s, 0.0))


@dataclass(frozen=True)
class EngineFigures:
    """One engine's figures as /metrics reads them at a scrape."""

    metrics: EngineMetrics  # the frontend's request figures, and the labels
    stats: StepStats | None  # the core's last report; None: no engine (status counts only)
