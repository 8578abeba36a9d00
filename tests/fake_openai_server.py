"""A scripted OpenAI-compatible streaming server for testing `lantau bench serve`: aiohttp on
loopback, in a thread of its own; each request's status and timing come from a script.

Chunks go out on an absolute schedule from the moment the request's body is read: chunk k
(0-based) at ttft_s + k * itl_s, so lateness of one sleep never adds up along a stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


class AppThread:
    """An aiohttp app on loopback, served by a thread and an event loop of its own; the app is
    made by make_app() in that loop, its runner takes runner_kwargs (AppRunner's)."""

    def __init__(self, make_app: Callable[[], web.Application], **runner_kwargs) -> None:
        self._make_app = make_app
        self._runner_kwargs = runner_kwargs

    def __enter__(self) -> AppThread:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), f"{type(self).__name__} did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        self.app = self._make_app()
        self._runner = web.AppRunner(self.app, **self._runner_kwargs)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()


@dataclass(frozen=True)
class Script:
    status: int = 200  # anything else: an OpenAI-shaped error body, no stream
    ttft_s: float = 0.05
    itl_s: float = 0.01  # between chunks
    tokens_per_chunk: int = 1  # the usage chunk counts every token
    break_after: int | None = None  # drop the connection after this many chunks
    error_after: int | None = None  # an in-band error event after this many chunks


def is_probe(body: dict) -> bool:
    """lantau bench serve's first test request: 2 tokens of a cut prompt."""
    return body.get("max_tokens") == 2


class FakeOpenAIServer(AppThread):
    def __init__(
        self, script: Callable[[dict], Script], with_metrics: bool = False,
        model_names: tuple[str, ...] = ("fake-model",),
    ) -> None:  # fmt: skip
        super().__init__(self._app)
        self.script = script
        self.model_names = model_names  # what /v1/models lists
        self.with_metrics = with_metrics
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []  # every request but the probe, in arrival order
        self.headers: list = []  # and its headers (a CIMultiDictProxy each)
        self.arrivals: list[float] = []  # perf_counter when each body was read
        # each stream as sent: prompt -> (its arrival, perf_counter after each text chunk)
        self.streams: dict[tuple, tuple[float, list[float]]] = {}
        self.num_metrics_scrapes = 0
        self.health_status = 200  # what GET /health answers (a gateway's checks read it)
        self.reported_in_flight: int | None = None  # GET /status's num_in_flight (None: 404)

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status)
        if self.with_metrics:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model"} for name in self.model_names]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _status(self, request: web.Request) -> web.Response:
        if self.reported_in_flight is None:
            return web.Response(status=404)
        return web.json_response({"num_in_flight": self.reported_in_flight})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.num_metrics_scrapes += 1
        text = (
            "# TYPE fake_requests_total counter\n"
            f"fake_requests_total {len(self.bodies)}\n"
            "# TYPE fake_running gauge\n"
            f'fake_running{{model="fake-model"}} {self.num_in_flight}\n'
            'fake_latency_seconds_bucket{le="0.1"} 3\n'
        )
        return web.Response(text=text + self._lantau_metrics())

    def _lantau_metrics(self) -> str:
        """lantau's histograms as this server's streams so far make them (its TTFT: body read
        to first chunk, all of it prefill; no queue), and one engine step a chunk."""
        streams = list(self.streams.values())
        ttfts = [sent[0] - start for start, sent in streams if sent]
        gaps = [b - a for _, sent in streams for a, b in zip(sent, sent[1:], strict=False)]
        chunks = sum(len(sent) for _, sent in streams)
        label = '{model_name="fake-model"}'
        lines = []
        for name, values in (
            ("time_to_first_token_seconds", ttfts),
            ("request_prefill_time_seconds", ttfts),
            ("request_queue_time_seconds", [0.0] * len(ttfts)),
            ("request_dispatch_time_seconds", [0.0] * len(ttfts)),
            ("request_http_in_time_seconds", [0.0] * len(ttfts)),
            ("request_http_first_chunk_time_seconds", [0.0] * len(ttfts)),
            ("inter_token_latency_seconds", gaps),
        ):
            lines += [f"lantau:{name}_sum{label} {sum(values)!r}",
                      f"lantau:{name}_count{label} {len(values)}"]  # fmt: skip
        lines += [f"lantau:engine_steps_total{label} {chunks}",
                  f"lantau:engine_step_time_seconds_total{label} {sum(gaps)!r}",
                  f"lantau:engine_generated_tokens_total{label} {chunks}"]  # fmt: skip
        return "\n".join(lines) + "\n"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        start = time.perf_counter()
        script = self.script(body)
        if is_probe(body):
            script = Script(ttft_s=0, itl_s=0)
        else:
            self.bodies.append(body)
            self.headers.append(request.headers)
            self.arrivals.append(start)
        if script.status != 200:
            error = {"message": "scripted", "type": "error", "code": script.status}
            return web.json_response({"error": error}, status=script.status)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return await self._stream(request, body, script, start)
        finally:
            self.num_in_flight -= 1

    async def _stream(
        self, request: web.Request, body: dict, script: Script, start: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        num_chunks = -(-body["max_tokens"] // script.tokens_per_chunk)
        sent: list[float] = []
        if not is_probe(body):
            self.streams[tuple(body["prompt"])] = (start, sent)
        for k in range(num_chunks):
            if k == script.break_after:
                request.transport.close()
                return resp
            if k == script.error_after:
                await resp.write(_event({"error": {"message": "scripted", "code": 500}}))
                break
            delay = start + script.ttft_s + k * script.itl_s - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
            choice = {"index": 0, "text": "x" * script.tokens_per_chunk, "finish_reason": None}
            await resp.write(_event({"object": "text_completion", "choices": [choice]}))
            sent.append(time.perf_counter())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(_event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
