"""The Triton / KServe v2 API over gRPC: `inference.GRPCInferenceService`.

The servicer is built on tritonclient's compiled stubs, so one process can hold both the server
and tritonclient (a second copy of the same .proto would clash in protobuf's registry). Tensor
rules, validation and generation are kserve_http's KServeModel; this module only translates.

    ModelInfer        one response with the whole text (a `stream` input is ignored)
    ModelStreamInfer  requests interleave on one stream; a streaming request gets a response
                      per text delta, the last with parameter triton_final_response = true
Errors are status codes (NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE); inside a stream, a
response with `error_message`, as Triton sends them. A cancelled call aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from lantau.server.auth import is_authorized, presented_key
from lantau.server.kserve_http import (
    OUTPUT_NAME,
    ErrorCode,
    InferJob,
    KServeError,
    KServeModel,
    KServeModels,
    Tensor,
    check_tensor,
    decode_raw_tensor,
    encode_bytes_tensor,
    invalid,
    server_metadata,
)
from lantau.server.models import ModelRouter, as_router
from lantau.server.observability import observe_grpc_call
from lantau.server.statistics import model_statistics

if TYPE_CHECKING:
    from lantau.engine.async_llm import AsyncLLM
    from lantau.server.model_control import ModelManager

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # responses: long texts with logprobs

# which InferTensorContents field holds a datatype's values when they are not raw bytes
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def decode_parameters(parameters) -> dict:
    """map<string, InferParameter> as plain Python values."""
    decoded = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        decoded[key] = getattr(param, which) if which else None
    return decoded


def decode_grpc_inputs(request: service_pb2.ModelInferRequest) -> list[Tensor]:
    """Inputs from raw_input_contents (what tritonclient sends) or typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    tensors = []
    for i, tensor in enumerate(request.inputs):
        if raw:
            values = decode_raw_tensor(tensor.name, tensor.datatype, raw[i])
        elif tensor.datatype in CONTENTS_FIELDS:
            values = list(getattr(tensor.contents, CONTENTS_FIELDS[tensor.datatype]))
        else:
            raise invalid(f"{tensor.name}: datatype {tensor.datatype!r} needs raw contents")
        tensors.append(
            check_tensor(Tensor(tensor.name, tensor.datatype, list(tensor.shape), values))
        )
    return tensors


def parse_request(
    models: KServeModels, request: service_pb2.ModelInferRequest
) -> tuple[KServeModel, InferJob]:
    model = models.get(request.model_name, request.model_version)
    model.check_ready()
    for output in request.outputs:
        if output.name != OUTPUT_NAME:
            raise invalid(f"unexpected inference output '{output.name}'")
    parameters = decode_parameters(request.parameters)
    job = model.build_job(
        decode_grpc_inputs(request), parameters, request.id, request.model_version
    )
    return model, job


