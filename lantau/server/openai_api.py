"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming).

Request bodies are decoded from their bytes into msgspec Structs (server/schemas.py), then into
SamplingParams: no pydantic on the hot path; a malformed field is a 400 naming it. Streamed
chunks are pre-encoded bytes. Errors have OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

import lantau
from lantau.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from lantau.errors import InvalidRequestError
from lantau.outputs import RequestOutput
from lantau.request import SamplingParams
from lantau.server.body import RequestBodyError
from lantau.server.body import read_body as read_raw_body
from lantau.server.models import ModelRouter, ServedModel, as_router
from lantau.server.observability import engine_request_id
from lantau.server.reasoning import ReasoningParser
from lantau.server.schemas import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    DETOKENIZE_DECODER,
    LORA_ADAPTER_DECODER,
    TOKENIZE_DECODER,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    TokenizeRequest,
    decode,
)
from lantau.server.tool_calls import ToolCall, ToolParser


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_response(status: int, message: str, param: str | None = None, kind: str = "") -> Response:
    err = APIError(status, message, param, kind)
    body = {"error": {"message": message, "type": err.kind, "param": param, "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def json_response(body: dict) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def read_body(request: Request, max_bytes: int) -> bytes:
    try:
        return await read_raw_body(request, max_bytes)
    except RequestBodyError as e:
        raise APIError(e.status, e.message) from None


def parse_request(
    raw: bytes, *, chat: bool, limits: RequestLimits
) -> ChatRequest | CompletionRequest:
    """The body as a typed request within the server's limits, or InvalidRequestError
    naming the field."""
    body = decode(CHAT_DECODER if chat else COMPLETION_DECODER, raw)
    if body.n is not None and body.n > limits.max_n:
        raise InvalidRequestError("n", f"must be <= {limits.max_n} on this server (--max-n)")
    if chat:
        name, num_logprobs = "top_logprobs", body.top_logprobs
    else:
        name, num_logprobs = "logprobs", body.logprobs
    for field, num in ((name, num_logprobs), ("prompt_logprobs", body.prompt_logprobs)):
        if num is not None and num > limits.max_logprobs:
            raise InvalidRequestError(
                field, f"must be <= {limits.max_logprobs} on this server (--max-logprobs)"
            )
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequestError("prompt_logprobs", "not with stream")
    if chat:
        check_request_template(body, limits)
    refuse_unsupported(body)
    return body


def check_request_template(body: ChatRequest | TokenizeRequest, limits: RequestLimits) -> None:
    """A request's own chat template runs only where the server trusts them."""
    if body.chat_template is not None and not limits.trust_request_chat_template:
        raise InvalidRequestError(
            "chat_template",
            "this server does not take request templates (lantau serve "
            "--trust-request-chat-template)",
        )


def refuse_unsupported(body: ChatRequest | CompletionRequest) -> None:
    """InvalidRequestError for an OpenAI feature this server does not do, asked for: an
    answer that ignored it (plain text where JSON or a tool call was asked) would look right
    and be wrong."""
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise InvalidRequestError("suffix", "is not supported (no insertion)")
        if body.best_of is not None and body.best_of > _first(body.n, 1):
            raise InvalidRequestError("best_of", "is not supported beyond n")
        return
    if body.functions:
        raise InvalidRequestError("functions", "the legacy functions are not supported: use tools")
    if body.function_call not in (None, "none", "auto"):
        raise InvalidRequestError("function_call", "the legacy functions are not supported")
    choice = body.tool_choice
    named = isinstance(choice, dict) and choice.get("type", "function") == "function"
    if choice not in (None, "none", "auto", "required") and not (
        named and isinstance((choice.get("function") or {}).get("name"), str)
    ):
        raise InvalidRequestError(
            "tool_choice", "expected none, auto, required or {type: function, function: {name}}"
        )
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise InvalidRequestError("modalities", "only 'text' is supported")
    if body.audio is not None:
        raise InvalidRequestError("audio", "audio output is not supported")


# apply_chat_template's own arguments: not a template variable a request may set
TEMPLATE_ARGUMENTS = frozenset(
    ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
)  # fmt: skip


def template_options(body: ChatRequest) -> dict:
    """vLLM's chat extras as AsyncLLM.encode_chat takes them."""
    cont = _first(body.continue_final_message, False)
    generation = _first(body.add_generation_prompt, not cont)
    if cont and generation:
        raise InvalidRequestError(
            "continue_final_message", "cannot go with add_generation_prompt: set it false"
        )
    if cont and body.messages and body.messages[-1].role != "assistant":
        raise InvalidRequestError(
            "continue_final_message", "the last message is not the assistant's"
        )
    extra = body.chat_template_kwargs or {}
    if taken := sorted(TEMPLATE_ARGUMENTS & set(extra)):
        raise InvalidRequestError(
            "chat_template_kwargs", f"{', '.join(taken)}: not a template variable"
        )
    return {
        "add_generation_prompt": generation, "continue_final_message": cont, "extra": extra,
        "chat_template": body.chat_template,
    }  # fmt: skip


def _template_call(call, field: str) -> dict:
    """An earlier tool call as chat templates take it: its arguments an object."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            raise InvalidRequestError(f"{field}.function.arguments", "not a JSON object") from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def _first(*values: Any) -> Any:
    """The first value that is not None (null in a body means "the default")."""
    return next(v for v in values if v is not None)


def sampling_params_from(
    body: ChatRequest | CompletionRequest, defaults: dict | None = None
) -> SamplingParams:
    """OpenAI fields, logit_bias too (plus vLLM's extras: top_k, min_p, repetition_penalty,
    ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens); what the body
    leaves out is the model's default (`defaults`: its generation_config.json's), then
    OpenAI's. InvalidRequestError names a field out of range."""
    defaults = defaults or {}
    prompt_logprobs = body.prompt_logprobs  # vLLM's
    if isinstance(body, ChatRequest):
        # NOTE: max_completion_tokens replaces max_tokens; 0 is refused by the schema
        max_tokens = _first(
            body.max_completion_tokens, body.max_tokens, defaults.get("max_tokens"), 512
        )
        logprobs = _first(body.top_logprobs, 0) if body.logprobs else None
    else:
        max_tokens = _first(body.max_tokens, defaults.get("max_tokens"), 16)
        logprobs = body.logprobs
        if body.echo and logprobs is not None:  # the echoed prompt's logprobs too
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    structured, field = structured_spec(body)
    try:
        return _sampling_params(body, max_tokens, logprobs, prompt_logprobs, structured, defaults)
    except InvalidRequestError as e:
        if e.field == "structured_outputs" and field != e.field:  # as the request named it
            raise InvalidRequestError(field, str(e).split(": ", 1)[-1]) from None
        raise


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip


def structured_spec(body: ChatRequest | CompletionRequest) -> tuple[dict | None, str]:
    """The grammar a request asks its output to follow (lantau/structured.py's spec), and the
    field that asked: response_format (OpenAI's), structured_outputs or a guided_* (vLLM's)."""
    asked = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(({"json_object": True}, "response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise InvalidRequestError("response_format.json_schema.schema", "required")
            asked.append(({"json": rf.json_schema.schema}, "response_format"))
        else:
            raise InvalidRequestError(
                "response_format.type", "expected text, json_object or json_schema"
            )
    if body.structured_outputs is not None:
        asked.append((body.structured_outputs, "structured_outputs"))
    for name, kind in GUIDED.items():
        if (value := getattr(body, name)) is not None:
            asked.append(({kind: value}, name))
    if len(asked) > 1:
        raise InvalidRequestError(asked[1][1], f"asks for a grammar beside {asked[0][1]}'s")
    return asked[0] if asked else (None, "structured_outputs")


def _sampling_params(
    body: ChatRequest | CompletionRequest,
    max_tokens: int,
    logprobs,
    prompt_logprobs,
    structured,
    defaults: dict,
) -> SamplingParams:
    d = defaults.get
    return SamplingParams(
        structured_outputs=structured,
        n=_first(body.n, 1),
        max_tokens=max_tokens,
        temperature=_first(body.temperature, d("temperature"), 1.0),
        top_p=_first(body.top_p, d("top_p"), 1.0),
        top_k=_first(body.top_k, d("top_k"), 0),
        min_p=_first(body.min_p, d("min_p"), 0.0),
        repetition_penalty=_first(body.repetition_penalty, d("repetition_penalty"), 1.0),
        presence_penalty=_first(body.presence_penalty, 0.0),
        frequency_penalty=_first(body.frequency_penalty, 0.0),
        seed=body.seed,
        stop=_first(body.stop, ()),
        stop_token_ids=_first(body.stop_token_ids, ()),
        ignore_eos=_first(body.ignore_eos, False),
        min_tokens=_first(body.min_tokens, 0),
        include_stop_str_in_output=_first(body.include_stop_str_in_output, False),
        skip_special_tokens=_first(body.skip_special_tokens, True),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=body.logit_bias,
        cache_salt=body.cache_salt,
    )


def _logprobs_chat(token_ids, entries, tokenizer, num_top: int) -> dict:
    """OpenAI's chat logprobs of these tokens: each one's logprob and its `num_top` most
    likely rivals."""

    def piece(t: int) -> dict:
        text = tokenizer.decode([t]) if tokenizer is not None else str(t)
        return {"token": text, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
        content.append(
            {
                **piece(token_id),
                "logprob": entry[token_id].logprob,
                "top_logprobs": [{**piece(t), "logprob": lp.logprob} for t, lp in top],
            }
        )
    return {"content": content}


def _logprobs_completion(token_ids, entries, tokenizer, num_top: int, offset: int = 0) -> dict:
    """OpenAI's legacy completions logprobs of these tokens: the tokens, their logprobs,
    their text's offsets from `offset` on, top-n maps; an entry None (a prompt's first
    token, echoed) has null logprobs."""

    def piece(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = piece(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry[token_id].logprob)
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
        top_logprobs.append({piece(t): lp.logprob for t, lp in top})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _prompt_logprobs(output: RequestOutput, tokenizer) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank,
    decoded_token}} a position."""
    if output.prompt_logprobs is None:
        return None

    def entry(t: int, lp) -> dict:
        text = tokenizer.decode([t]) if tokenizer is not None else str(t)
        return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text}

    return [
        None if e is None else {str(t): entry(t, lp) for t, lp in e.items()}
        for e in output.prompt_logprobs
    ]


def _usage(output: RequestOutput) -> dict:
    completion = sum(len(o.token_ids) for o in output.outputs)
    prompt = len(output.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def _held_back(params: SamplingParams) -> int:
    """Characters kept back while streaming, so a stop string is never half-sent."""
    return max((len(s) for s in params.stop), default=1) - 1


class OpenAIServer:
    def __init__(
        self,
        router: ModelRouter,
        max_body_bytes: int,
        limits: RequestLimits,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.tool_parser = tool_parser  # chat `tools` served (--tool-call-parser); None: 400
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: chat thinking apart

    def tools_of(self, body: ChatRequest) -> list[dict] | None:
        """The tools a chat request gives its template and reads calls of (None: none)."""
        if not body.tools or body.tool_choice == "none":
            if isinstance(body.tool_choice, dict) or body.tool_choice == "required":
                raise InvalidRequestError("tool_choice", "asks for a call: give the tools")
            return None
        if self.tool_parser is None:
            raise InvalidRequestError(
                "tools",
                "tool calling is off on this server: start it with --enable-auto-tool-choice "
                "--tool-call-parser NAME",
            )
        return msgspec.to_builtins(body.tools)

    def chat_inputs(
        self, body: ChatRequest, engine: AsyncLLM, params: SamplingParams
    ) -> tuple[list[dict], list[dict] | None, SamplingParams]:
        """A chat request's conversation and tools for the template, and its params with the
        grammar of a call its tool_choice forces."""
        conversation = self.chat_prompt(body, engine.tokenizer)
        tools = self.tools_of(body)
        if (forced := self.forced_call(body, tools)) is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(
                    "tool_choice", "a forced call cannot go with a response format"
                )
            params = dataclasses.replace(params, structured_outputs=forced)
        if params.structured_outputs is not None and self.reasoning_parser is not None:
            params = self.after_thinking(body, engine, params, forced is not None)
        return conversation, tools, params

    def after_thinking(
        self, body: ChatRequest, engine: AsyncLLM, params: SamplingParams, forced: bool
    ) -> SamplingParams:
        """A reasoning model's grammar held from the end of its thinking on (the engine core
        waits for the end tag's tokens); InvalidRequestError where its thinking is optional."""
        parser = self.reasoning_parser
        field = "tool_choice" if forced else structured_spec(body)[1]
        if not parser.grammar_after_thinking or engine.tokenizer is None:
            raise InvalidRequestError(
                field, f"not served with --reasoning-parser {parser.name}: its thinking may be "
                "switched off, so where the grammar starts is not known",
            )  # fmt: skip
        end = engine.tokenizer.encode(parser.end, add_special_tokens=False)
        return dataclasses.replace(params, grammar_after=tuple(end))

    def forced_call(self, body: ChatRequest, tools: list[dict] | None) -> dict | None:
        """The grammar of the call `tool_choice` forces ("required": any tool; a named
        function: that one), in the parser's format; None: the model chooses."""
        choice = body.tool_choice
        if not tools or choice in (None, "auto"):
            return None
        names = [t["function"]["name"] for t in tools]
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in names:
                raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not a tool")
            names = [name]
        return self.tool_parser.forced(tools, names)

    def get_model(self, model: str | None) -> ServedModel:
        """The model a request names (None: the default one)."""
        served = self.router.get(model)
        if served is None:
            raise APIError(404, f"model {model!r} does not exist", "model", "NotFoundError")
        return served

    def chat_prompt(self, body: ChatRequest, tokenizer) -> list[dict]:
        """The conversation, for AsyncLLM.encode_chat (the template runs there)."""
        if body.messages is None:
            raise InvalidRequestError("messages", "required")
        conversation = []
        for i, m in enumerate(body.messages):
            content = m.content
            if content is None and not m.tool_calls:
                raise InvalidRequestError(
                    f"messages[{i}].content",
                    "expected a string or an array, got null (null only beside tool_calls)",
                )
            if isinstance(content, list):  # content parts: text only
                for j, part in enumerate(content):
                    if part.type != "text":
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}].type",
                            f"{part.type!r} is not supported: this server's models read text",
                        )
                content = "".join(p.text or "" for p in content)
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [
                    _template_call(call, f"messages[{i}].tool_calls[{j}]")
                    for j, call in enumerate(m.tool_calls)
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            conversation.append(message)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "messages")
        if body.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        return conversation

    def completion_prompts(self, body: CompletionRequest) -> list[str | dict]:
        """A completion's prompts: one (a string or token ids), or a batch of either."""
        prompt = body.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return [{"prompt_token_ids": prompt}]
            if all(isinstance(p, str) for p in prompt):
                return list(prompt)
            if all(isinstance(p, list) for p in prompt):
                return [{"prompt_token_ids": p} for p in prompt]
        raise InvalidRequestError(
            "prompt", "expected a string, an array of token ids, or a batch of either"
        )

    def echoed(self, prompts: list[str | dict], tokenizer) -> list[str]:
        """Each prompt's text, for `echo`."""
        return [
            p
            if isinstance(p, str)
            else tokenizer.decode(p["prompt_token_ids"])
            if tokenizer
            else ""
            for p in prompts
        ]

    async def handle(self, request: Request, *, chat: bool) -> Response:
        try:
            body = parse_request(
                await read_body(request, self.max_body_bytes), chat=chat, limits=self.limits
            )
            served = self.get_model(body.model)
            engine = served.engine  # the version serving now: its tokenizer (NOTE: not pinned)
            params = sampling_params_from(body, engine.sampling_defaults)
            echo = tools = None
            if chat:  # the template and tokenizer run off the event loop when it is long
                conversation, tools, params = self.chat_inputs(body, engine, params)
                ids = await engine.encode_chat(conversation, tools, **template_options(body))
                prompts = [{"prompt_token_ids": ids}]
            else:
                prompts = self.completion_prompts(body)
                if len(prompts) > 1 and len(prompts) * params.n > engine.max_pending_requests:
                    raise InvalidRequestError(
                        "prompt",
                        f"{len(prompts)} prompts x n={params.n} exceed the server's "
                        f"{engine.max_pending_requests} sequences",
                    )
                if body.echo:
                    echo = self.echoed(prompts, engine.tokenizer)
            priority = _first(body.priority, 0)
            stream = _first(body.stream, False)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
            deadline = _deadline(body.timeout, request.headers.get("x-request-timeout"))
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        request_id = engine_request_id("chatcmpl" if chat else "cmpl")
        if len(prompts) == 1:
            results = served.generate(request_id, prompts[0], params, priority)
        else:
            results = _batch(served, request_id, prompts, params, priority)
        reply = Reply(request_id, served.name, engine.tokenizer, chat, params, len(prompts), echo)
        reply.show_prompt_logprobs = body.prompt_logprobs is not None
        if chat:
            reply.reasoning_parser = self.reasoning_parser
        if tools:
            reply.tool_parser = self.tool_parser
            reply.tool_names = {t["function"]["name"] for t in tools}

        def chunks(results: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
            return self._stream(reply, results, include_usage, deadline, continuous)

        return await respond(
            results, reply, request, deadline, chunks if stream else None,
            lambda final: self._full_body(reply, final),
        )  # fmt: skip

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a text's or a conversation's token ids, their count and the
        model's max_model_len (so a client can see what fits before it asks)."""
        try:
            body = decode(TOKENIZE_DECODER, await read_body(request, self.max_body_bytes))
            engine = self.get_model(body.model).engine
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequestError("prompt", "give either prompt or messages")
            if body.messages is not None:
                check_request_template(body, self.limits)
                conversation = self.chat_prompt(body, engine.tokenizer)
                tools = msgspec.to_builtins(body.tools) if body.tools else None
                generation = _first(body.add_generation_prompt, True)
                ids = await engine.encode_chat(
                    conversation, tools, generation, chat_template=body.chat_template
                )
            else:
                special = _first(body.add_special_tokens, True)
                ids = await engine.encode_text(body.prompt, special)
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }  # fmt: skip
        )

    async def lora_adapter(self, request: Request, load: bool) -> Response:
        """vLLM's /v1/load_lora_adapter ({"lora_name", "lora_path"}: a PEFT folder on this
        machine into a free slot, served under the name from then on) and
        /v1/unload_lora_adapter ({"lora_name"}); a plain-text answer, as vLLM's."""
        from lantau.server.models import SingleModelRouter

        what = "load_lora_adapter" if load else "unload_lora_adapter"
        if not self.limits.allow_runtime_lora_updating:
            return error_response(
                404, f"/v1/{what} is off: the server runs with --allow-runtime-lora-updating "
                "for it", kind="not_found_error",
            )  # fmt: skip
        if not isinstance(self.router, SingleModelRouter):
            return error_response(404, f"/v1/{what}: not with a model repository",
                                  kind="not_found_error")  # fmt: skip
        try:
            body = decode(LORA_ADAPTER_DECODER, await read_body(request, self.max_body_bytes))
            if load and not body.lora_path:
                raise InvalidRequestError("lora_path", "a PEFT adapter's folder is required")
            if body.lora_name in self.router.names() and load:
                raise InvalidRequestError("lora_name", f"{body.lora_name!r} is served already")
            if not load and body.lora_name not in self.router.adapter_names():
                return error_response(404, f"lora adapter {body.lora_name!r} is not loaded",
                                      "lora_name", "not_found_error")  # fmt: skip
            engine = self.router.model.engine
            if load:
                await engine.load_lora_adapter(body.lora_name, body.lora_path)
            else:
                await engine.unload_lora_adapter(body.lora_name)
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        except ValueError as e:  # the engine's reason: no slot free, a bad adapter, in use
            return error_response(400, str(e), "lora_path" if load else "lora_name")
        done = "added" if load else "removed"
        return Response(f"Success: LoRA adapter '{body.lora_name}' {done} successfully.",
                        media_type="text/plain")  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids' text."""
        try:
            body = decode(DETOKENIZE_DECODER, await read_body(request, self.max_body_bytes))
            engine = self.get_model(body.model).engine
            if engine.tokenizer is None:
                raise InvalidRequestError("tokens", "this model has no tokenizer")
            vocab = engine.config.model_config.vocab_size
            if any(t >= vocab for t in body.tokens):
                raise InvalidRequestError("tokens", f"must be token ids in [0, {vocab})")
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        return json_response({"prompt": engine.tokenizer.decode(body.tokens)})

    def _full_body(self, reply: Reply, output: RequestOutput) -> dict:
        choices = []
        parts = output.parts if isinstance(output, BatchOutput) else [output]
        for o in output.outputs:
            choice: dict[str, Any] = {"index": o.index, "finish_reason": o.finish_reason}
            if reply.chat:
                reasoning, content, calls = reply.answer(o)
                choice["message"] = {"role": "assistant", "content": content}
                if reasoning is not None:  # vLLM's field, and its newer name
                    choice["message"] |= {"reasoning_content": reasoning, "reasoning": reasoning}
                if calls:
                    choice["message"]["content"] = content if content.strip() else None
                    choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
                    if o.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
            else:
                prompt = reply.echo[o.index // reply.params.n] if reply.echo else ""
                choice["text"] = prompt + o.text
            part = parts[o.index // reply.params.n]
            choice["logprobs"] = reply.logprobs(part, o, 0, 0)
            if reply.show_prompt_logprobs and not reply.chat:  # vLLM's: a choice's prompt's
                choice["prompt_logprobs"] = _prompt_logprobs(part, reply.tokenizer)
            choices.append(choice)
        body = {
            "id": reply.request_id,
            "object": "chat.completion" if reply.chat else "text_completion",
            "created": int(time.time()),
            "model": reply.model_name,
            **reply.fingerprint(),
            "choices": choices,
            "usage": _usage(output),
        }
        if reply.show_prompt_logprobs and reply.chat:  # vLLM's: the conversation's
            body["prompt_logprobs"] = _prompt_logprobs(output, reply.tokenizer)
        return body

    async def _stream(
        self,
        reply: Reply,
        results: AsyncIterator[RequestOutput],
        include_usage: bool,
        deadline: float | None,
        continuous_usage: bool = False,
    ) -> AsyncIterator[bytes]:
        request_id, params, chat = reply.request_id, reply.params, reply.chat
        fingerprint = reply.fingerprint()
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        hold = _held_back(params)
        sent = [0] * (params.n * reply.num_prompts)  # characters sent, by choice
        sent_tokens = [0] * (params.n * reply.num_prompts)  # tokens whose logprobs are sent
        ended: set[int] = set()  # the choices whose finish_reason is sent
        echo = reply.echo
        last: RequestOutput | None = None

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            body = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": reply.model_name,
                **fingerprint,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return b"data: " + orjson.dumps(body) + b"\n\n"

        detailed = echo is not None or params.logprobs is not None
        tooled = reply.tool_parser is not None
        thinking = reply.reasoning_parser
        sent_reasoning = [0] * (params.n * reply.num_prompts)  # thinking's characters sent

        def delta_of(part: RequestOutput, o) -> dict | None:
            """The choice chunk for one sequence's new text, held back near stop strings;
            None when it has nothing new (or has ended already: a finished sequence stays in
            its request's outputs while the others run on). NOTE: once a token a stream:
            kept lean."""
            if o.index in ended:
                return None
            if thinking is not None:
                return reasoning_delta(part, o)
            if tooled:
                return tool_delta(part, o)
            return plain_delta(part, o)

        def plain_delta(part: RequestOutput, o) -> dict | None:
            i, reason, text = o.index, o.finish_reason, o.text
            start = sent[i]
            end = len(text) if reason is not None else max(start, len(text) - hold)
            if end == start and reason is None:
                return None
            delta, logprobs = text[start:end], None
            if detailed:
                delta, logprobs = details(part, o, start, delta)
            sent[i] = end
            if reason is not None:
                ended.add(i)
            if chat:
                return {
                    "index": i, "delta": {"content": delta}, "finish_reason": reason,
                    "logprobs": logprobs,
                }  # fmt: skip
            return {"index": i, "text": delta, "finish_reason": reason, "logprobs": logprobs}

        def reasoning_delta(part: RequestOutput, o) -> dict | None:
            """delta_of for a reasoning model's chat: the thinking's new text as
            `reasoning_content` (held back near a stop string or a half-written end tag), then
            the answer's through delta_of's own paths, on the answer's text alone."""
            i, reason = o.index, o.finish_reason
            split = thinking.split(o.text, final=reason is not None)
            reasoning = split.reasoning or ""
            end = len(reasoning)
            if reason is None and split.content is None:
                end = max(sent_reasoning[i], end - hold)
            new = reasoning[sent_reasoning[i] : end]
            sent_reasoning[i] = max(sent_reasoning[i], end)
            if split.content is not None:
                answer = dataclasses.replace(o, text=split.content)
                choice = tool_delta(part, answer) if tooled else plain_delta(part, answer)
            elif reason is not None:  # cut while thinking: no answer
                ended.add(i)
                choice = {"index": i, "delta": {}, "finish_reason": reason, "logprobs": None}
            else:
                choice = None
            if new:
                choice = choice or {
                    "index": i,
                    "delta": {},
                    "finish_reason": None,
                    "logprobs": None,
                }
                choice["delta"] = {"reasoning_content": new, "reasoning": new, **choice["delta"]}
            return choice

        def tool_delta(part: RequestOutput, o) -> dict | None:
            """delta_of for a request with tools: what may start a call is held back until
            the answer ends; then its calls, in one chunk."""
            i, reason, text, start = o.index, o.finish_reason, o.text, sent[o.index]
            logprobs = None
            if reason is None:
                end = max(start, min(len(text) - hold, reply.tool_parser.streamable(text)))
                if end == start:
                    return None
                delta: dict = {"content": text[start:end]}
                sent[i] = end
            else:
                content, calls = reply.tool_calls(o)
                delta = {"content": content[start:]}
                if calls:
                    delta["tool_calls"] = [c.to_openai(k) for k, c in enumerate(calls)]
                    reason = "tool_calls" if reason == "stop" else reason
                ended.add(i)
            if params.logprobs is not None:
                logprobs = reply.logprobs(part, o, sent_tokens[i], 0)
                sent_tokens[i] = len(o.token_ids)
            return {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}

        def details(part: RequestOutput, o, start: int, delta: str) -> tuple[str, dict | None]:
            """A chunk's echoed prompt (before its first text) and its tokens' logprobs."""
            i, offset = o.index, start
            if echo is not None:
                if start == 0 and sent_tokens[i] == 0:  # its first chunk: the prompt first
                    delta = echo[i // params.n] + delta
                else:
                    offset += len(echo[i // params.n])
            logprobs = reply.logprobs(part, o, sent_tokens[i], offset)
            sent_tokens[i] = len(o.token_ids)
            return delta, logprobs

        if chat:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    for i in range(params.n)
                ]
            )
        # NOTE: a client disconnect closes this generator; the finally's aclose() aborts
        try:
            async with asyncio.timeout_at(deadline):
                async for output in results:
                    last = output
                    choices = [c for o in output.outputs if (c := delta_of(output, o)) is not None]
                    if choices:
                        yield chunk(choices, _usage(output) if continuous_usage else None)
        except Exception as e:  # the stream has started: report in-band, then end it
            yield b"data: " + _error_for(e).body + b"\n\n"
        finally:
            await results.aclose()
        if include_usage and last is not None:
            yield chunk([], _usage(last))
        yield b"data: [DONE]\n\n"


@dataclasses.dataclass
class Reply:
    """What a response names: the request, the model, and the version that served it."""

    request_id: str
    model_name: str
    tokenizer: Any
    chat: bool
    params: SamplingParams
    num_prompts: int = 1  # a batch's: choice p * n + i is prompt p's sample i
    echo: list[str] | None = None  # each prompt's text, to precede its choices' (`echo`)
    version: str | None = None  # a model repository's version (None: a fixed model)
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: in the body
    tool_parser: ToolParser | None = None  # reads tool calls back from the answer
    tool_names: set[str] = dataclasses.field(default_factory=set)  # the request's tools
    reasoning_parser: ReasoningParser | None = None  # a chat answer's thinking apart

    def tool_calls(self, o) -> tuple[str, list[ToolCall]]:
        """A finished choice's content and tool calls (none: its text, [])."""
        if self.tool_parser is None:
            return o.text, []
        return self.tool_parser.extract(o.text, self.tool_names)

    def answer(self, o) -> tuple[str | None, str | None, list[ToolCall]]:
        """A finished chat choice's thinking (None without a reasoning parser), content (None
        when cut while thinking) and tool calls, read from the answer after the thinking."""
        if self.reasoning_parser is None:
            return None, *self.tool_calls(o)
        split = self.reasoning_parser.split(o.text)
        if split.content is None:
            return split.reasoning, None, []
        return split.reasoning, *self.tool_calls(dataclasses.replace(o, text=split.content))

    def logprobs(self, part: RequestOutput, o, start: int, offset: int) -> dict | None:
        """A choice's logprobs from its token `start` on (OpenAI's shape for the route; None
        unless asked for). Completions: the text offsets count from `offset`; with `echo`,
        the prompt's tokens come first (from start 0)."""
        if o.logprobs is None:
            return None
        num_top, tokenizer = self.params.logprobs or 0, self.tokenizer
        token_ids, entries = o.token_ids[start:], o.logprobs[start:]
        if self.chat:
            return _logprobs_chat(token_ids, entries, tokenizer, num_top)
        if self.echo is not None and start == 0 and part.prompt_logprobs is not None:
            token_ids = part.prompt_token_ids + token_ids
            entries = part.prompt_logprobs + entries
        return _logprobs_completion(token_ids, entries, tokenizer, num_top, offset)

    def fingerprint(self) -> dict:
        """OpenAI's system_fingerprint names the backend configuration: here the version."""
        return {"system_fingerprint": f"{self.model_name}:{self.version}"} if self.version else {}


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]):
    """`first`, then the rest; `rest` closed as this ends, also when `first` was the last
    (its request is then recorded and released at once, not when it is garbage-collected)."""
    try:
        yield first
        if not first.finished:
            async for output in rest:
                yield output
    finally:
        await rest.aclose()


@dataclasses.dataclass
class BatchOutput(RequestOutput):
    """A batch's outputs, all of its prompts': `parts[p]` is prompt p's own."""

    parts: list[RequestOutput] = dataclasses.field(default_factory=list)


async def _batch(
    served: ServedModel, request_id: str, prompts: list, params: SamplingParams, priority: int
) -> AsyncIterator[RequestOutput]:
    """A batch of prompts as one request's outputs: each prompt its own engine request, its
    choices numbered after the prompts before it (prompt p's sample i is choice p * n + i).
    Yields each prompt's outputs as they advance, then all of them once every prompt is done
    (`finished`, usage over the batch). Every prompt's first output comes before anything is
    yielded, so a refused prompt fails the whole request before a response starts; any error
    aborts the rest."""
    n = params.n
    streams = [
        served.generate(f"{request_id}-{p}", prompt, params, priority)
        for p, prompt in enumerate(prompts)
    ]
    pending = {asyncio.ensure_future(anext(s)): p for p, s in enumerate(streams)}

    def numbered(p: int, out: RequestOutput) -> RequestOutput:
        outputs = [dataclasses.replace(o, index=p * n + o.index) for o in out.outputs]
        return dataclasses.replace(out, request_id=request_id, outputs=outputs, finished=False)

    try:
        # every first output (or the first error: the finally cancels the rest)
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if (error := task.exception()) is not None:
                raise error
        latest = [task.result() for task in pending]  # in prompt order (dicts keep it)
        pending.clear()
        for p, out in enumerate(latest):
            yield numbered(p, out)
            if not out.finished:
                pending[asyncio.ensure_future(anext(streams[p]))] = p
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                p = pending.pop(task)
                latest[p] = out = task.result()
                yield numbered(p, out)
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[p]))] = p
        yield BatchOutput(
            request_id,
            None,
            [t for out in latest for t in out.prompt_token_ids],
            [o for p, out in enumerate(latest) for o in numbered(p, out).outputs],
            sum(out.num_cached_tokens for out in latest),
            finished=True,
            model_version=latest[0].model_version,
            parts=latest,
        )
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _deadline(timeout: float | None, header: str | None) -> float | None:
    """Loop time by which the request must finish: the shorter of `timeout` (s) in the body
    and the `x-request-timeout` header."""
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise InvalidRequestError("x-request-timeout", "expected a number of seconds > 0")
        timeout = seconds if timeout is None else min(timeout, seconds)
    if timeout is None:
        return None
    return asyncio.get_running_loop().time() + timeout


