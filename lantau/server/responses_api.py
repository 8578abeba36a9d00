"""OpenAI's Responses API (`POST /v1/responses`, the official client's `responses.create`):
a request becomes the chat conversation it describes and runs through the chat route's own
checks (sampling, template, tools, structured outputs), then answers as a Response: output
items (an assistant message of output_text, function calls), usage, and `incomplete` when
max_output_tokens cut it; streamed as the typed events the client reads.

Nothing is stored (`store` has no effect, a stored response cannot be fetched): what needs
storage (`previous_response_id`, `conversation`, `background`) and OpenAI's hosted tools and
reasoning are refused by name, never quietly ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from lantau.errors import InvalidRequestError
from lantau.outputs import RequestOutput
from lantau.server.observability import engine_request_id
from lantau.server.openai_api import (
    APIError,
    Reply,
    _deadline,
    _error_for,
    _first,
    _held_back,
    error_response,
    read_body,
    respond,
    sampling_params_from,
)
from lantau.server.schemas import (
    RESPONSES_DECODER,
    ChatMessage,
    ChatRequest,
    FunctionCall,
    FunctionSpec,
    JsonSchemaFormat,
    MessageToolCall,
    ResponseContent,
    ResponseFormat,
    ResponsesRequest,
    ToolSpec,
    decode,
)
from lantau.server.tool_calls import ToolCall

if TYPE_CHECKING:
    from lantau.server.openai_api import OpenAIServer

# fields that need what this server does not keep or run, refused when set
REFUSED = {
    "previous_response_id": "responses are not stored here: send the whole conversation as input",
    "conversation": "conversations are not stored here: send the whole conversation as input",
    "background": "background responses are not served",
    "prompt": "stored prompts are not served",
    "include": "no extra output data is served",
    "reasoning": "the served models do not reason",
    "top_logprobs": "not served on this route (use /v1/chat/completions)",
    "max_tool_calls": "only function tools are served, which the client runs",
}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# chat fields the conversion's checks name -> the Responses fields they came from
FIELD_OF = {  # the longest first
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "tool_choice.function.name": "tool_choice.name",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


def refuse_unserved(body: ResponsesRequest) -> None:
    for name, why in REFUSED.items():
        value = getattr(body, name)
        if isinstance(value, dict):  # {"effort": null}: nothing asked
            value = {k: v for k, v in value.items() if v is not None}
        if value not in (None, False, [], {}):
            raise InvalidRequestError(name, why)
    if body.truncation not in (None, "disabled"):
        raise InvalidRequestError("truncation", "only disabled: a prompt too long is a 400")


def _text(content: str | list[ResponseContent] | None, where: str) -> str | None:
    """A message's content as text (input_text / output_text parts joined)."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text"):
            parts.append(part.text or "")
        elif part.type == "refusal":
            parts.append(part.refusal or "")
        else:
            raise InvalidRequestError(
                f"{where}[{j}].type", f"{part.type!r} is not supported: the served models read text"
            )
    return "".join(parts)


