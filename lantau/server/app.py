"""`lantau serve`: one FastAPI app (OpenAI + KServe v2 HTTP) and a gRPC server in front of an
engine core running in its own process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from lantau.engine.async_llm import AsyncLLM
from lantau.metrics.gc_pauses import PROCESS_GC
from lantau.server.auth import is_authorized, presented_key
from lantau.server.models import ModelRouter, SingleModelRouter
from lantau.server.observability import RequestIdMiddleware
from lantau.server.openai_api import error_response, json_response, make_openai_router
from lantau.server.reasoning import reasoning_parser
from lantau.server.schemas import RequestLimits
from lantau.server.tool_calls import tool_parser
from lantau.tls import ServerTls

if TYPE_CHECKING:
    from lantau.server.model_control import ModelManager

logger = logging.getLogger(__name__)

WEB_PAGE = Path(__file__).parent / "static" / "index.html"

# routes open without an API key: probes and scrapes
OPEN_PATHS = ("/", "/health", "/v2/health/live", "/v2/health/ready", "/metrics")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001  # 0: no gRPC server
    served_model_name: str = "lantau"
    served_model_aliases: tuple[str, ...] = ()  # more names requests may use for it
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    ready_max_silence_s: float = 5.0  # readiness needs a core report this recent
    max_pending_requests: int = 1024  # admission: beyond these, 429
    max_pending_tokens: int = 1 << 20
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may take
    live_max_silence_s: float = 30.0  # liveness fails once the core is silent this long
    max_n: int = 128  # samples one request may ask for (`n`)
    max_logprobs: int = 20  # top logprobs one token may ask for (under OpenAI's own limits)
    tool_call_parser: str | None = None  # chat `tools` served (server/tool_calls.py); None: 400
    reasoning_parser: str | None = None  # a chat answer's thinking apart (server/reasoning.py)
    enable_metrics: bool = True  # /metrics; off: nothing timed or counted (for A/B runs)
    metrics_buckets: tuple[str, ...] = ()  # --metrics-buckets NAME=B1,B2,... overrides
    log_requests: bool = False  # one JSON line per inference request on stderr
    # what requests leave out: the model's generation_config.json ("auto"), OpenAI's defaults
    # ("vllm"), or a folder's generation_config.json (lantau/model/generation_config.py)
    generation_config: str = "auto"
    chat_template: str | None = None  # --chat-template: replaces every model's own
    # CORS (vLLM's flags): the origins whose browser pages may call the API; none: no CORS
    # headers at all (vLLM allows every origin by default)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS on both listeners (HTTP and gRPC), mutual with a client CA (lantau/tls.py)
    tls: ServerTls | None = None

    trust_request_chat_template: bool = False  # a request's `chat_template` runs
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    lora_dir: str | None = None  # adapters served by folder name, loaded on first request

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            trust_request_chat_template=self.trust_request_chat_template,
            allow_runtime_lora_updating=self.allow_runtime_lora_updating,
        )


@dataclass
class ServerState:
    draining: bool = False  # SIGTERM seen: not ready, new requests get 503


class DrainMiddleware:
    """While draining, every route but the probes answers 503 (plain ASGI)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if self.state.draining and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            response = error_response(503, "server is shutting down", kind="server_error")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from the routes)."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope["path"] not in OPEN_PATHS
        if guarded and not is_authorized(presented_key(Headers(scope=scope).get), self.keys):
            response = error_response(401, "missing or wrong API key", kind="authentication_error")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def uvicorn_tls(tls: ServerTls | None) -> dict:
    """uvicorn's TLS arguments (none without a certificate)."""
    if tls is None:
        return {}
    import ssl

    return {
        "ssl_keyfile": tls.keyfile, "ssl_certfile": tls.certfile, "ssl_ca_certs": tls.ca_certs,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.ca_certs else ssl.CERT_NONE,
    }  # fmt: skip