def _error_for(e: BaseException) -> Response:
    if isinstance(e, InvalidRequestError):
        return error_response(400, str(e), e.field)
    if isinstance(e, EngineOverloadedError):
        response = error_response(429, f"server busy: {e}", kind="rate_limit_error")
        response.headers["Retry-After"] = "1"
        return response
    if isinstance(e, TimeoutError):
        return error_response(504, "the request's deadline passed; it was aborted", "timeout")
    if isinstance(e, EngineDeadError):
        return error_response(503, f"engine unavailable: {e}")
    if isinstance(e, asyncio.CancelledError):
        raise e
    return error_response(500, f"{type(e).__name__}: {e}")


async def respond(
    results: AsyncIterator[RequestOutput],
    reply: Reply,
    request: Request,
    deadline: float | None,
    stream: Callable[[AsyncIterator[RequestOutput]], AsyncIterator[bytes]] | None,
    whole: Callable[[RequestOutput], dict],
) -> Response:
    """A request's answer: its first output awaited here (admission, validation and engine
    errors surface before a stream starts, as statuses), then the SSE `stream` of the outputs,
    or the `whole` body of the final one (499 when the client left first: the request is
    aborted)."""
    try:
        async with asyncio.timeout_at(deadline):
            first = await anext(results)
    except BaseException as e:
        await results.aclose()
        return _error_for(e)
    results = _chain(first, results)
    reply.version = first.model_version
    if stream is not None:
        return StreamingResponse(stream(results), media_type="text/event-stream")
    try:
        final = await _collect_unless_disconnected(results, request, deadline)
    except BaseException as e:
        return _error_for(e)
    if final is None:  # the client left; its request is aborted already
        return Response(status_code=499)
    return json_response(whole(final))