def infer_response(
    model: KServeModel, job: InferJob, text: str | None, is_final: bool | None = None
) -> service_pb2.ModelInferResponse:
    """A response holding `text` (no output when None); `is_final`: triton_final_response."""
    response = service_pb2.ModelInferResponse(
        model_name=model.name, model_version=job.model_version, id=job.client_id
    )
    if text is not None:
        response.outputs.add(name=OUTPUT_NAME, datatype="BYTES", shape=job.output_shape)
        response.raw_output_contents.append(encode_bytes_tensor([text.encode()]))
    if is_final is not None:
        response.parameters["triton_final_response"].bool_param = is_final
    return response


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Health, metadata, config, inference, statistics and (with a model repository) its
    index, load and unload; shared memory is left UNIMPLEMENTED by the base class."""

    def __init__(
        self,
        router: ModelRouter,
        is_ready: Callable[[], bool],
        control: ModelManager | None = None,
        metrics=None,
        statistics: Callable[[], list] | None = None,
    ) -> None:
        self.router, self.models, self.is_ready = router, KServeModels(router), is_ready
        self.control = control
        self.metrics = metrics
        self.statistics = statistics  # the engines' figures (server/statistics.py)

    async def ModelStatistics(self, request, context) -> service_pb2.ModelStatisticsResponse:
        try:
            body = model_statistics(self.statistics, request.name, request.version)
        except KServeError as e:
            await abort(context, e)
        return json_format.ParseDict(body, service_pb2.ModelStatisticsResponse())

    async def ServerLive(self, request, context) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=self.router.is_live())

    async def ServerReady(self, request, context) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.is_ready())

    async def ServerMetadata(self, request, context) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(**server_metadata())

    async def ModelReady(self, request, context) -> service_pb2.ModelReadyResponse:
        # as Triton: an unknown model is "not ready" here, not an error
        try:
            model = self.models.get(request.name, request.version)
        except KServeError:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=model.is_ready())

    async def ModelMetadata(self, request, context) -> service_pb2.ModelMetadataResponse:
        try:
            model = self.models.get(request.name, request.version)
        except KServeError as e:
            await abort(context, e)
        return json_format.ParseDict(model.metadata(), service_pb2.ModelMetadataResponse())

    async def ModelConfig(self, request, context) -> service_pb2.ModelConfigResponse:
        try:
            model = self.models.get(request.name, request.version)
        except KServeError as e:
            await abort(context, e)
        config = json_format.ParseDict(model.config(), model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    async def RepositoryIndex(self, request, context) -> service_pb2.RepositoryIndexResponse:
        control = await self._control(context)
        index = control.index(ready_only=request.ready)
        return service_pb2.RepositoryIndexResponse(
            models=[service_pb2.RepositoryIndexResponse.ModelIndex(**m) for m in index]
        )

    async def RepositoryModelLoad(self, request, context):
        control = await self._control(context)
        try:
            await control.load(request.model_name)
        except KServeError as e:
            await abort(context, e)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        control = await self._control(context)
        try:
            await control.unload(request.model_name)
        except KServeError as e:
            await abort(context, e)
        return service_pb2.RepositoryModelUnloadResponse()

    async def _control(self, context) -> ModelManager:
        if self.control is None:
            await abort(context, KServeError(ErrorCode.UNAVAILABLE, "no model repository: "
                                             "start with --model-repository"))  # fmt: skip
        return self.control

    async def ModelInfer(self, request, context) -> service_pb2.ModelInferResponse:
        # NOTE: a cancelled call cancels this task, which leaves engine.generate: aborted
        given_id = _metadata_request_id(context) or request.id
        with observe_grpc_call(self.metrics, "ModelInfer", given_id) as call:
            await context.send_initial_metadata((("x-request-id", call.context.request_id),))
            try:
                model, job = parse_request(self.models, request)
                return infer_response(model, job, await model.complete(job))
            except KServeError as e:
                call.status = e.code.name
                await abort(context, e)

    async def ModelStreamInfer(
        self, request_iterator, context
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Serve every request on the stream at once; responses interleave, matched by id."""
        responses: asyncio.Queue = asyncio.Queue()
        given_id = _metadata_request_id(context)
        reader = asyncio.create_task(self._read_stream(request_iterator, responses, given_id))
        try:
            while (response := await responses.get()) is not None:
                yield response
        finally:  # the client went away or the call ended: abort what is still running
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_stream(self, request_iterator, responses: asyncio.Queue, given_id: str) -> None:
        """A task per request; once the client closes its side and they finish, None."""
        tasks: set[asyncio.Task] = set()
        try:
            async for request in request_iterator:
                task = asyncio.create_task(self._serve_one(request, responses, given_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            responses.put_nowait(None)  # however reading ended, the response stream ends

    async def _serve_one(self, request, responses: asyncio.Queue, given_id: str) -> None:
        with observe_grpc_call(self.metrics, "ModelStreamInfer", request.id or given_id) as call:
            try:
                model, job = parse_request(self.models, request)
                if job.is_stream:
                    await self._stream_deltas(model, job, request, responses)
                else:
                    text = await model.complete(job)
                    response = infer_response(model, job, text, is_final=True)
                    message = service_pb2.ModelStreamInferResponse(infer_response=response)
                    responses.put_nowait(message)
            except KServeError as e:
                call.status = e.code.name
                responses.put_nowait(stream_error(request, str(e)))
            except Exception as e:  # a bug: say so on this request, keep the stream's others
                call.status = "INTERNAL"
                logger.exception("ModelStreamInfer request %r failed", request.id)
                responses.put_nowait(stream_error(request, f"internal error: {e}"))

    async def _stream_deltas(
        self, model: KServeModel, job: InferJob, request, responses: asyncio.Queue
    ) -> None:
        # tritonclient's enable_empty_final_response: deltas, then an empty final response
        has_empty_final = decode_parameters(request.parameters).get(
            "triton_enable_empty_final_response", False
        )
        async with aclosing(model.stream(job)) as deltas:
            async for delta, is_final in deltas:
                if has_empty_final and not delta:
                    continue
                response = infer_response(model, job, delta, is_final and not has_empty_final)
                responses.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
        if has_empty_final:
            response = infer_response(model, job, None, is_final=True)
            responses.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))


def _metadata_request_id(context: grpc.aio.ServicerContext) -> str:
    """The call's `x-request-id` metadata, or ""."""
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "x-request-id" and isinstance(value, str):
            return value
    return ""


def stream_error(request, message: str) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)


async def abort(context: grpc.aio.ServicerContext, e: KServeError) -> None:
    """End the call with the error's status code (raises)."""
    await context.abort(grpc.StatusCode[e.code.name], str(e))


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every method but the health checks needs an API key (`authorization: Bearer KEY` or
    `x-api-key` metadata); without one the call ends UNAUTHENTICATED before it is handled."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.rsplit("/", 1)[-1] in OPEN_METHODS:
            return handler
        metadata = {k.lower(): v for k, v in details.invocation_metadata or ()}
        if is_authorized(presented_key(metadata.get), self.keys):
            return handler
        return _refusal(handler)


OPEN_METHODS = frozenset({"ServerLive", "ServerReady", "ModelReady"})  # probes: no key


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")

    async def refuse_stream(requests, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        yield  # an async generator, as a streaming handler must be

    codecs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    return grpc.unary_unary_rpc_method_handler(refuse, **codecs)


async def start_grpc_server(
    engine: AsyncLLM | ModelRouter,
    model_name: str | None,
    host: str,
    port: int,
    is_ready: Callable[[], bool],
    *,
    api_keys: tuple[str, ...] = (),
    max_message_bytes: int = 4 << 20,
    control: ModelManager | None = None,
    metrics=None,
    statistics: Callable[[], list] | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> grpc.aio.Server:
    """Serve `inference.GRPCInferenceService` on host:port; stop it with `await server.stop(s)`.
    A request message is capped as an HTTP body is (`max_message_bytes`). `credentials`: TLS
    only (lantau/tls.py), as the HTTP listener."""
    server = grpc.aio.server(
        interceptors=[APIKeyInterceptor(api_keys)] if api_keys else [],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_message_bytes),
        ],
    )
    router = as_router(engine, model_name, is_ready)
    if metrics is None and not isinstance(engine, ModelRouter):
        metrics = getattr(engine, "metrics", None)
    service = InferenceService(router, is_ready, control, metrics, statistics)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    if credentials is None:
        bound_port = server.add_insecure_port(f"{host}:{port}")
    else:
        bound_port = server.add_secure_port(f"{host}:{port}", credentials)
    await server.start()
    logger.info("KServe gRPC on %s:%d", host, bound_port)
    return server
