"""`lantau route`: an async HTTP proxy in front of several replicas (`lantau serve`, or any
OpenAI / KServe-v2 HTTP server): health checks, a routing policy (gateway/policy.py), retries
on another replica, failover, drain, and its own /metrics.

What is retried, on a replica the request has not tried (up to `max_attempts` in all):
- the connection failed or broke before the answer was complete (a buffered answer is read
  whole before it is sent on, so a replica dying mid-generation costs the client nothing but
  time), or the backend took longer than `connect_timeout_s` to accept;
- HTTP 503 (the replica is starting, draining or unloading) and 429 (its admission is full);
- a stream that broke before its first event.
A stream that breaks after events were sent on ends with an in-band error event (the OpenAI
client raises it) and `[DONE]`: tokens already delivered cannot be taken back.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from lantau.gateway.grpc_proxy import GrpcRelay, grpc_backend
from lantau.gateway.policy import Backend, backends_to_try, make_policy
from lantau.metrics.gc_pauses import PROCESS_GC
from lantau.tls import ClientTls, ServerTls

logger = logging.getLogger("lantau.gateway")

# hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself
_NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip
_RETRIED_STATUSES = (429, 503)


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[str, ...]  # base URLs of the replicas
    grpc_backends: tuple[str, ...] = ()  # their gRPC ports, HOST:PORT (gateway/grpc_proxy.py)
    grpc_port: int | None = None  # the gateway's own gRPC port (0: any free one)
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "least-loaded"  # gateway/policy.py's POLICIES
    health_interval_s: float = 1.0  # between rounds of GET /health on every backend
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0  # a replica slower than this to accept is tried no more
    max_attempts: int = 3  # replicas tried for one request
    max_body_bytes: int = 4 << 20  # as `lantau serve`'s cap (the raw bytes: gzip passes as is)
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to end
    session_header: str = "x-session-id"  # the session policy's key (else the body's "user")
    admin_key: str | None = None  # /gateway/backends changes need it; without one they are off
    backend_api_key: str | None = None  # sent with the gateway's own /v1/models reads
    backend_dns: tuple[str, ...] = ()  # NAME:PORT, resolved each health round to backends
    grpc_backend_dns: tuple[str, ...] = ()  # the same for gRPC ports
    tls: ServerTls | None = None  # the gateway's own listeners (HTTP and gRPC)
    # replicas found by DNS and gRPC ones speak TLS (https:// URLs always do), verified with
    # backend_client's CAs (None: the system's), its certificate presented where asked
    backend_tls: bool = False
    backend_client: ClientTls = ClientTls()

    def __post_init__(self) -> None:
        """What could not serve is refused here, at the edge, before any port opens."""
        grpc_sources = self.grpc_backends + self.grpc_backend_dns
        if not (self.backends or self.backend_dns or grpc_sources):
            raise ValueError(
                "lantau route needs a --backend URL, a --backend-dns NAME:PORT or a --grpc-backend"
            )
        for entry in self.backend_dns + self.grpc_backend_dns:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a --*backend-dns is NAME:PORT, got {entry!r}")
        if bool(grpc_sources) != (self.grpc_port is not None):
            raise ValueError("--grpc-backend (or --grpc-backend-dns) and --grpc-port go together")
        for url in self.backends:
            normalize_url(url)
        for address in self.grpc_backends:
            grpc_backend(address)
        make_policy(self.policy)  # an unknown name
        self.backend_client.context()  # files that do not load


@dataclass(frozen=True)
class Refused:
    """An attempt that did not answer: why, and the replica's own answer where it gave one
    (passed on when no replica answers better)."""

    reason: str  # connect, disconnect, timeout, http_429, http_503
    status: int = 502
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.backends = [Backend(normalize_url(u)) for u in config.backends]
        self.grpc_backends = [grpc_backend(a) for a in config.grpc_backends]
        self.policy = make_policy(config.policy)
        self.num_requests = 0  # requests received to pass on (the gateway's own routes aside)
        self.num_failed: Counter[str] = Counter()  # requests the gateway answered itself, by why
        self.model_entries: dict[str, dict[str, dict]] = {}  # backend -> its /v1/models entries
        # (scheme, a --backend-dns / --grpc-backend-dns entry) -> its backends' URLs
        self._discovered: dict[tuple[str, str], set[str]] = {}
        self._removals: set[asyncio.Task] = set()  # drains of backends gone from the DNS
        self.is_draining = False
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._grpc_relay: GrpcRelay | None = None
        self._grpc_server = None
        self._grpc_stopping: asyncio.Task | None = None
        self.bound_grpc_port: int | None = None

    @property
    def all_backends(self) -> list[Backend]:
        return self.backends + self.grpc_backends

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        # NOTE: no decompression: bodies pass through byte for byte with their Content-Encoding
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=self.config.backend_client.context()),
            auto_decompress=False,
        )
        if self.config.grpc_port is not None:
            await self._start_grpc()
        await self.discover()
        await self.check_all()  # routes from the first request on
        self._health_task = asyncio.create_task(self._health_loop())

    async def _start_grpc(self) -> None:
        import grpc

        self._grpc_relay = GrpcRelay(self, self.grpc_backends)
        self._grpc_server = grpc.aio.server()
        self._grpc_server.add_generic_rpc_handlers((self._grpc_relay,))
        address = f"{self.config.host}:{self.config.grpc_port}"
        if self.config.tls is None:
            self.bound_grpc_port = self._grpc_server.add_insecure_port(address)
        else:
            credentials = self.config.tls.grpc_credentials()
            self.bound_grpc_port = self._grpc_server.add_secure_port(address, credentials)
        await self._grpc_server.start()
        logger.info("gRPC on %s:%d", self.config.host, self.bound_grpc_port)

    async def drain(self, app: web.Application) -> None:
        """on_shutdown: new requests get 503 while aiohttp lets the running ones finish."""
        self.is_draining = True
        logger.info("draining %d requests", sum(b.num_in_flight for b in self.all_backends))
        if self._grpc_server is not None:  # refuses new calls, lets the open ones end
            stopping = self._grpc_server.stop(grace=self.config.drain_timeout_s)
            self._grpc_stopping = asyncio.create_task(stopping)

    async def stop(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._grpc_stopping is not None:
            await self._grpc_stopping
        if self._grpc_relay is not None:
            await self._grpc_relay.close()
        if self._session is not None:
            await self._session.close()

    # --- health ------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.discover()
            await self.check_all()

    async def discover(self) -> None:
        """--backend-dns / --grpc-backend-dns: each name's addresses now (a Kubernetes
        headless Service's ready pods); a new one becomes a backend (checked before it takes
        requests), one gone is drained and removed. A failed lookup changes nothing."""
        http = "https" if self.config.backend_tls else "http"
        sources = [(e, http, self.backends) for e in self.config.backend_dns]
        sources += [(e, "grpc", self.grpc_backends) for e in self.config.grpc_backend_dns]
        for entry, scheme, pool in sources:
            host, _, port = entry.rpartition(":")
            try:
                addresses = await self.resolve(host, int(port))
            except OSError as e:
                logger.warning("%s backends at %s: %s", scheme, entry, e)
                continue
            urls = {f"{scheme}://{a}:{port}" if ":" not in a else f"{scheme}://[{a}]:{port}"
                    for a in addresses}  # fmt: skip
            known = self._discovered.setdefault((scheme, entry), set())
            for url in sorted(urls - known):
                pool.append(Backend(url, tls_name=host))
                logger.info("backend %s found (%s)", url, entry)
            for url in known - urls:
                backend = next((b for b in pool if b.url == url), None)
                if backend is not None and not backend.is_draining:
                    removal = self.drain_and_remove(backend, pool)
                    self._removals.add(asyncio.create_task(removal))
            self._removals = {t for t in self._removals if not t.done()}
            self._discovered[(scheme, entry)] = urls

    async def resolve(self, host: str, port: int) -> set[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return {info[4][0] for info in infos}

    async def check_all(self) -> None:
        checks = [self.check(b) for b in self.backends]
        if self._grpc_relay is not None:
            checks += [self._grpc_relay.check(b) for b in self.grpc_backends]
        await asyncio.gather(*checks)

    async def check(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._session.get(
                backend.url + "/health", timeout=timeout, server_hostname=backend.tls_name
            ) as resp:
                await resp.read()
                is_healthy = resp.status == 200
            if is_healthy:
                await asyncio.gather(
                    self._read_models(backend, timeout), self._read_load(backend, timeout)
                )
            self.mark(backend, is_healthy, f"health check: HTTP {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as e:
            self.mark(backend, False, f"health check: {_describe(e)}")

    async def _read_load(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        """A `lantau serve`'s own count of its requests in flight (/status), which other
        gateways' and direct clients' requests are part of; None where it has none."""
        status = await self._get_json(backend, "/status", timeout)
        num = status.get("num_in_flight") if isinstance(status, dict) else None
        backend.report_in_flight(num if isinstance(num, int) else None)

    async def _get_json(self, backend: Backend, path: str, timeout: aiohttp.ClientTimeout):
        """A replica's JSON answer to GET path (with --backend-api-key), or None."""
        key = self.config.backend_api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with self._session.get(
            backend.url + path, headers=headers, timeout=timeout, server_hostname=backend.tls_name
        ) as r:
            body = await r.read()
        try:
            return orjson.loads(body) if r.status == 200 else None
        except orjson.JSONDecodeError:
            return None

    async def _read_models(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        """The backend's /v1/models: what it serves now (a repository loads and unloads)."""
        listed = await self._get_json(backend, "/v1/models", timeout)
        try:
            models = {e["id"]: e for e in listed["data"]} if listed is not None else None
        except (KeyError, TypeError):
            models = None
        backend.models = frozenset(models) if models is not None else None
        self.model_entries[backend.url] = models or {}

    def mark(self, backend: Backend, is_healthy: bool, error: str = "") -> None:
        if backend.set_healthy(is_healthy, error):
            if is_healthy:
                logger.info("backend %s is up", backend.url)
            else:
                logger.warning("backend %s is down: %s", backend.url, error)

    # --- proxying ----------------------------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        if self.is_draining:
            return self.fail("draining", 503, "the gateway is shutting down")
        body = await request.read()
        headers = forward_headers(request)
        fields = json_fields(request, body)
        key = self.session_key(request, fields)
        model = requested_model(request, fields, self.served_models())
        if not any(b.is_available and b.may_serve(model) for b in self.backends):
            # NOTE: none is known to serve it (one may have loaded it since its last check):
            # any replica may answer, with its own 404 if none has it
            model = None
        refused: Refused | None = None
        num_tried = 0
        start = time.perf_counter()
        attempts = self.config.max_attempts
        for backend in backends_to_try(self.policy, self.backends, attempts, key, model):
            num_tried += 1
            backend.start_request()
            try:
                answer = await self._attempt(request, backend, body, headers)
            finally:
                backend.end_request()
            if not isinstance(answer, Refused):
                backend.duration.observe(time.perf_counter() - start)
                return answer
            backend.num_retries[answer.reason] += 1
            if refused is None or answer.status in _RETRIED_STATUSES:
                refused = answer  # a replica's own 429 / 503 says more than a broken connection
        if refused is None:
            return self.fail("no_backend", 503, "no healthy backend to route the request to")
        if refused.status in _RETRIED_STATUSES:  # every replica tried was busy or not ready
            self.num_failed[refused.reason] += 1
            return web.Response(status=refused.status, body=refused.body, headers=refused.headers)
        message = f"no backend answered ({num_tried} tried; the last: {refused.reason})"
        return self.fail("all_attempts_failed", 502, message)

    async def _attempt(
        self, request: web.Request, backend: Backend, body: bytes, headers: CIMultiDict
    ) -> web.StreamResponse | Refused:
        url = backend.url + request.rel_url.raw_path_qs
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s)
        try:
            async with self._session.request(
                request.method, url, data=body, headers=headers, timeout=timeout,
                server_hostname=backend.tls_name,
            ) as resp:  # fmt: skip
                backend.num_responses[str(resp.status)] += 1
                if resp.status in _RETRIED_STATUSES:
                    if resp.status == 503:  # starting, draining or unloading: not for new work
                        self.mark(backend, False, "HTTP 503")
                    return Refused(f"http_{resp.status}", resp.status, await resp.read(),
                                   response_headers(resp))  # fmt: skip
                if resp.content_type == "text/event-stream":
                    return await self._relay_stream(request, backend, resp)
                payload = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._broken(backend, e)
        return web.Response(status=resp.status, body=payload, headers=response_headers(resp))

    def _broken(self, backend: Backend, e: BaseException) -> Refused:
        if isinstance(e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            reason = "connect"
        else:
            reason = "timeout" if isinstance(e, TimeoutError) else "disconnect"
        self.mark(backend, False, _describe(e))
        return Refused(reason)

    async def _relay_stream(
        self, request: web.Request, backend: Backend, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse | Refused:
        """Events sent on as they come; the response starts only with the first one, so a
        replica that fails before it is retried like any other."""
        try:
            first = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._broken(backend, e)
        if not first:
            return self._broken(backend, aiohttp.ServerDisconnectedError())
        out = web.StreamResponse(status=resp.status, headers=response_headers(resp))
        await out.prepare(request)
        await out.write(first)
        tail = first
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, TimeoutError) as e:
                self._broken(backend, e)
                await self._end_cut_stream(out, tail, backend)
                return out
            if not chunk:
                return out
            await out.write(chunk)  # NOTE: a client gone raises here: the replica's side closes
            tail = chunk

    async def _end_cut_stream(self, out: web.StreamResponse, tail: bytes, backend: Backend):
        self.num_failed["stream_cut"] += 1
        message = f"the replica serving this stream failed ({backend.last_error})"
        error = {"error": {"message": message, "type": "server_error", "code": 502}}
        # NOTE: an event cut in the middle is ended first, so the error is an event of its own
        end = b"" if tail.endswith(b"\n\n") else b"\n\n"
        await out.write(end + b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")

    def session_key(self, request: web.Request, fields: dict) -> str | None:
        """The session policy's key: the session header, else an OpenAI body's `user`."""
        if self.policy.name != "session":
            return None
        key = request.headers.get(self.config.session_header) or fields.get("user")
        return key if isinstance(key, str) and key else None

    def served_models(self) -> set[str]:
        return {m for b in self.backends for m in b.models or ()}

    async def list_models(self, request: web.Request) -> web.Response:
        """Every model an available backend serves (each once: the first backend's entry)."""
        merged: dict[str, dict] = {}
        for b in self.backends:
            if b.is_available:
                for name, entry in self.model_entries.get(b.url, {}).items():
                    merged.setdefault(name, entry)
        return json_response({"object": "list", "data": list(merged.values())})

    def fail(self, reason: str, status: int, message: str) -> web.Response:
        self.num_failed[reason] += 1
        return error_response(status, message)

    # --- the gateway's own routes ------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        serving = self.backends or self.grpc_backends  # HTTP replicas if any, else gRPC ones
        is_ready = not self.is_draining and any(b.is_available for b in serving)
        return web.Response(status=200 if is_ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from lantau.gateway.metrics import render_gateway_metrics

        text, content_type = render_gateway_metrics(self)
        return web.Response(body=text, headers={"Content-Type": content_type})

    async def list_backends(self, request: web.Request) -> web.Response:
        return json_response({"policy": self.policy.name, "backends": [
            {"url": b.url, "healthy": b.is_healthy, "draining": b.is_draining,
             "in_flight": b.num_in_flight, "reported_in_flight": b.reported_in_flight,
             "responses": b.num_responses,
             "models": sorted(b.models) if b.models is not None else None,
             "retries": b.num_retries, "last_error": b.last_error}
            for b in self.all_backends
        ]})  # fmt: skip

    async def add_backend(self, request: web.Request) -> web.Response:
        if (denied := self._check_admin(request)) is not None:
            return denied
        url = await self._url_of(request)
        if isinstance(url, web.Response):
            return url
        if any(b.url == url for b in self.backends):
            return error_response(409, f"backend {url} is already routed to")
        backend = Backend(url)
        self.backends.append(backend)
        await self.check(backend)
        logger.info("backend %s added (%s)", url, "up" if backend.is_healthy else "down")
        return json_response({"url": url, "healthy": backend.is_healthy}, status=201)

    async def remove_backend(self, request: web.Request) -> web.Response:
        """Drains a backend (no new requests; its in-flight ones end), then forgets it: once
        this answers, the replica can be stopped without dropping anything."""
        if (denied := self._check_admin(request)) is not None:
            return denied
        url = await self._url_of(request)
        if isinstance(url, web.Response):
            return url
        backend = next((b for b in self.backends if b.url == url), None)
        if backend is None:
            return error_response(404, f"backend {url} is not routed to")
        await self.drain_and_remove(backend)
        return json_response({"url": url, "in_flight": backend.num_in_flight})

    async def drain_and_remove(self, backend: Backend, pool: list[Backend] | None = None) -> None:
        """No new requests for the backend; forgotten once its requests in flight ended (or
        drain_timeout_s passed)."""
        backend.is_draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while backend.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        (self.backends if pool is None else pool).remove(backend)
        self.model_entries.pop(backend.url, None)
        logger.info("backend %s removed (%d requests open)", backend.url, backend.num_in_flight)

    def _check_admin(self, request: web.Request) -> web.Response | None:
        import hmac

        if self.config.admin_key is None:
            return error_response(403, "changing backends needs `lantau route --admin-key`")
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.config.admin_key.encode()):
            return error_response(401, "a wrong or missing admin key (Authorization: Bearer)")
        return None

    async def _url_of(self, request: web.Request) -> str | web.Response:
        try:
            url = orjson.loads(await request.read()).get("url")
            return normalize_url(url)
        except (orjson.JSONDecodeError, AttributeError, ValueError) as e:
            return error_response(400, f'expected a JSON body {{"url": "http://HOST:PORT"}}: {e}')


def normalize_url(url) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"a backend is an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


def json_fields(request: web.Request, body: bytes) -> dict:
    """A JSON object body's fields (an OpenAI request's `model`, `user`); {} for anything else
    (compressed, not JSON, not an object): such a request is routed by its path alone."""
    if request.headers.get("content-encoding") or not body.lstrip().startswith(b"{"):
        return {}
    try:
        fields = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


def requested_model(request: web.Request, fields: dict, known: set[str]) -> str | None:
    """The model a request names: KServe's /v2/models/NAME/... path (NAME may hold slashes:
    the longest known name the path starts with), else the body's `model`."""
    path = request.path
    if path.startswith("/v2/models/"):
        rest = path[len("/v2/models/") :]
        names = [m for m in known if rest == m or rest.startswith(m + "/")]
        return max(names, key=len) if names else None
    model = fields.get("model")
    return model if isinstance(model, str) and model else None


def _end_to_end(headers) -> list[tuple[str, str]]:
    """The headers a proxy passes on: not the hop-by-hop ones, nor those `Connection` names."""
    named = {t.strip().lower() for v in headers.getall("connection", ()) for t in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED | named]


def forward_headers(request: web.Request) -> CIMultiDict:
    headers = CIMultiDict(_end_to_end(request.headers))
    # NOTE: one id for every attempt, so the replicas' logs and the client's agree
    if not headers.get("x-request-id"):
        headers["x-request-id"] = uuid.uuid4().hex
    peer = request.remote or ""
    prior = ", ".join(headers.getall("x-forwarded-for", ()))
    headers["x-forwarded-for"] = f"{prior}, {peer}" if prior else peer
    return headers


def response_headers(resp: aiohttp.ClientResponse) -> tuple[tuple[str, str], ...]:
    return tuple(_end_to_end(resp.headers))


def error_response(status: int, message: str) -> web.Response:
    """An OpenAI-shaped error, as `lantau serve` answers."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": status}}
    return json_response(body, status=status)


def json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


GATEWAY = web.AppKey("gateway", Gateway)


def build_app(config: GatewayConfig) -> web.Application:
    gateway = Gateway(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[GATEWAY] = gateway
    app.on_startup.append(gateway.start)
    app.on_shutdown.append(gateway.drain)
    app.on_cleanup.append(gateway.stop)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics)
    app.router.add_get("/v1/models", gateway.list_models)
    app.router.add_get("/gateway/backends", gateway.list_backends)
    app.router.add_post("/gateway/backends", gateway.add_backend)
    app.router.add_delete("/gateway/backends", gateway.remove_backend)
    app.router.add_route("*", "/{path:.*}", gateway.proxy)
    return app


def run(config: GatewayConfig) -> None:
    """Serves until SIGTERM / SIGINT, then drains: the listener closes, requests in flight get
    up to drain_timeout_s to end."""
    sources = config.backends + config.backend_dns + config.grpc_backends + config.grpc_backend_dns
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logger.info(
        "routing to %s (%s) on %s://%s:%d",
        ", ".join(sources), config.policy, "https" if config.tls else "http", config.host,
        config.port,
    )  # fmt: skip
    app = build_app(config)

    async def freeze_startup_heap(app: web.Application) -> None:
        PROCESS_GC.start()  # start-up's objects out of the collector's walks (gc_pauses.py)

    app.on_startup.append(freeze_startup_heap)
    web.run_app(
        app, host=config.host, port=config.port, print=None,
        shutdown_timeout=config.drain_timeout_s, handler_cancellation=True,
        auto_decompress=False, ssl_context=config.tls.context() if config.tls else None,
    )  # fmt: skip