async def _collect_unless_disconnected(
    results: AsyncIterator[RequestOutput],
    request: Request,
    deadline: float | None,
    poll_s: float = 0.2,
) -> RequestOutput | None:
    """The final output, or None if the client disconnected first (the request is aborted);
    TimeoutError past the deadline (the request is aborted too)."""

    async def collect() -> RequestOutput | None:
        final = None
        async for output in results:
            final = output
        return final

    task = asyncio.create_task(collect())
    loop = asyncio.get_running_loop()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its generator's cleanup aborts the request
        await results.aclose()


def make_openai_router(
    engine: AsyncLLM | ModelRouter,
    model_name: str | None,
    max_body_bytes: int,
    limits: RequestLimits | None = None,
    tool_parser: ToolParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
) -> APIRouter:
    """The OpenAI routes for a router's models (or one engine named `model_name`);
    `tool_parser`: chat `tools` served (--tool-call-parser); `reasoning_parser`: a chat
    answer's thinking apart (--reasoning-parser)."""
    models = as_router(engine, model_name)
    server = OpenAIServer(
        models, max_body_bytes, limits or RequestLimits(), tool_parser, reasoning_parser
    )
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> Response:
        data = []
        for name in models.names():
            served = models.get(name)
            if served is not None and served.versions():
                data.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "lantau",
                        "max_model_len": served.engine.max_model_len,
                        # vLLM's: a LoRA adapter's base model (null for a model itself)
                        "parent": served.parent,
                    }
                )
        return json_response({"object": "list", "data": data})

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await server.tokenize(request)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await server.detokenize(request)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await server.lora_adapter(request, load=True)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await server.lora_adapter(request, load=False)

    @router.get("/version")
    async def version() -> Response:
        return json_response({"version": lantau.version()})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    # NOTE: imported here, not at the top: responses_api builds on this module
    from lantau.server.responses_api import ResponsesServer, not_stored

    responses = ResponsesServer(server)

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return not_stored(response_id)

    return router
