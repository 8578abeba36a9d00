"""Typed request bodies: msgspec Structs decoded straight from the body bytes.

Every field a route reads is declared here with its JSON type and 64-bit bounds, so a wrong
type at any depth, an integer past 64 bits or a float where a count belongs is a 400 naming the
field (`messages[0].content[1].text: expected a string or null, got an integer`), never a 500.
Ranges that the offline API shares (temperature >= 0, finite numbers, ...) stay in
SamplingParams; limits a server sets (`max_n`, `max_logprobs`) are checked by the routes.
Unknown fields are ignored, as OpenAI clients send many; the known ones this server does not
do (tools, guided decoding, images, audio, suffix, best_of) are declared so that the routes
refuse them rather than answer as if they had been followed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from lantau.errors import InvalidRequestError
from lantau.request import INT64_MAX, INT64_MIN

T = TypeVar("T")

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # the engine checks it against the vocab
Seconds = Annotated[float, Meta(gt=0)]

# OpenAI's own bounds on logprobs; a server's --max-logprobs may lower them
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of a server (`lantau serve --max-n / --max-logprobs`)."""

    max_n: int = 128
    max_logprobs: int = 20
    # a request's own `chat_template` (vLLM's --trust-request-chat-template): off, a client's
    # Jinja never runs here
    trust_request_chat_template: bool = False
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating):
    # off, a client cannot make the server read a path of its choosing
    allow_runtime_lora_updating: bool = False


# ---------------------------------------------------------------- OpenAI


