"""The Triton / KServe v2 API over HTTP, and the protocol core that kserve_grpc shares.

The model is seen the way TensorRT-LLM's ensemble shows itself to Triton clients: a BYTES
`text_input` (one prompt), optional sampling tensors (`max_tokens` INT32, `temperature` FP32,
...), a BYTES `text_output` (the generated text, without the prompt). Streams carry text deltas.

Routes (`{name}` may hold slashes, as tritonclient sends names like `org/model` unquoted):

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready    200, or 503
    GET  /v2/models/{name}[/versions/{v}]      model metadata
    GET  .../ready | .../config                model readiness | Triton-style config
    POST .../infer                             JSON tensors or the binary tensor extension
    POST .../generate | .../generate_stream    Triton's generate extension (JSON | SSE)

Errors are `{"error": message}`: 404 unknown model, 400 bad input, 503 not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

import lantau
from lantau.engine.async_llm import EngineDeadError, EngineOverloadedError
from lantau.errors import InvalidRequestError
from lantau.outputs import RequestOutput
from lantau.request import INT64_MAX, INT64_MIN, UINT64_MAX, SamplingParams
from lantau.server.body import RequestBodyError
from lantau.server.body import read_body as read_raw_body
from lantau.server.models import ModelRouter, ServedModel, as_router
from lantau.server.observability import current_request_id, engine_request_id
from lantau.server.schemas import (
    INFER_HEADER_DECODER,
    OBJECT_DECODER,
    InferHeader,
    Scalar,
    decode,
    json_kind,
)
from lantau.server.schemas import convert as convert_field

if TYPE_CHECKING:
    from lantau.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

T = TypeVar("T")

MODEL_VERSION = "1"  # a fixed model's (lantau serve MODEL) one version
OUTPUT_NAME = "text_output"
SERVER_EXTENSIONS = (
    "binary_tensor_data", "parameters", "model_configuration", "generate", "statistics"
)  # fmt: skip
GenerateParameters = dict[str, Scalar] | None


# ---------------------------------------------------------------- protocol core (no HTTP)


class ErrorCode(enum.Enum):
    """Named as gRPC's status codes (kserve_grpc looks them up by name); values: HTTP status."""

    INVALID_ARGUMENT = 400
    NOT_FOUND = 404
    ALREADY_EXISTS = 409  # a load of a model already loading
    RESOURCE_EXHAUSTED = 429  # admission refused (EngineOverloadedError): retry later
    UNAVAILABLE = 503