def build_app(
    engine: AsyncLLM | ModelRouter,
    config: ServerConfig,
    state: ServerState | None = None,
    control: ModelManager | None = None,
) -> FastAPI:
    """The app for one engine (`lantau serve MODEL`) or a router's models (a repository's,
    `control` then its manager: the repository routes)."""
    app = FastAPI(title="lantau", docs_url=None, redoc_url=None)
    state = state or ServerState()
    if isinstance(engine, ModelRouter):
        router = engine
    else:  # a fixed model: ready while its engine is, and the server is not draining
        router = SingleModelRouter(
            engine,
            config.served_model_name,
            lambda: not state.draining and engine.is_ready(config.ready_max_silence_s),
            config.served_model_aliases,
        )
    app.state.router = router

    def default_engine() -> AsyncLLM | None:
        served = router.get(None)
        return None if served is None or not served.versions() else served.engine

    def is_ready() -> bool:
        if state.draining:
            return False
        if control is not None:
            return control.is_ready()
        return router.get(None).is_ready()

    app.state.is_ready = is_ready  # the gRPC server answers to the same readiness

    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys)
    app.add_middleware(DrainMiddleware, state=state)  # refuses before auth
    metrics = control.metrics if control is not None else getattr(engine, "metrics", None)
    # outermost: refusals by the two above get an id, a count and a log line too
    app.add_middleware(RequestIdMiddleware, metrics=metrics, open_paths=OPEN_PATHS)
    if config.allowed_origins:  # around all: a preflight carries no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    app.state.figures = None  # the engines' figures, for /metrics and Triton's statistics
    if metrics is not None:
        app.state.figures = _add_metrics_route(app, metrics, default_engine, control)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/")
    async def index() -> Response:
        """The web page: chat with the model (streaming) and the engine's live status."""
        return Response(WEB_PAGE.read_bytes(), media_type="text/html")

    @app.get("/health")
    async def health() -> Response:
        ok = is_ready()
        return Response(status_code=200 if ok else 503)

    @app.get("/status")
    async def status() -> Response:
        """The (default model's) engine's live state: for the web page and for tests."""
        engine = default_engine()
        stats = dataclasses.asdict(engine.stats) if engine is not None else {}
        stats.update(
            ready=is_ready(),
            draining=state.draining,
            num_in_flight=router.num_in_flight(),
            model=config.served_model_name
            if control is None
            else getattr(router.get(None), "name", None),
        )
        if engine is not None:
            stats.update(
                num_kv_blocks=engine.num_blocks,
                kv_cache_dtype=engine.kv_cache_dtype,
                engine_pid=engine.process.pid,
                tensor_parallel_size=engine.tensor_parallel_size,
                startup_s=engine.startup_s,
            )
        if control is not None:
            stats["models"] = control.status()
        return json_response(stats)

    app.include_router(
        make_openai_router(
            router,
            None,
            config.max_body_bytes,
            config.limits,
            tool_parser=tool_parser(config.tool_call_parser),
            reasoning_parser=reasoning_parser(config.reasoning_parser),
        )  # fmt: skip
    )
    try:
        from lantau.server.kserve_http import make_kserve_router
    except ImportError:  # NOTE: the KServe routes land separately; OpenAI serves without them
        logger.warning("KServe v2 HTTP routes unavailable")
    else:
        app.include_router(
            make_kserve_router(
                router,
                None,
                is_ready,
                max_body_bytes=config.max_body_bytes,
                statistics=app.state.figures,
            )  # fmt: skip
        )
    if control is not None:
        from lantau.server.model_control import make_repository_router

        app.include_router(make_repository_router(control))
    return app