class StreamOptions(Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far in every chunk


class ContentPart(Struct):
    type: str  # only "text": the models served read text (an image is a 400, not dropped)
    text: str | None = None


class JsonSchemaFormat(Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: str  # text, json_object, or json_schema (lantau/structured.py)
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(Struct):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON object as text


class MessageToolCall(Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None  # null: an assistant's tool calls only
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, earlier
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class FunctionSpec(Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema, for the template


class ToolSpec(Struct):
    function: FunctionSpec
    type: str = "function"


class OpenAIRequest(Struct):
    """The fields both OpenAI routes share (with vLLM's extras: top_k, min_p, ...); null means
    the default, as if the field were absent."""

    model: str | None = None
    n: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: Int64 | None = None
    timeout: Seconds | None = None
    # token id (a JSON object's keys are strings: "50256") -> bias; the range is checked by
    # SamplingParams, the vocabulary by the engine
    logit_bias: dict[TokenId, float] | None = None
    cache_salt: str | None = None  # vLLM's: prefixes shared only within the same salt
    response_format: ResponseFormat | None = None
    # vLLM's: {"json": schema} | {"json_object": true} | {"regex": ...} | {"choice": [...]} |
    # {"grammar": lark}; and its older guided_* fields, one each
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(OpenAIRequest):
    # a string, token ids, or a batch of either
    prompt: str | list[str | TokenId | list[TokenId]] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = None  # the prompt's text before each choice's
    suffix: str | None = None
    best_of: PositiveInt | None = None


class ChatRequest(OpenAIRequest):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    # read only to refuse what this server does not do (openai_api.refuse_unsupported)
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    # vLLM's: how the template renders the conversation
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None  # the last (assistant) message continued
    chat_template_kwargs: dict[str, Any] | None = None  # more of the template's variables
    chat_template: str | None = None  # the request's own (--trust-request-chat-template)


class TokenizeRequest(Struct):
    """vLLM's /tokenize: a text (`prompt`) or a conversation (`messages`, through the chat
    template with its tools)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None  # the request's own (--trust-request-chat-template)
    return_token_strs: bool | None = None


class DetokenizeRequest(Struct):
    tokens: list[TokenId]
    model: str | None = None


class LoraAdapterRequest(Struct):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter body."""

    lora_name: str
    lora_path: str | None = None  # load: the adapter's PEFT folder on the server


# ---------------------------------------------------------------- OpenAI Responses


class ResponseContent(Struct):
    type: str  # input_text, or output_text / refusal in an assistant's earlier turn
    text: str | None = None
    refusal: str | None = None


class ResponseInputItem(Struct):
    """An input item: a message (role and content; `type` "message" or absent), an earlier
    `function_call` of the model's, or a tool's `function_call_output`."""

    type: str | None = None
    role: str | None = None
    content: str | list[ResponseContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponseContent] | None = None
    id: str | None = None
    status: str | None = None


class ResponseTool(Struct):
    type: str  # only "function": OpenAI's hosted tools are not this server's
    name: Annotated[str, Meta(min_length=1)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextFormat(Struct):
    type: str  # text, json_object, or json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseText(Struct):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Struct):
    """POST /v1/responses (lantau/server/responses_api.py): what it serves, and the fields it
    refuses by name rather than ignore."""

    input: str | Annotated[list[ResponseInputItem], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # nothing is stored: the response says so
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache is automatic
    cache_salt: str | None = None  # vLLM's: prefixes shared only within the same salt
    timeout: Seconds | None = None
    # refused when set (responses_api.REFUSED)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


# ---------------------------------------------------------------- KServe v2 HTTP

Scalar = bool | int | float | str  # KServe parameter values


class TensorParameters(Struct):
    binary_data_size: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    binary_data: bool | None = None


class InferInputTensor(Struct):
    name: str
    datatype: str
    shape: list[Annotated[int, Meta(ge=0, le=INT64_MAX)]]
    data: Any = None  # nested row-major lists of scalars; None: binary_data_size says where
    parameters: TensorParameters | None = None


class InferOutputTensor(Struct):
    name: str
    parameters: TensorParameters | None = None


class InferHeader(Struct):
    """An infer request's JSON (the header, with the binary tensor extension)."""

    inputs: list[InferInputTensor]
    outputs: list[InferOutputTensor] | None = None
    id: str | None = None
    parameters: dict[str, Scalar] | None = None


# ---------------------------------------------------------------- decoding

COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_DECODER = msgspec.json.Decoder(DetokenizeRequest)
LORA_ADAPTER_DECODER = msgspec.json.Decoder(LoraAdapterRequest)
CHAT_DECODER = msgspec.json.Decoder(ChatRequest)
RESPONSES_DECODER = msgspec.json.Decoder(ResponsesRequest)
INFER_HEADER_DECODER = msgspec.json.Decoder(InferHeader)
OBJECT_DECODER = msgspec.json.Decoder(dict[str, Any])


def decode(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    """The typed request, or InvalidRequestError naming the field ("body" for the whole)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise invalid_from(e) from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError("body", f"malformed JSON: {e}") from None
    except RecursionError:  # msgspec recurses once per nesting level
        raise InvalidRequestError("body", "nested too deeply") from None


def convert(value: Any, kind: type[T], field: str) -> T:
    """A decoded value as `kind` (the same rules as `decode`), errors under `field`."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise invalid_from(e, field) from None


_LOCATED = re.compile(
    r"^(?P<message>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL
)
_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]*)`$")
_TYPES = re.compile(r"`([^`]*)`")
JSON_TYPES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "an object",
    "bytes": "bytes",
}


def invalid_from(e: msgspec.ValidationError, prefix: str = "") -> InvalidRequestError:
    """msgspec's "Expected `int`, got `str` - at `$.a[0].b`" as field `a[0].b` and
    "expected an integer, got a string"."""
    match = _LOCATED.match(str(e))
    assert match is not None  # the pattern matches any text
    path = prefix + (match["path"] or "")
    message = match["message"] + (" (in a key)" if match["key"] else "")
    if named := _FIELD.match(message):  # the message names a field inside `path`
        path = f"{path}.{named['name']}"
        message = "required" if "missing" in message else "unknown field"
    message = _TYPES.sub(lambda m: " or ".join(_type_name(t) for t in m[1].split(" | ")), message)
    return InvalidRequestError(path.lstrip(".") or "body", message[:1].lower() + message[1:])


def _type_name(name: str) -> str:
    return JSON_TYPES.get(name, name)


def json_kind(value: Any) -> str:
    """A Python value's JSON type, in words: "an integer", "null", ..."""
    for kind, name in (
        (type(None), "null"),
        (bool, "bool"),
        (int, "int"),
        (float, "float"),
        (str, "str"),
        (bytes, "bytes"),
        (list | tuple, "array"),
        (dict, "object"),
    ):
        if isinstance(value, kind):
            return JSON_TYPES[name]
    return type(value).__name__