class KServeError(Exception):
    def __init__(self, code: ErrorCode, message: str, http_status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status or code.value  # where HTTP has a closer status (413)


def invalid(message: str) -> KServeError:
    return KServeError(ErrorCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # as metadata declares it; numbers are accepted in any numeric datatype
    kind: type  # what the tensor's one element becomes: str, int, float, bool; list: strings
    field: str | None = None  # the SamplingParams field it sets


INPUT_SPECS = {
    spec.name: spec
    for spec in (
        InputSpec("text_input", "BYTES", str),
        InputSpec("max_tokens", "INT32", int, "max_tokens"),
        InputSpec("min_length", "INT32", int, "min_tokens"),  # TRT-LLM's name
        InputSpec("temperature", "FP32", float, "temperature"),
        InputSpec("top_p", "FP32", float, "top_p"),
        InputSpec("top_k", "INT32", int, "top_k"),
        InputSpec("repetition_penalty", "FP32", float, "repetition_penalty"),
        InputSpec("presence_penalty", "FP32", float, "presence_penalty"),
        InputSpec("frequency_penalty", "FP32", float, "frequency_penalty"),
        InputSpec("random_seed", "UINT64", int, "seed"),
        InputSpec("stream", "BOOL", bool),
        InputSpec("stop_words", "BYTES", list, "stop"),
        # TensorRT-LLM's guided decoding: json (any JSON value), json_schema, regex,
        # ebnf_grammar, with the guide (lantau/structured.py)
        InputSpec("guided_decoding_guide_type", "BYTES", str),
        InputSpec("guided_decoding_guide", "BYTES", str),
        InputSpec("bad_words", "BYTES", list),
        # TRT-LLM's flag; absent here means True (text_output is the generated text only)
        InputSpec("exclude_input_in_output", "BOOL", bool),
        InputSpec("cache_salt", "BYTES", str, "cache_salt"),  # vLLM's: a tenant's prefixes
    )
}

# little-endian struct formats of the fixed-size datatypes (BYTES is length-prefixed)
STRUCT_FORMATS = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
CONFIG_TYPES = {"BYTES": "TYPE_STRING", **{t: f"TYPE_{t}" for t in STRUCT_FORMATS}}


@dataclass
class Tensor:
    """One decoded input tensor; `values` flattened row-major, `bytes` for BYTES."""

    name: str
    datatype: str
    shape: list[int]
    values: list


@dataclass(frozen=True)
class InferJob:
    """A validated request, ready for the engine."""

    prompt: str
    params: SamplingParams
    priority: int
    is_stream: bool  # the `stream` input; only gRPC's stream honours it
    has_prompt_in_output: bool  # exclude_input_in_output=False; streams never repeat it
    output_shape: list[int]  # text_output's shape: text_input's ([1] or [1, 1])
    client_id: str  # the client's request id, echoed in responses
    version: str = ""  # the version asked for ("": the one serving now)
    # the version that served it (set by outputs() once the engine is picked)
    served_version: list[str] = dataclasses.field(default_factory=list)

    @property
    def model_version(self) -> str:
        return self.served_version[0] if self.served_version else (self.version or MODEL_VERSION)


_request_ids = itertools.count()


def new_request_id(client_id: str) -> str:
    """Unique across HTTP and gRPC; names the API request's x-request-id (or, outside one,
    the client's id), kept for logs, never trusted alone."""
    if current_request_id() is not None:
        return engine_request_id("kserve")
    suffix = f"-{client_id[:64]}" if client_id else ""
    return f"kserve-{next(_request_ids)}{suffix}"


def decode_bytes_tensor(raw: bytes) -> list[bytes]:
    """BYTES elements: each a 4-byte little-endian length, then that many bytes."""
    values, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise invalid("BYTES tensor: truncated element length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise invalid("BYTES tensor: element runs past the end of its data")
        values.append(bytes(raw[offset : offset + size]))
        offset += size
    return values


def encode_bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def decode_raw_tensor(name: str, datatype: str, raw: bytes) -> list:
    """A tensor's values from its raw little-endian bytes (binary HTTP, gRPC raw contents)."""
    if datatype == "BYTES":
        return decode_bytes_tensor(raw)
    fmt = STRUCT_FORMATS.get(datatype)
    if fmt is None:
        raise invalid(f"{name}: unsupported datatype {datatype!r}")
    size = struct.calcsize(fmt)
    if len(raw) % size:
        raise invalid(f"{name}: {len(raw)} bytes is not a whole number of {datatype}")
    return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))


def check_tensor(tensor: Tensor) -> Tensor:
    """A known datatype and a shape that holds exactly its values."""
    if tensor.datatype not in CONFIG_TYPES:
        raise invalid(f"{tensor.name}: unsupported datatype {tensor.datatype!r}")
    if any(not isinstance(d, int) or d < 0 for d in tensor.shape):
        raise invalid(f"{tensor.name}: bad shape {tensor.shape}")
    if math.prod(tensor.shape) != len(tensor.values):
        raise invalid(
            f"{tensor.name}: shape {tensor.shape} does not hold {len(tensor.values)} values"
        )
    return tensor


def convert(name: str, kind: type, value: Any) -> Any:
    """One element as `kind`, or a 400 naming the input; bools are not numbers here, and
    integers must fit the 64 bits the engine core's messages carry."""
    if kind is str and isinstance(value, bytes | str):
        try:
            return value.decode() if isinstance(value, bytes) else value
        except UnicodeDecodeError:
            raise invalid(f"{name}: not valid UTF-8") from None
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is bool and (isinstance(value, bool) or (is_number and value in (0, 1))):
        return bool(value)
    if kind is int and is_number and _is_integral(value):
        if INT64_MIN <= value <= UINT64_MAX:
            return int(value)
        raise invalid(f"{name}: expected a 64-bit integer")
    if kind is float and is_number:
        try:
            return float(value)
        except OverflowError:  # an int past float's range
            raise invalid(f"{name}: number out of range") from None
    raise invalid(f"{name}: expected {KIND_NAMES[kind]}, got {json_kind(value)}")


KIND_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}


def _is_integral(value: int | float) -> bool:
    return isinstance(value, int) or value.is_integer()  # NaN and inf are not


