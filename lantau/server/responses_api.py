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
from collections.abc import AsyncIterator, Iterator
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
    "reasoning": "no reasoning effort or summary is served (a reasoning model thinks as it does)",
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
        cache_salt=body.cache_salt,
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
        reply.reasoning_parser = server.reasoning_parser
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
        self.reasoning_id = "rs_" + self.id.removeprefix("resp-")

    def response(self, final: RequestOutput | None, status: str | None = None) -> dict:
        """The Response object (`final` None: in progress, no output yet)."""
        body, params = self.body, self.reply.params
        output, usage, incomplete = [], None, None
        if final is not None:
            o = final.outputs[0]
            reasoning, content, calls = self.reply.answer(o)
            if reasoning is not None:
                output.append(self.reasoning_item(reasoning, "completed"))
            if content or (not calls and reasoning is None):
                output.append(self.message(content or "", o.finish_reason))
            output += [self.call_item(call, k) for k, call in enumerate(calls)]
            if o.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            usage = {
                "input_tokens": len(final.prompt_token_ids),
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": len(o.token_ids),
                "output_tokens_details": {
                    "reasoning_tokens": self.reasoning_tokens(o, reasoning, content)
                },
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

    def reasoning_tokens(self, o, reasoning: str | None, content: str | None) -> int:
        """The output tokens spent thinking: up to the end-of-thinking token where it is one
        (DeepSeek-R1's), else as many as the thinking's text encodes to."""
        tokenizer = self.reply.tokenizer
        if reasoning is None:
            return 0
        if content is None or tokenizer is None:
            return len(o.token_ids) if content is None else 0
        end = tokenizer.encode(self.reply.reasoning_parser.end, add_special_tokens=False)
        if len(end) == 1 and end[0] in o.token_ids:
            return o.token_ids.index(end[0]) + 1
        return min(len(o.token_ids), len(tokenizer.encode(reasoning, add_special_tokens=False)))

    def reasoning_item(self, text: str, status: str) -> dict:
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {
            "type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
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
        """The events OpenAI streams: created, in progress, the items as they come (a
        reasoning model's thinking first, then the message, its text deltas held back near a
        stop string, a half-written end of thinking and where a tool call may start), each
        function call, then completed (or incomplete)."""
        numbers = itertools.count()
        reply = self.reply
        hold = _held_back(reply.params)
        parser, thinking = reply.tool_parser, reply.reasoning_parser
        indices: dict[str, int] = {}  # item id -> its output_index, as items open
        closed: set[str] = set()

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

        def where(item_id: str) -> dict:
            return {"item_id": item_id, "output_index": indices[item_id], "content_index": 0}

        def open_reasoning() -> Iterator[bytes]:
            if self.reasoning_id not in indices:
                indices[self.reasoning_id] = len(indices)
                item = self.reasoning_item("", "in_progress")
                yield event("response.output_item.added", output_index=len(indices) - 1,
                            item=item)  # fmt: skip

        def close_reasoning(text: str) -> Iterator[bytes]:
            if self.reasoning_id in indices and self.reasoning_id not in closed:
                closed.add(self.reasoning_id)
                rid = self.reasoning_id
                yield event("response.reasoning_text.done", **where(rid), text=text)
                yield event("response.output_item.done", output_index=indices[rid],
                            item=self.reasoning_item(text, "completed"))  # fmt: skip

        def open_message() -> Iterator[bytes]:
            if self.message_id not in indices:
                indices[self.message_id] = len(indices)
                yield event("response.output_item.added", output_index=len(indices) - 1,
                            item=self.message("", None))  # fmt: skip
                yield event("response.content_part.added", **where(self.message_id),
                            part=self.text_part(""))  # fmt: skip

        started = self.response(None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        sent, sent_thinking, last = 0, 0, None
        try:
            async with asyncio.timeout_at(deadline):
                async for output in results:
                    last, o = output, output.outputs[0]
                    if o.finish_reason is not None:
                        break
                    text, reasoning = o.text, None
                    if thinking is not None:
                        split = thinking.split(o.text, final=False)
                        text, reasoning = split.content, split.reasoning
                    if reasoning is not None:
                        end = len(reasoning) if text is not None else len(reasoning) - hold
                        if end > sent_thinking:
                            for chunk in open_reasoning():
                                yield chunk
                            yield event("response.reasoning_text.delta",
                                        **where(self.reasoning_id),
                                        delta=reasoning[sent_thinking:end])  # fmt: skip
                            sent_thinking = end
                        if text is not None:
                            for chunk in close_reasoning(reasoning):
                                yield chunk
                    if text is None:
                        continue
                    end = len(text) - hold
                    if parser is not None:
                        end = min(end, parser.streamable(text))
                    if end > sent:
                        for chunk in open_message():
                            yield chunk
                        yield event("response.output_text.delta", **where(self.message_id),
                                    delta=text[sent:end], logprobs=[])  # fmt: skip
                        sent = end
        except Exception as e:  # the stream has started: report in-band, then end it
            error = orjson.loads(_error_for(e).body)["error"]
            yield event("error", code=str(error["code"]), message=error["message"],
                        param=error["param"])  # fmt: skip
            return
        finally:
            await results.aclose()
        o = last.outputs[0]
        reasoning, content, calls = reply.answer(o)
        if reasoning is not None:
            for chunk in open_reasoning():
                yield chunk
            if len(reasoning) > sent_thinking:
                yield event("response.reasoning_text.delta", **where(self.reasoning_id),
                            delta=reasoning[sent_thinking:])  # fmt: skip
            for chunk in close_reasoning(reasoning):
                yield chunk
        if content or (not calls and reasoning is None):
            content = content or ""
            for chunk in open_message():
                yield chunk
            mid = self.message_id
            if len(content) > sent:
                yield event("response.output_text.delta", **where(mid), delta=content[sent:],
                            logprobs=[])  # fmt: skip
            yield event("response.output_text.done", **where(mid), text=content, logprobs=[])
            yield event("response.content_part.done", **where(mid), part=self.text_part(content))
            yield event("response.output_item.done", output_index=indices[mid],
                        item=self.message(content, o.finish_reason))  # fmt: skip
        for k, call in enumerate(calls):
            index = len(indices)
            item_id = self.call_item(call, k)["id"]
            indices[item_id] = index
            yield event("response.output_item.added", output_index=index,
                        item=self.call_item(call, k, arguments=""))  # fmt: skip
            yield event("response.function_call_arguments.delta", item_id=item_id,
                        output_index=index, delta=call.arguments)  # fmt: skip
            yield event("response.function_call_arguments.done", item_id=item_id,
                        output_index=index, arguments=call.arguments)  # fmt: skip
            yield event("response.output_item.done", output_index=index,
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
