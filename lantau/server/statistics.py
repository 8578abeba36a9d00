"""Triton's statistics extension: each served model version's inference statistics, as
`GET /v2/models[/{name}[/versions/{version}]]/stats` and gRPC `ModelStatistics` answer them
(tritonclient's `get_inference_statistics`; perf_analyzer's server-side figures).

Read from the figures /metrics exports (one `EngineFigures` a version's engine), so they are
there while metrics are (not with `--disable-metrics`). An iteration-level engine has no
batches of whole requests; Triton's fields map onto a request's stages:

- `success` / `fail`: requests that ended with a stop or length / aborted (a disconnect, a
  deadline, an error), and their end-to-end time;
- `queue`: arrival to the first step that schedules it;
- `compute_input`: arrival to the engine core taking it off its socket (the dispatch);
- `compute_infer`: its first scheduling to its last token (prefill and decode);
- `compute_output`, `cache_hit`, `cache_miss` (Triton's response cache): none, zero;
- `inference_count`: requests ended; `execution_count`: the engine's steps (its batches);
- `batch_stats`: none (a step's batch is tokens of many requests, not one batch size).
"""

from __future__ import annotations

from collections.abc import Callable

from lantau.metrics.stats import EngineFigures, Histogram
from lantau.server.kserve_http import ErrorCode, KServeError
from lantau.server.models import SINGLE_VERSION

Figures = Callable[[], list[EngineFigures]]


def _duration(count: int, seconds: float) -> dict:
    return {"count": count, "ns": int(seconds * 1e9)}


def _of(h: Histogram) -> dict:
    return _duration(h.count, h.sum)


def _entry(name: str, version: str, figures: EngineFigures) -> dict:
    m = figures.metrics
    lat = m.latency
    infer = lat["prefill"].sum + lat["decode"].sum
    return {
        "name": name,
        "version": version,
        "last_inference": m.last_finished_ms,
        "inference_count": m.success_count + m.fail_count,
        "execution_count": figures.stats.num_steps,
        "inference_stats": {
            "success": _duration(m.success_count, m.success_s),
            "fail": _duration(m.fail_count, m.fail_s),
            "queue": _of(lat["queue"]),
            "compute_input": _of(lat["dispatch"]),
            "compute_infer": _duration(lat["prefill"].count, infer),
            "compute_output": _duration(0, 0.0),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [],
    }


def model_statistics(figures: Figures | None, name: str = "", version: str = "") -> dict:
    """`{"model_stats": [...]}` for every version served (name ""), a model's versions, or
    one version; KServeError for a model or version not served, or with metrics off."""
    if figures is None:
        raise KServeError(
            ErrorCode.UNAVAILABLE, "statistics are off: the server runs with --disable-metrics"
        )
    stats = []
    for f in figures():
        if f.stats is None:  # the server's own figures: requests no version took
            continue
        model = f.metrics.labels.get("model_name", "")
        served = f.metrics.labels.get("model_version", SINGLE_VERSION)
        if (not name or model == name) and (not version or served == version):
            stats.append(_entry(model, served, f))
    if name and not stats:
        which = f"'{name}'" + (f" version {version}" if version else "")
        raise KServeError(ErrorCode.NOT_FOUND, f"Request for unknown model: {which} is not served")
    return {"model_stats": stats}