class KServeModel:
    """A served model as KServe v2 sees it; shared by the HTTP and gRPC routes."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.name = served.name

    @property
    def engine(self) -> AsyncLLM:
        return self.served.engine

    def is_ready(self) -> bool:
        return self.served.is_ready()

    def check_version(self, version: str) -> None:
        if version and version not in self.served.versions():
            raise KServeError(
                ErrorCode.NOT_FOUND, f"Request for unknown model: '{self.name}' version {version}"
            )

    def check_ready(self) -> None:
        if not self.is_ready():
            raise KServeError(ErrorCode.UNAVAILABLE, f"model '{self.name}' is not ready")

    def metadata(self) -> dict:
        """KServe model metadata; every input is a one-element tensor, only text_input needed."""
        inputs = [
            {"name": s.name, "datatype": s.datatype, "shape": [-1]} for s in INPUT_SPECS.values()
        ]
        return {
            "name": self.name,
            "versions": self.served.versions(),
            "platform": "lantau",
            "inputs": inputs,
            "outputs": [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        }

    def config(self) -> dict:
        """Triton's model config (model_config.proto field names, as Triton's HTTP shows it):
        lantau's, with the fields of the model's config.pbtxt over it (its tensors stay
        lantau's: they are what the routes take)."""
        inputs = [
            {
                "name": s.name,
                "data_type": CONFIG_TYPES[s.datatype],
                "dims": [-1],
                "optional": s.name != "text_input",
            }
            for s in INPUT_SPECS.values()
        ]
        config = {
            "name": self.name,
            "platform": "",
            "backend": "lantau",
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": 0,  # no batch dimension: one prompt a request
            "input": inputs,
            "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_STRING", "dims": [-1]}],
            # decoupled: a streaming request gets many responses
            "model_transaction_policy": {"decoupled": True},
            "parameters": {"max_model_len": {"string_value": str(self.engine.max_model_len)}},
        }
        given = self.served.config_fields()
        parameters = {**given.get("parameters", {}), **config["parameters"]}
        return {**config, **given, "input": inputs, "output": config["output"],
                "parameters": parameters}  # fmt: skip

    def build_job(
        self, inputs: list[Tensor], parameters: dict, client_id: str = "", version: str = ""
    ) -> InferJob:
        """Validate the tensors (and request parameters standing in for absent ones)."""
        tensors = index_inputs(inputs)
        if "text_input" not in tensors:
            raise invalid("text_input: missing input tensor")
        values = {name: one_value(INPUT_SPECS[name], t) for name, t in tensors.items()}
        for name, spec in INPUT_SPECS.items():  # vLLM-backend style: sampling in parameters
            if name not in values and name in parameters and spec.kind is not list:
                values[name] = convert(name, spec.kind, parameters[name])
        if values.get("bad_words"):
            raise invalid("bad_words: not supported")
        kwargs = {INPUT_SPECS[n].field: v for n, v in values.items() if INPUT_SPECS[n].field}
        kwargs = {**self.engine.sampling_defaults, **kwargs}  # the model's, where absent
        kwargs["structured_outputs"] = guided_spec(values)
        try:
            params = SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise invalid(str(e)) from None
        priority = convert("priority", int, parameters.get("priority", 0))
        if priority > INT64_MAX:
            raise invalid("priority: expected a signed 64-bit integer")
        return InferJob(
            prompt=values["text_input"],
            params=params,
            priority=priority,
            is_stream=values.get("stream", False),
            has_prompt_in_output=not values.get("exclude_input_in_output", True),
            output_shape=list(tensors["text_input"].shape),
            client_id=str(client_id),
            version=version,
        )

    async def outputs(self, job: InferJob) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative outputs, its errors as KServeErrors.

        Leaving this iterator early leaves engine.generate, which aborts the request.
        """
        request_id = new_request_id(job.client_id)
        results = self.served.generate(
            request_id, job.prompt, job.params, job.priority, job.version
        )
        try:
            async for out in results:
                if not job.served_version:
                    job.served_version.append(out.model_version or job.version or MODEL_VERSION)
                yield out
        except InvalidRequestError as e:
            raise invalid(str(e)) from None
        except EngineOverloadedError as e:
            raise KServeError(ErrorCode.RESOURCE_EXHAUSTED, f"server busy: {e}") from None
        except EngineDeadError as e:
            raise KServeError(ErrorCode.UNAVAILABLE, f"engine unavailable: {e}") from None

    async def stream(self, job: InferJob) -> AsyncIterator[tuple[str, bool]]:
        """(text delta, is_final) as tokens arrive; the final one may be empty.

        NOTE: a stop string found later cuts text already produced, so the last
        (longest stop - 1) characters are held back until the request finishes.
        """
        hold = max((len(s) for s in job.params.stop), default=1) - 1
        num_sent = 0
        async with aclosing(self.outputs(job)) as outputs:
            async for out in outputs:
                text = out.outputs[0].text
                end = len(text) if out.finished else max(num_sent, len(text) - hold)
                if end > num_sent or out.finished:
                    yield text[num_sent:end], out.finished
                    num_sent = end

    async def complete(self, job: InferJob) -> str:
        text = ""
        async with aclosing(self.outputs(job)) as outputs:
            async for out in outputs:
                text = out.outputs[0].text
        return job.prompt + text if job.has_prompt_in_output else text


def server_metadata() -> dict:
    return {"name": "lantau", "version": lantau.version(), "extensions": SERVER_EXTENSIONS}


class KServeModels:
    """The router's models as KServe sees them, by name (and version)."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def get(self, name: str, version: str = "") -> KServeModel:
        served = self.router.get(name) if name else None
        if served is None:
            raise KServeError(ErrorCode.NOT_FOUND, f"Request for unknown model: '{name}'")
        model = KServeModel(served)
        model.check_version(version)
        return model


