"""The gateway's /metrics: its backends' plain counters (gateway/policy.py's `Backend`) read at
scrape time, under `lantau:gateway_` names (docs/gateway.md lists them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from lantau.metrics.gc_pauses import PROCESS_GC
from lantau.metrics.prometheus import (
    CONTENT_TYPE_LATEST,
    counter_family,
    gauge_family,
    gc_pause_family,
    histogram_family,
    render_collectors,
)

if TYPE_CHECKING:
    from lantau.gateway.proxy import Gateway


class GatewayCollector:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator:
        backends = self.gateway.all_backends
        b = ["backend"]

        def per_backend(counts_of) -> list:
            """((url, key), count) of each backend's Counter `counts_of(backend)`."""
            return [((x.url, k), n) for x in backends for k, n in sorted(counts_of(x).items())]

        yield gauge_family(
            "lantau:gateway_backend_up", "1 while the backend passes its health checks.",
            b, [((x.url,), int(x.is_healthy)) for x in backends],
        )  # fmt: skip
        yield gauge_family(
            "lantau:gateway_backend_draining", "1 while the backend takes no new requests.",
            b, [((x.url,), int(x.is_draining)) for x in backends],
        )  # fmt: skip
        yield gauge_family(
            "lantau:gateway_backend_requests_in_flight",
            "Requests the gateway has open on the backend.",
            b, [((x.url,), x.num_in_flight) for x in backends],
        )  # fmt: skip
        yield counter_family(
            "lantau:gateway_backend_responses", "Responses from the backend, by HTTP status.",
            ["backend", "code"],
            per_backend(lambda x: x.num_responses),
        )  # fmt: skip
        yield counter_family(
            "lantau:gateway_retries",
            "Requests that left the backend for another one, by why (connect, disconnect, "
            "timeout, http_429, http_503).",
            ["backend", "reason"],
            per_backend(lambda x: x.num_retries),
        )  # fmt: skip
        yield counter_family(
            "lantau:gateway_backend_transitions",
            "Health changes of the backend, by the state it went to (up, down).",
            ["backend", "to"],
            per_backend(lambda x: x.num_transitions),
        )  # fmt: skip
        yield counter_family(
            "lantau:gateway_requests",
            "Requests the gateway received to pass on (its own routes aside).",
            [], [((), self.gateway.num_requests)],
        )  # fmt: skip
        yield counter_family(
            "lantau:gateway_failed_requests",
            "Requests the gateway answered with its own error, by why (no_backend, "
            "all_attempts_failed, stream_cut, draining, or http_429 / http_503 when every "
            "backend tried refused).",
            ["reason"], sorted(((r,), n) for r, n in self.gateway.num_failed.items()),
        )  # fmt: skip
        yield histogram_family(
            "lantau:gateway_request_duration_seconds",
            "Time from a request's arrival at the gateway to its answer's end, by the backend "
            "that answered.",
            b, [((x.url,), x.duration) for x in backends],
        )  # fmt: skip
        if PROCESS_GC.started:  # `lantau route`'s own collections (lantau/metrics/gc_pauses.py)
            yield gc_pause_family([], [(["gateway"], PROCESS_GC.histograms)])


def render_gateway_metrics(gateway: Gateway) -> tuple[bytes, str]:
    return render_collectors([GatewayCollector(gateway)]), CONTENT_TYPE_LATEST