def conversation_of(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages the request's instructions and input describe: an earlier
    function_call joins the assistant turn before it, a function_call_output is a tool's
    message."""
    messages = [ChatMessage("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, ChatMessage("user", body.input)]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in ROLES:
                raise InvalidRequestError(
                    f"{where}.role", f"expected one of {', '.join(ROLES)}, got {item.role!r}"
                )
            text = _text(item.content, f"{where}.content")
            if text is None:
                raise InvalidRequestError(f"{where}.content", "required")
            messages.append(ChatMessage(ROLES[item.role], text))
        elif kind == "function_call":
            if not item.name or item.arguments is None or not item.call_id:
                raise InvalidRequestError(where, "a function_call needs call_id, name, arguments")
            call = MessageToolCall(FunctionCall(item.name, item.arguments), item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same turn's
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage("assistant", None, [call]))
        elif kind == "function_call_output":
            output = _text(item.output, f"{where}.output")
            if not item.call_id or output is None:
                raise InvalidRequestError(where, "a function_call_output needs call_id and output")
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
        else:
            raise InvalidRequestError(f"{where}.type", f"{kind!r} is not supported")
    if not messages:
        raise InvalidRequestError("input", "no message")
    return messages


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat completion request that asks for the same answer."""
    tools = None
    if body.tools:
        tools = []
        for k, tool in enumerate(body.tools):
            if tool.type != "function":
                raise InvalidRequestError(
                    f"tools[{k}].type", f"{tool.type!r} is not served: only function tools"
                )
            if not tool.name:
                raise InvalidRequestError(f"tools[{k}].name", "required")
            tools.append(ToolSpec(FunctionSpec(tool.name, tool.description, tool.parameters)))
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError(
                "tool_choice", 'expected auto, none, required or {"type": "function", "name"}'
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "auto", "none", "required"):
        raise InvalidRequestError("tool_choice", f"{choice!r} is not auto, none or required")
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema":
            schema = JsonSchemaFormat(fmt.name, fmt.schema, fmt.strict, fmt.description)
            response_format = ResponseFormat("json_schema", schema)
        else:
            response_format = ResponseFormat(fmt.type)
    return ChatRequest(
        model=body.model,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        timeout=body.timeout,
        response_format=response_format,
        messages=conversation_of(body),
        tools=tools,
        tool_choice=choice,
    )


def _renamed(e: InvalidRequestError) -> InvalidRequestError:
    """A chat check's error under the Responses field the value came from."""
    field = e.field or ""
    for chat, responses in FIELD_OF.items():
        if field == chat or field.startswith((chat + ".", chat + "[")):
            return InvalidRequestError(responses + field[len(chat) :], str(e).split(": ", 1)[-1])
    return e


class ResponsesServer:
    """The route, on the OpenAI server's models, limits and tool parser."""

    def __init__(self, openai: OpenAIServer) -> None:
        self.openai = openai

    async def create(self, request: Request) -> Response:
        server = self.openai
        try:
            raw = await read_body(request, server.max_body_bytes)
            body = decode(RESPONSES_DECODER, raw)
            refuse_unserved(body)
            served = server.get_model(body.model)
            engine = served.engine
            try:
                chat = chat_request(body)
                params = sampling_params_from(chat, engine.sampling_defaults)
                conversation, tools, params = server.chat_inputs(chat, engine, params)
            except InvalidRequestError as e:
                raise _renamed(e) from None
            ids = await engine.encode_chat(conversation, tools)
            deadline = _deadline(body.timeout, request.headers.get("x-request-timeout"))
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        request_id = engine_request_id("resp")
        results = served.generate(request_id, {"prompt_token_ids": ids}, params)
        reply = Reply(request_id, served.name, engine.tokenizer, True, params)
        if tools:
            reply.tool_parser = server.tool_parser
            reply.tool_names = {t["function"]["name"] for t in tools}
        answer = Answer(reply, body, int(time.time()))

        def events(results: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
            return answer.stream(results, deadline)

        streamed = events if _first(body.stream, False) else None
        return await respond(results, reply, request, deadline, streamed, answer.response)


class Answer:
    """One response's objects: the Response and its output items, whole or as events."""

    def __init__(self, reply: Reply, body: ResponsesRequest, created: int) -> None:
        self.reply, self.body, self.created = reply, body, created
        self.id = reply.request_id
        self.message_id = "msg_" + self.id.removeprefix("resp-")

    def response(self, final: RequestOutput | None, status: str | None = None) -> dict:
        """The Response object (`final` None: in progress, no output yet)."""
        body, params = self.body, self.reply.params
        output, usage, incomplete = [], None, None
        if final is not None:
            o = final.outputs[0]
            content, calls = self.reply.tool_calls(o)
            if content or not calls:
                output.append(self.message(content, o.finish_reason))
            output += [self.call_item(call, k) for k, call in enumerate(calls)]
            if o.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            usage = {
                "input_tokens": len(final.prompt_token_ids),
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": len(o.token_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(final.prompt_token_ids) + len(o.token_ids),
            }
        if status is None:
            status = "in_progress" if final is None else "incomplete" if incomplete else "completed"
        fmt = body.text.format if body.text is not None and body.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.reply.model_name,
            "output": output,
            "usage": usage,
            "incomplete_details": incomplete,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": _first(body.parallel_tool_calls, True),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tool_choice": _first(body.tool_choice, "auto"),
            "tools": [_builtins(t) for t in body.tools or ()],
            "text": {"format": _builtins(fmt) if fmt else {"type": "text"}},
            "truncation": "disabled",
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "user": body.user,
            **self.reply.fingerprint(),
        }

    def message(self, text: str, finish_reason: str | None) -> dict:
        status = "in_progress" if finish_reason is None else (
            "incomplete" if finish_reason == "length" else "completed"
        )  # fmt: skip
        content = [self.text_part(text)] if finish_reason is not None or text else []
        return {
            "type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": content,
        }  # fmt: skip

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def call_item(self, call: ToolCall, k: int, arguments: str | None = None) -> dict:
        return {
            "type": "function_call", "id": f"fc_{self.id.removeprefix('resp-')}_{k}",
            "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress",
        }  # fmt: skip

    async def stream(
        self, results: AsyncIterator[RequestOutput], deadline: float | None
    ) -> AsyncIterator[bytes]:
        """The events OpenAI streams: created, in progress, the message item and its text
        deltas (held back near a stop string, and where a tool call may start), each function
        call, then completed (or incomplete)."""
        numbers = itertools.count()
        reply = self.reply
        hold = _held_back(reply.params)
        parser = reply.tool_parser
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

        started = self.response(None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        sent, opened, last = 0, False, None

        def open_message() -> list[bytes]:
            return [
                event(
                    "response.output_item.added", output_index=0, item=self.message("", None)
                ),  # fmt: skip
                event("response.content_part.added", **ids, part=self.text_part("")),
            ]

        try:
            async with asyncio.timeout_at(deadline):
                async for output in results:
                    last, o = output, output.outputs[0]
                    if o.finish_reason is not None:
                        break
                    end = len(o.text) - hold
                    if parser is not None:
                        end = min(end, parser.streamable(o.text))
                    if end > sent:
                        if not opened:
                            opened = True
                            for chunk in open_message():
                                yield chunk
                        yield event("response.output_text.delta", **ids,
                                    delta=o.text[sent:end], logprobs=[])  # fmt: skip
                        sent = end
        except Exception as e:  # the stream has started: report in-band, then end it
            error = orjson.loads(_error_for(e).body)["error"]
            yield event("error", code=str(error["code"]), message=error["message"],
                        param=error["param"])  # fmt: skip
            return
        finally:
            await results.aclose()
        o = last.outputs[0]
        content, calls = reply.tool_calls(o)
        index = 0
        if content or not calls:
            if not opened:
                for chunk in open_message():
                    yield chunk
            if len(content) > sent:
                yield event("response.output_text.delta", **ids, delta=content[sent:],
                            logprobs=[])  # fmt: skip
            part = self.text_part(content)
            yield event("response.output_text.done", **ids, text=content, logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
            yield event("response.output_item.done", output_index=0,
                        item=self.message(content, o.finish_reason))  # fmt: skip
            index = 1
        for k, call in enumerate(calls):
            item_id = self.call_item(call, k)["id"]
            yield event("response.output_item.added", output_index=index + k,
                        item=self.call_item(call, k, arguments=""))  # fmt: skip
            yield event("response.function_call_arguments.delta", item_id=item_id,
                        output_index=index + k, delta=call.arguments)  # fmt: skip
            yield event("response.function_call_arguments.done", item_id=item_id,
                        output_index=index + k, arguments=call.arguments)  # fmt: skip
            yield event("response.output_item.done", output_index=index + k,
                        item=self.call_item(call, k))  # fmt: skip
        final = self.response(last)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)


def _builtins(struct) -> dict:
    import msgspec

    return {k: v for k, v in msgspec.to_builtins(struct).items() if v is not None}


def not_stored(response_id: str) -> Response:
    """GET /v1/responses/{id}: nothing is stored here."""
    return error_response(
        404, f"response {response_id!r} not found: this server stores no responses",
        "response_id", "NotFoundError",
    )  # fmt: skip