def http_parser() -> str:
    """The HTTP/1.1 parser uvicorn picks ("auto"): httptools where installed (uvicorn[standard],
    a dependency of lantau), else the pure-Python h11, which streams SSE chunks at about half
    the rate and adds ~0.3 ms to a first chunk (benchmarks/frontend_stream.py with each)."""
    import importlib.util

    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def _add_metrics_route(app: FastAPI, metrics, default_engine, control) -> Callable:
    """/metrics; returns its source of the engines' figures."""
    # NOTE: prometheus_client and NVML load only when metrics are on
    from lantau.engine.protocol import StepStats
    from lantau.metrics.gpu import GpuReader
    from lantau.metrics.prometheus import CONTENT_TYPE_LATEST, MetricsExporter
    from lantau.metrics.stats import EngineFigures

    def one_engine() -> list[EngineFigures]:
        engine = default_engine()
        return [EngineFigures(metrics, engine.stats if engine is not None else StepStats())]

    sources, extra = one_engine, []
    if control is not None:  # a repository: each version's engine, and its transitions
        sources, extra = control.figures, [control.collector()]
    exporter = MetricsExporter(sources, list(metrics.labels), GpuReader.start(), extra)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        """Prometheus' text format: the engine's and the GPUs' figures, read now."""
        return Response(exporter.render(), media_type=CONTENT_TYPE_LATEST)

    return sources


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM or SIGINT starts a drain: readiness goes false and new requests get 503
        while the in-flight ones finish. At drain_timeout_s the rest end with an error (their
        requests aborted in the core) and the server exits. A second signal ends them at once.
        Signals are handled here, never re-raised: the caller still stops the engine core."""

        def __init__(self, config, router: ModelRouter, state: ServerState, drain_timeout_s: float):
            super().__init__(config)
            self.router, self.state, self.drain_timeout_s = router, state, drain_timeout_s
            self._loop = asyncio.get_running_loop()

        def handle_exit(self, sig, frame) -> None:
            if self.state.draining:
                logger.warning("second signal: ending %d requests now", self.router.num_in_flight())
                self._loop.call_soon_threadsafe(self._stop, "the server was stopped")
                return
            logger.info("draining %d requests (up to %.0f s)", self.router.num_in_flight(),
                        self.drain_timeout_s)  # fmt: skip
            self.state.draining = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

        async def _drain(self) -> None:
            deadline = self._loop.time() + self.drain_timeout_s
            while self.router.num_in_flight() and self._loop.time() < deadline:
                await asyncio.sleep(0.05)
            if not self.should_exit:
                self._stop(f"the server's drain timeout ({self.drain_timeout_s:g} s) passed")

        def _stop(self, reason: str) -> None:
            if self.router.num_in_flight():
                logger.warning("%s: ending %d requests", reason, self.router.num_in_flight())
                self.router.fail_requests(f"server shutting down: {reason}")
            self.should_exit = True

    return DrainingServer


def describe_startup(stages: dict[str, float]) -> str:
    """'48.0 s: config 0.2 s, then tokenizer 22.1 s alongside engine_core 47.7 s (weights
    0.9 s, ...)': the tokenizer loads while the engine core starts."""
    stages = dict(stages)
    total, config = stages.pop("total", 0.0), stages.pop("config", 0.0)
    tokenizer, core = stages.pop("tokenizer", 0.0), stages.pop("engine_core", 0.0)
    inner = ", ".join(f"{name} {s:.1f} s" for name, s in stages.items())
    return (
        f"{total:.1f} s: config {config:.1f} s, then tokenizer {tokenizer:.1f} s alongside "
        f"engine_core {core:.1f} s ({inner})"
    )


async def _start_fixed_model(engine_args: dict, config: ServerConfig, started: float, early):
    """`lantau serve MODEL`: one engine core, the tokenizer loading while it starts. `early`:
    (engine config, model source, SpawnedCore) when the core was spawned before this module's
    imports (cli.serve), else None."""
    from lantau.engine.args import build_engine_config
    from lantau.metrics.stats import EngineMetrics, parse_buckets
    from lantau.model.generation_config import describe, model_sampling_defaults, source_folder
    from lantau.model.source import load_tokenizer

    if early is None:
        engine_config, source = build_engine_config(engine_args.pop("model"), **engine_args)
        core = None
    else:
        engine_config, source, core = early
    metrics = None
    if config.enable_metrics:
        metrics = EngineMetrics(
            config.served_model_name,
            engine_config.scheduler.max_model_len,
            parse_buckets(list(config.metrics_buckets)),
        )
    # the config's stage ends where the core's starts (with `early`, before the web stack's
    # imports, which then run beside the core's start)
    startup = {"config": (core.started if core is not None else time.perf_counter()) - started}
    defaults = model_sampling_defaults(source_folder(source), config.generation_config)
    engine = AsyncLLM(
        engine_config,
        source,
        None,  # loaded below, while the engine core starts
        max_pending_requests=config.max_pending_requests,
        max_pending_tokens=config.max_pending_tokens,
        live_max_silence_s=config.live_max_silence_s,
        metrics=metrics,
        sampling_defaults=defaults,
        chat_template=config.chat_template,
        lora_dir=config.lora_dir,
    )
    await engine.start(tokenizer=asyncio.to_thread(load_tokenizer, source), core=core)
    engine.startup_s = {"total": time.perf_counter() - started, **startup, **engine.startup_s}
    cache = engine.config.cache
    kv = f"KV cache {engine.num_blocks * cache.block_size:,} tokens, {cache.kv_cache_dtype}"
    if defaults:  # as vLLM says it: the model's own defaults apply
        kv += f"; the model's sampling defaults (generation_config.json): {describe(defaults)}"
    return engine, (
        config.served_model_name,
        f"ready in {describe_startup(engine.startup_s)}; {kv}",
    )