GUIDE_TYPES = {"json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


def guided_spec(values: dict) -> dict | None:
    """TensorRT-LLM's guided decoding tensors as a structured_outputs spec (None: none)."""
    kind, guide = values.get("guided_decoding_guide_type"), values.get("guided_decoding_guide")
    if kind in (None, "", "none"):
        if guide:
            raise invalid("guided_decoding_guide: given without guided_decoding_guide_type")
        return None
    if kind == "json":  # any JSON value
        return {"json": {}}
    if kind not in GUIDE_TYPES:
        raise invalid(f"guided_decoding_guide_type: {kind!r} is not one of json, "
                      f"{', '.join(GUIDE_TYPES)}")  # fmt: skip
    if not guide:
        raise invalid(f"guided_decoding_guide: required with type {kind!r}")
    if kind == "json_schema":
        try:
            return {"json": orjson.loads(guide)}
        except orjson.JSONDecodeError:
            raise invalid("guided_decoding_guide: not a JSON schema") from None
    return {GUIDE_TYPES[kind]: guide}


def index_inputs(inputs: list[Tensor]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for tensor in inputs:
        if tensor.name not in INPUT_SPECS:
            raise invalid(f"unexpected inference input '{tensor.name}'")
        if tensor.name in tensors:
            raise invalid(f"{tensor.name}: given twice")
        tensors[tensor.name] = tensor
    return tensors


def one_value(spec: InputSpec, tensor: Tensor) -> Any:
    """The tensor's value: its one element, or for word lists its non-empty strings."""
    if spec.kind is list:
        words = [convert(spec.name, str, v) for v in tensor.values]
        return [w for w in words if w]  # TRT-LLM clients send [[""]] for "none"
    if len(tensor.values) != 1:
        raise invalid(
            f"{spec.name}: expected one element, got shape {tensor.shape} (one prompt a request)"
        )
    return convert(spec.name, spec.kind, tensor.values[0])


# ---------------------------------------------------------------- HTTP


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code, media_type="application/json")


def error_response(e: KServeError) -> Response:
    response = json_response({"error": str(e)}, e.http_status)
    if e.code is ErrorCode.RESOURCE_EXHAUSTED:
        response.headers["Retry-After"] = "1"
    return response


def decode_json(decoder: msgspec.json.Decoder[T], data: bytes) -> T:
    """The typed body (server/schemas.py), or a 400 naming the bad field."""
    try:
        return decode(decoder, data)
    except InvalidRequestError as e:
        raise invalid(str(e)) from None


def flatten(data: Any) -> list:
    """JSON tensor data may be nested row-major lists; KServe allows both."""
    if not isinstance(data, list):
        return [data]
    values: list = []
    stack = [iter(data)]  # NOTE: a loop, not recursion: JSON may nest deeper than the stack
    while stack:
        item = next(stack[-1], stack)
        if item is stack:  # that list is done
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            values.append(item)
    return values


async def read_body(request: Request, max_bytes: int) -> bytes:
    try:
        return await read_raw_body(request, max_bytes)
    except RequestBodyError as e:
        raise KServeError(ErrorCode.INVALID_ARGUMENT, e.message, http_status=e.status) from None


def split_infer_body(body: bytes, header_length: str | None) -> tuple[InferHeader, bytes]:
    """(JSON header, binary tail): the binary tensor extension puts raw tensors after the JSON."""
    if header_length is None:
        return decode_json(INFER_HEADER_DECODER, body), b""
    # NOTE: isdigit() alone passes "²", which int() refuses
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(body):
        raise invalid(f"Inference-Header-Content-Length {header_length!r} is not in the body")
    size = int(header_length)
    return decode_json(INFER_HEADER_DECODER, body[:size]), body[size:]


def decode_http_inputs(header: InferHeader, binary: bytes) -> list[Tensor]:
    """The request's inputs; binary ones take their `binary_data_size` bytes in order."""
    tensors, offset = [], 0
    for item in header.inputs:
        name, datatype = item.name, item.datatype
        size = item.parameters and item.parameters.binary_data_size
        if size is not None:
            if offset + size > len(binary):
                raise invalid(f"{name}: binary_data_size {size} runs past the body")
            values = decode_raw_tensor(name, datatype, binary[offset : offset + size])
            offset += size
        elif item.data is not None:
            values = flatten(item.data)
            if datatype == "BYTES":  # JSON carries BYTES elements as strings
                values = [v.encode() if isinstance(v, str) else v for v in values]
        else:
            raise invalid(f"{name}: neither data nor binary_data_size")
        tensors.append(check_tensor(Tensor(name, datatype, item.shape, values)))
    if offset != len(binary):
        raise invalid(f"{len(binary) - offset} bytes of binary data belong to no input")
    return tensors


def wants_binary_output(header: InferHeader) -> bool:
    """As tritonclient asks: per requested output, else the request's binary_data_output."""
    is_binary = bool((header.parameters or {}).get("binary_data_output", False))
    for output in header.outputs or ():
        if output.name != OUTPUT_NAME:
            raise invalid(f"unexpected inference output '{output.name}'")
        if output.parameters is not None and output.parameters.binary_data is not None:
            is_binary = output.parameters.binary_data
    return is_binary


def infer_response(model: KServeModel, job: InferJob, text: str, is_binary: bool) -> Response:
    output: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "BYTES", "shape": job.output_shape}
    body: dict[str, Any] = {"model_name": model.name, "model_version": job.model_version}
    if job.client_id:
        body["id"] = job.client_id
    body["outputs"] = [output]
    if not is_binary:
        output["data"] = [text]
        return json_response(body)
    raw = encode_bytes_tensor([text.encode()])
    output["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps(body)
    return Response(
        header + raw,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


def generate_inputs(body: dict) -> list[Tensor]:
    """Triton's generate extension: each top-level field (but `parameters`, `id`) a tensor."""
    tensors = []
    for name, value in body.items():
        if name in ("parameters", "id"):
            continue
        spec = INPUT_SPECS.get(name)
        if spec is None:
            raise invalid(f"unexpected inference input '{name}'")
        values = flatten(value)
        if spec.datatype == "BYTES":
            values = [v.encode() if isinstance(v, str) else v for v in values]
        tensors.append(Tensor(name, spec.datatype, [len(values)], values))
    return tensors


def sse_event(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(request: Request) -> None:
    # NOTE: once the body is read, the ASGI receive() only returns at disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelled if the client leaves first: that aborts it in the engine."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # let it finish cancelling: its cleanup aborts the request
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def make_kserve_router(
    engine: AsyncLLM | ModelRouter,
    model_name: str | None = None,
    is_ready: Callable[[], bool] | None = None,
    *,
    max_body_bytes: int = 64 << 20,
    statistics: Callable[[], list] | None = None,
) -> APIRouter:
    """The KServe v2 HTTP routes for a router's models (or one engine named `model_name`);
    `is_ready` answers the server's readiness probes; `statistics`: the engines' figures
    (server/statistics.py), None with metrics off."""
    from lantau.server.statistics import model_statistics

    router_ = as_router(engine, model_name, is_ready)
    models = KServeModels(router_)
    is_server_ready = is_ready or (lambda: True)
    router = APIRouter()

    async def server_meta() -> Response:
        return json_response(server_metadata())

    async def live() -> Response:
        # a dead or hung engine core cannot come back: let the orchestrator restart the process
        return Response(status_code=200 if router_.is_live() else 503)

    async def ready() -> Response:
        return Response(status_code=200 if is_server_ready() else 503)

    async def model_metadata(name: str, version: str = "") -> Response:
        return json_response(models.get(name, version).metadata())

    async def model_ready(name: str, version: str = "") -> Response:
        return Response(status_code=200 if models.get(name, version).is_ready() else 503)

    async def model_config(name: str, version: str = "") -> Response:
        return json_response(models.get(name, version).config())

    async def infer(name: str, request: Request, version: str = "") -> Response:
        model = models.get(name, version)
        model.check_ready()
        body = await read_body(request, max_body_bytes)
        header, binary = split_infer_body(
            body, request.headers.get("inference-header-content-length")
        )
        inputs = decode_http_inputs(header, binary)
        is_binary = wants_binary_output(header)
        job = model.build_job(inputs, header.parameters or {}, header.id or "", version)
        text = await cancel_on_disconnect(request, model.complete(job))
        return infer_response(model, job, text, is_binary)

    async def parse_generate(
        name: str, request: Request, version: str
    ) -> tuple[KServeModel, InferJob]:
        model = models.get(name, version)
        model.check_ready()
        body = decode_json(OBJECT_DECODER, await read_body(request, max_body_bytes))
        try:
            parameters = convert_field(body.get("parameters"), GenerateParameters, "parameters")
            client_id = convert_field(body.get("id"), str | None, "id")
        except InvalidRequestError as e:
            raise invalid(str(e)) from None
        job = model.build_job(generate_inputs(body), parameters or {}, client_id or "", version)
        return model, job

    def generate_body(model: KServeModel, job: InferJob, text: str) -> dict:
        body = {"model_name": model.name, "model_version": job.model_version, OUTPUT_NAME: text}
        if job.client_id:
            body["id"] = job.client_id
        return body

    async def generate(name: str, request: Request, version: str = "") -> Response:
        model, job = await parse_generate(name, request, version)
        text = await cancel_on_disconnect(request, model.complete(job))
        return json_response(generate_body(model, job, text))

    async def generate_stream(name: str, request: Request, version: str = "") -> Response:
        model, job = await parse_generate(name, request, version)
        deltas = model.stream(job)
        # the first delta before the headers: a bad prompt still gets a plain 400
        try:
            first, _ = await cancel_on_disconnect(request, anext(deltas))
        except BaseException:
            await deltas.aclose()
            raise

        async def events() -> AsyncIterator[bytes]:
            async with aclosing(deltas):
                yield sse_event(generate_body(model, job, first))
                try:
                    async for delta, _ in deltas:
                        yield sse_event(generate_body(model, job, delta))
                except KServeError as e:  # headers are gone: report in the stream
                    yield sse_event({"error": str(e)})
                except Exception:
                    logger.exception("generate_stream failed")
                    yield sse_event({"error": "internal server error"})

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def stats(name: str = "", version: str = "") -> Response:
        return json_response(model_statistics(statistics, name, version))

    routes: list[tuple[str, Callable, str]] = [
        ("/v2", server_meta, "GET"),
        ("/v2/health/live", live, "GET"),
        ("/v2/health/ready", ready, "GET"),
        ("/v2/models/stats", stats, "GET"),  # NOTE: before the model named "stats"
    ]
    # NOTE: `{name:path}` swallows slashes, so the longer patterns must be tried first
    for prefix in ("/v2/models/{name:path}/versions/{version}", "/v2/models/{name:path}"):
        routes += [
            (f"{prefix}/ready", model_ready, "GET"),
            (f"{prefix}/config", model_config, "GET"),
            (f"{prefix}/infer", infer, "POST"),
            (f"{prefix}/generate", generate, "POST"),
            (f"{prefix}/generate_stream", generate_stream, "POST"),
            (f"{prefix}/stats", stats, "GET"),
        ]
    routes += [
        ("/v2/models/{name:path}/versions/{version}", model_metadata, "GET"),
        ("/v2/models/{name:path}", model_metadata, "GET"),
    ]
    for path, endpoint, method in routes:
        router.add_api_route(path, with_kserve_errors(endpoint), methods=[method])
    return router


def with_kserve_errors(endpoint: Callable[..., Awaitable[Response]]) -> Callable:
    """KServeError → its status and `{"error": ...}`; anything else is a bug, logged as one."""

    @functools.wraps(endpoint)  # FastAPI reads the parameters through __wrapped__
    async def wrapped(**kwargs) -> Response:
        try:
            return await endpoint(**kwargs)
        except KServeError as e:
            return error_response(e)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        except Exception:
            logger.exception("KServe route %s failed", endpoint.__name__)
            return json_response({"error": "internal server error"}, 500)

    return wrapped
