"""The gateway's gRPC side: KServe v2 / Triton's `inference.GRPCInferenceService` relayed to the
replicas' gRPC ports as raw bytes (nothing decoded, so any version of the service passes), with
the HTTP side's policies, health and retries.

Retried on another replica: UNAVAILABLE (unreachable, starting, draining: it is also marked
down) and RESOURCE_EXHAUSTED (its admission is full), for a unary call, and for a
ModelStreamInfer stream until its first response (INTERNAL too there; the requests sent so far
are replayed to the replica that takes over). Any other status passes to the client as the
replica gave it; a stream whose replica fails after responses went out ends with UNAVAILABLE
naming that.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterator

import grpc

from lantau.gateway.policy import Backend, backends_to_try

SERVICE = "/inference.GRPCInferenceService/"
STREAMING_METHODS = frozenset({SERVICE + "ModelStreamInfer"})  # the rest are unary
READY_METHOD = SERVICE + "ServerReady"
# NOTE: a ServerReadyResponse with ready = true on the wire (field 1, varint 1); false is empty
READY_REPLY = b"\x08\x01"
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# NOTE: a replica that ends a stream while the gateway is still sending its requests can leave
# INTERNAL ("Internal error from Core", the failed send) as the call's status in place of its
# own: before the first response, that is retried as well
_STREAM_RETRIED = (*_RETRIED, grpc.StatusCode.INTERNAL)


def grpc_backend(address: str) -> Backend:
    """A replica's gRPC port (HOST:PORT) as a Backend named grpc://HOST:PORT."""
    address = address.removeprefix("grpc://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a gRPC backend is HOST:PORT, got {address!r}")
    return Backend(f"grpc://{address}")


