"""Request ids, status counts and the request log, for every API.

`x-request-id` is taken from the request (a header; gRPC metadata) when it is a sane token, or
generated; it is returned in the response headers, goes into the id of the engine request (so
the core's logs name it), and into the request's log line. With `--log-requests`, each finished
inference request (an HTTP POST, a gRPC inference) writes one JSON line on the `lantau.requests`
logger (stderr): its id, status, time, and the engine's record (timings, token counts, finish
reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import re
import time
import uuid
from collections.abc import Iterator

import orjson

from lantau.metrics.stats import CURRENT_REQUEST, EngineMetrics, RequestContext

request_logger = logging.getLogger("lantau.requests")

_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_engine_ids = itertools.count()


def request_id_from(given: str | None) -> str:
    """The client's id if it is a sane token (no spaces or control characters, at most 128
    characters), else a new one."""
    if given and _SANE_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def engine_request_id(prefix: str) -> str:
    """The engine's id for a request of the current API request: unique even when clients
    reuse an x-request-id, and naming it."""
    context = CURRENT_REQUEST.get()
    suffix = f"-{context.request_id}" if context is not None else ""
    return f"{prefix}-{next(_engine_ids)}{suffix}"


def current_request_id() -> str | None:
    context = CURRENT_REQUEST.get()
    return None if context is None else context.request_id


def enable_request_log() -> None:
    """One JSON object a line on stderr, for the `lantau.requests` logger only."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
    request_logger.propagate = False


def log_request(
    context: RequestContext, protocol: str, route: str, status: str, start_s: float
) -> None:
    if not request_logger.isEnabledFor(logging.INFO):
        return
    line: dict = {
        "time": round(time.time(), 3),
        "request_id": context.request_id,
        "protocol": protocol,
        "route": route,
        "status": status,
        "duration_s": round(time.monotonic() - start_s, 6),
    }
    if len(context.records) == 1:
        line.update(dataclasses.asdict(context.records[0]))
    elif context.records:  # not today: one engine request an API request
        line["engine"] = [dataclasses.asdict(r) for r in context.records]
    request_logger.info(orjson.dumps(line).decode())


def record_status(
    context: RequestContext, server: EngineMetrics | None, protocol: str, status: str
) -> None:
    """Count an answer on the engine that took the request, else on the server's figures."""
    metrics = context.metrics or server
    if metrics is not None:
        metrics.record_status(protocol, status)


def _is_event_stream(headers) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in headers
    )


class RequestIdMiddleware:
    """Plain ASGI, outermost: every HTTP request gets an id (returned as `x-request-id`); an
    inference request (a POST) also counts by status and is logged."""

    def __init__(self, app, metrics: EngineMetrics | None, open_paths: tuple[str, ...]) -> None:
        self.app, self.metrics, self.open_paths = app, metrics, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
        start_s = time.monotonic()
        context = RequestContext(request_id_from(given), started_s=start_s)
        header = (b"x-request-id", context.request_id.encode())
        status = ["500"]  # unless a response starts
        first_chunk = [False]  # a streamed answer's first bytes are still to be sent

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
                status[0] = str(message["status"])
                first_chunk[0] = _is_event_stream(message["headers"])
            await send(message)
            if first_chunk[0] and message["type"] == "http.response.body" and message.get("body"):
                first_chunk[0] = False
                if context.metrics is not None and context.timing is not None:
                    context.metrics.record_first_chunk(context.timing, time.monotonic())

        token = CURRENT_REQUEST.set(context)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT_REQUEST.reset(token)
            if scope["method"] == "POST":
                record_status(context, self.metrics, "http", status[0])
                log_request(context, "http", scope["path"], status[0], start_s)


@dataclasses.dataclass
class ObservedCall:
    """A gRPC inference request being served: its context and its final status name."""

    context: RequestContext
    status: str = "OK"


@contextlib.contextmanager
def observe_grpc_call(
    metrics: EngineMetrics | None, method: str, given_id: str | None
) -> Iterator[ObservedCall]:
    """Serve one gRPC inference request under its id; on exit it is counted by status (set
    `call.status` before aborting a call; an exception otherwise names it) and logged."""
    call = ObservedCall(RequestContext(request_id_from(given_id)))
    token = CURRENT_REQUEST.set(call.context)
    start_s = time.monotonic()
    try:
        yield call
    except asyncio.CancelledError:
        call.status = "CANCELLED"
        raise
    except Exception:
        if call.status == "OK":
            call.status = "INTERNAL"
        raise
    finally:
        CURRENT_REQUEST.reset(token)
        record_status(call.context, metrics, "grpc", call.status)
        log_request(call.context, "grpc", method, call.status, start_s)
