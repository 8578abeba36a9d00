"""`lantau serve`: one FastAPI app (OpenAI + KServe v2 HTTP) and a gRPC server in front of an
engine core running in its own process."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from lantau.engine.async_llm import AsyncLLM
from lantau.server.openai_api import error_response, json_response, make_openai_router

logger = logging.getLogger(__name__)

# routes open without an API key: probes and scrapes
OPEN_PATHS = ("/health", "/v2/health/live", "/v2/health/ready", "/metrics")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001  # 0: no gRPC server
    served_model_name: str = "lantau"
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    ready_max_silence_s: float = 5.0  # readiness needs a core report this recent


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from the routes)."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope["path"] not in OPEN_PATHS
        if guarded and not _authorized(Headers(scope=scope), self.keys):
            response = error_response(401, "missing or wrong API key", kind="authentication_error")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _authorized(headers: Headers, keys: tuple[str, ...]) -> bool:
    given = headers.get("x-api-key", "")
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    # NOTE: compare against every key in constant time: no early exit leaks which matched
    matches = [hmac.compare_digest(given.encode(), k.encode()) for k in keys]
    return any(matches)


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="lantau", docs_url=None, redoc_url=None)
    app.state.engine = engine

    def is_ready() -> bool:
        return engine.is_ready(config.ready_max_silence_s)

    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> Response:
        ok = is_ready()
        return Response(status_code=200 if ok else 503)

    @app.get("/status")
    async def status() -> Response:
        """The engine's live state: for the web page and for tests."""
        stats = dataclasses.asdict(engine.stats)
        stats.update(
            ready=is_ready(), num_kv_blocks=engine.num_blocks, model=config.served_model_name
        )
        return json_response(stats)

    app.include_router(make_openai_router(engine, config.served_model_name, config.max_body_bytes))
    try:
        from lantau.server.kserve_http import make_kserve_router
    except ImportError:  # NOTE: the KServe routes land separately; OpenAI serves without them
        logger.warning("KServe v2 HTTP routes unavailable")
    else:
        app.include_router(make_kserve_router(engine, config.served_model_name, is_ready))
    return app


async def serve(engine_args: dict, config: ServerConfig) -> int:
    """Start the engine, serve until stopped; non-zero when the engine died under us."""
    import uvicorn

    from lantau.llm import build_engine_config
    from lantau.model.loader import load_tokenizer

    engine_config, source = build_engine_config(engine_args.pop("model"), **engine_args)
    engine = AsyncLLM(engine_config, source, load_tokenizer(source))
    await engine.start()
    app = build_app(engine, config)
    grpc_server = None
    if config.grpc_port:
        try:
            from lantau.server.kserve_grpc import start_grpc_server
        except ImportError:
            logger.warning("KServe v2 gRPC server unavailable")
        else:
            grpc_server = await start_grpc_server(
                engine, config.served_model_name, config.host, config.grpc_port,
                lambda: engine.is_ready(config.ready_max_silence_s),
            )  # fmt: skip
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                       http="httptools", access_log=False)
    )  # fmt: skip

    async def watch_engine() -> None:
        while engine.dead is None:
            await asyncio.sleep(0.5)
        logger.error("engine core died (%s); shutting down", engine.dead)
        server.should_exit = True

    watcher = asyncio.create_task(watch_engine())
    print(
        f"lantau serving {config.served_model_name} on http://{config.host}:{config.port}",
        flush=True,
    )
    await server.serve()
    watcher.cancel()
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    dead = engine.dead
    await engine.shutdown()
    return 1 if dead else 0