class GrpcRelay(grpc.GenericRpcHandler):
    """Every method of the service, each call sent on to a replica chosen by the gateway."""

    def __init__(self, gateway, backends: list[Backend]) -> None:
        self.gateway = gateway  # proxy.Gateway: the policy, the limits, mark(), num_failed
        self.backends = backends
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, backend: Backend) -> grpc.aio.Channel:
        if backend.url not in self._channels:
            address = backend.url.removeprefix("grpc://")
            config = self.gateway.config
            if config.backend_tls:  # the certificate checked against its DNS name, if found so
                name = [("grpc.ssl_target_name_override", backend.tls_name)]
                self._channels[backend.url] = grpc.aio.secure_channel(
                    address, config.backend_client.grpc_credentials(),
                    options=name if backend.tls_name else None,
                )  # fmt: skip
            else:
                self._channels[backend.url] = grpc.aio.insecure_channel(address)
        return self._channels[backend.url]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))

    async def check(self, backend: Backend) -> None:
        timeout = self.gateway.config.health_timeout_s
        try:
            reply = await self.channel(backend).unary_unary(READY_METHOD)(b"", timeout=timeout)
            self.gateway.mark(backend, reply == READY_REPLY, "health check: not ready")
        except grpc.aio.AioRpcError as e:
            self.gateway.mark(backend, False, f"health check: {e.code().name}: {e.details()}")

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        if not method.startswith(SERVICE):
            return None  # UNIMPLEMENTED
        # NOTE: partials, not lambdas: grpc.aio tells coroutines and async generators apart
        # by their functions
        if method in STREAMING_METHODS:
            return grpc.stream_stream_rpc_method_handler(functools.partial(self._stream, method))
        return grpc.unary_unary_rpc_method_handler(functools.partial(self._unary, method))

    def _backends_to_try(self) -> Iterator[Backend]:
        return backends_to_try(self.gateway.policy, self.backends, self.gateway.config.max_attempts)

    def _refused(self, backend: Backend, e: grpc.aio.AioRpcError) -> None:
        backend.num_retries[e.code().name.lower()] += 1
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            self.gateway.mark(backend, False, f"{e.code().name}: {e.details()}")

    async def _unary(self, method: str, request: bytes, context) -> bytes:
        self.gateway.num_requests += 1
        metadata = forward_metadata(context)
        last: grpc.aio.AioRpcError | None = None
        for backend in self._backends_to_try():
            backend.start_request()
            try:
                reply = await self.channel(backend).unary_unary(method)(
                    request, metadata=metadata, timeout=context.time_remaining()
                )
                backend.num_responses["OK"] += 1
                return reply
            except grpc.aio.AioRpcError as e:
                backend.num_responses[e.code().name] += 1
                if e.code() not in _RETRIED:
                    await context.abort(e.code(), e.details())
                self._refused(backend, e)
                last = e
            finally:
                backend.end_request()
        await self._give_up(context, last)

    async def _stream(self, method: str, requests: AsyncIterator[bytes], context):
        """ModelStreamInfer: the client's requests pumped to the replica, its responses back."""
        self.gateway.num_requests += 1
        metadata = forward_metadata(context)
        client = ClientRequests(requests)
        last: grpc.aio.AioRpcError | None = None
        try:
            for backend in self._backends_to_try():
                backend.start_request()
                call = self.channel(backend).stream_stream(method)(
                    client.replay_then_follow(), metadata=metadata,
                    timeout=context.time_remaining(),
                )  # fmt: skip
                num_relayed = 0
                try:
                    async for response in call:
                        num_relayed += 1
                        yield response
                    backend.num_responses["OK"] += 1
                    return
                except grpc.aio.AioRpcError as e:
                    backend.num_responses[e.code().name] += 1
                    if num_relayed and e.code() is grpc.StatusCode.UNAVAILABLE:  # cut
                        self.gateway.num_failed["stream_cut"] += 1
                        self.gateway.mark(backend, False, e.details())
                        message = f"the replica serving this stream failed: {e.details()}"
                        await context.abort(e.code(), message)
                    if num_relayed or e.code() not in _STREAM_RETRIED:
                        await context.abort(e.code(), e.details())
                    self._refused(backend, e)
                    last = e
                finally:
                    call.cancel()
                    backend.end_request()
            await self._give_up(context, last)
        finally:
            client.close()

    async def _give_up(self, context, last: grpc.aio.AioRpcError | None) -> None:
        if last is None:
            self.gateway.num_failed["no_backend"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy backend to route to")
        self.gateway.num_failed[last.code().name.lower()] += 1
        await context.abort(last.code(), last.details())


class ClientRequests:
    """A stream's requests from the client, each kept: a replica that takes the stream over
    before its first response gets them all again, then the client's next ones as they come.
    Each replica's call reads the list at its own pace (none takes a request from another)."""

    def __init__(self, requests: AsyncIterator[bytes]) -> None:
        self.sent: list[bytes] = []
        self.is_closed = False  # the client closed its side (or its stream failed)
        self._grown = asyncio.Event()
        self._pumping = asyncio.create_task(self._pump(requests))

    async def _pump(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for request in requests:
                self.sent.append(request)
                self._grown.set()
        finally:
            self.is_closed = True
            self._grown.set()

    async def replay_then_follow(self) -> AsyncIterator[bytes]:
        num_given = 0
        while True:
            while num_given < len(self.sent):
                yield self.sent[num_given]
                num_given += 1
            if self.is_closed:
                return
            # NOTE: no await between the checks above and the wait: the pump cannot slip in
            self._grown.clear()
            await self._grown.wait()

    def close(self) -> None:
        self._pumping.cancel()


def forward_metadata(context) -> tuple[tuple[str, str | bytes], ...]:
    """The client's metadata (API keys, request ids) less gRPC's own and the pseudo-headers."""
    return tuple(
        (k, v)
        for k, v in (context.invocation_metadata() or ())
        if not k.startswith((":", "grpc-")) and k not in ("user-agent", "content-type", "te")
    )