async def _start_repository(
    engine_args: dict, config: ServerConfig, options, started: float, standby
):
    """`lantau serve --model-repository REPO`: the models its control mode loads at start.
    `standby`: a SpawnedCore without a config, spawned before this module's imports (cli.serve),
    or None."""
    from lantau.metrics.stats import EngineMetrics
    from lantau.server.model_control import ModelManager

    engine_args.pop("model", None)
    transitions = logging.getLogger("lantau.repository")  # every transition, on stderr
    if not transitions.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        transitions.addHandler(handler)
        transitions.setLevel(logging.INFO)
    # NOTE: the server's own figures: answers to requests no version took (each version's
    # engine has its figures, labelled with its model and version); no model: labels empty
    metrics = EngineMetrics("", 1, model_version="") if config.enable_metrics else None
    manager = ModelManager(options, engine_args, config, metrics, standby)
    await manager.start()
    loaded = ", ".join(f"{n} v{manager.models[n].versions()[0]}" for n in manager.model_names())
    took = time.perf_counter() - started
    return manager, (
        f"model repository {options.path}",
        f"mode {options.control_mode}; loaded: {loaded or 'none'}; ready in {took:.1f} s",
    )


async def serve(
    engine_args: dict, config: ServerConfig, repository=None, early=None, started: float = 0.0
) -> int:
    """Start the engine (or a repository's), serve until stopped; non-zero when a fixed
    model's engine died under us. `repository`: model_control.RepositoryOptions; `early`:
    a fixed model's core spawned already (_start_fixed_model), or a repository's standby core
    (_start_repository); `started`: time.perf_counter() of the command's start (default: now)."""
    import uvicorn

    from lantau.server.observability import enable_request_log

    started = started or time.perf_counter()
    if config.log_requests:
        enable_request_log()
    state = ServerState()
    if repository is None:
        engine, banner = await _start_fixed_model(engine_args, config, started, early)
        app, control, metrics = build_app(engine, config, state), None, engine.metrics
    else:
        control, banner = await _start_repository(engine_args, config, repository, started, early)
        app, metrics = build_app(control, config, state, control), control.metrics
    router: ModelRouter = app.state.router
    grpc_server = None
    if config.grpc_port:
        try:
            from lantau.server.kserve_grpc import start_grpc_server
        except ImportError:
            logger.warning("KServe v2 gRPC server unavailable")
        else:
            grpc_server = await start_grpc_server(
                router, None, config.host, config.grpc_port,
                app.state.is_ready, api_keys=config.api_keys,
                max_message_bytes=config.max_body_bytes, control=control, metrics=metrics,
                statistics=app.state.figures,
                credentials=config.tls.grpc_credentials() if config.tls else None,
            )  # fmt: skip
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,  # a connection still open after its request ended
        **uvicorn_tls(config.tls),
    )
    server = _draining_server_class()(uvicorn_config, router, state, config.drain_timeout_s)
    if http_parser() == "h11":
        logger.warning(
            "httptools is not installed: uvicorn parses HTTP with h11 (pure Python), which "
            "streams at about half httptools' rate; pip install 'uvicorn[standard]'"
        )

    async def watch_engine() -> None:
        while router.dead is None:
            await asyncio.sleep(0.5)
        logger.error("engine core died (%s); shutting down", router.dead)
        server.should_exit = True

    watcher = asyncio.create_task(watch_engine())
    what, detail = banner
    scheme = "https" if config.tls is not None else "http"
    print(f"lantau serving {what} on {scheme}://{config.host}:{config.port} ({detail})", flush=True)
    PROCESS_GC.start()  # start-up's objects out of the collector's walks (gc_pauses.py)
    await server.serve()
    PROCESS_GC.stop()
    watcher.cancel()
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    dead = router.dead
    await router.shutdown()
    return 1 if dead else 0
