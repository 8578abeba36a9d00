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
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from lantau.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from lantau.errors import InvalidRequestError
from lantau.outputs import RequestOutput
from lantau.request import SamplingParams
from lantau.server.body import RequestBodyError
from lantau.server.body import read_body as read_raw_body
from lantau.server.models import ModelRouter, ServedModel, as_router
from lantau.server.observability import engine_request_id
from lantau.server.schemas import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    decode,
)


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
    if num_logprobs is not None and num_logprobs > limits.max_logprobs:
        raise InvalidRequestError(
            name, f"must be <= {limits.max_logprobs} on this server (--max-logprobs)"
        )
    return body


def _first(*values: Any) -> Any:
    """The first value that is not None (null in a body means "the default")."""
    return next(v for v in values if v is not None)


def sampling_params_from(body: ChatRequest | CompletionRequest) -> SamplingParams:
    """OpenAI fields, logit_bias too (plus vLLM's extras: top_k, min_p, repetition_penalty,
    ignore_eos); InvalidRequestError names a field out of range."""
    if isinstance(body, ChatRequest):
        # NOTE: max_completion_tokens replaces max_tokens; 0 is refused by the schema
        max_tokens = _first(body.max_completion_tokens, body.max_tokens, 512)
        logprobs = _first(body.top_logprobs, 0) if body.logprobs else None
    else:
        max_tokens = _first(body.max_tokens, 16)
        logprobs = body.logprobs
    return SamplingParams(
        n=_first(body.n, 1),
        max_tokens=max_tokens,
        temperature=_first(body.temperature, 1.0),
        top_p=_first(body.top_p, 1.0),
        top_k=_first(body.top_k, 0),
        min_p=_first(body.min_p, 0.0),
        repetition_penalty=_first(body.repetition_penalty, 1.0),
        presence_penalty=_first(body.presence_penalty, 0.0),
        frequency_penalty=_first(body.frequency_penalty, 0.0),
        seed=body.seed,
        stop=_first(body.stop, ()),
        stop_token_ids=_first(body.stop_token_ids, ()),
        ignore_eos=_first(body.ignore_eos, False),
        logprobs=logprobs,
        logit_bias=body.logit_bias,
    )


def _logprobs_chat(output, tokenizer, num_top: int) -> dict | None:
    """OpenAI's chat logprobs: each token's logprob and its `num_top` most likely rivals."""
    if output.logprobs is None:
        return None

    def piece(t: int) -> dict:
        text = tokenizer.decode([t]) if tokenizer is not None else str(t)
        return {"token": text, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=False):
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
        content.append(
            {
                **piece(token_id),
                "logprob": entry[token_id].logprob,
                "top_logprobs": [{**piece(t), "logprob": lp.logprob} for t, lp in top],
            }
        )
    return {"content": content}


def _logprobs_completion(output, tokenizer, num_top: int) -> dict | None:
    """OpenAI's legacy completions logprobs: tokens, their logprobs, offsets, top-n maps."""
    if output.logprobs is None:
        return None

    def piece(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=False):
        text = piece(token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob)
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:num_top]
        top_logprobs.append({piece(t): lp.logprob for t, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


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
    def __init__(self, router: ModelRouter, max_body_bytes: int, limits: RequestLimits) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes
        self.limits = limits

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
        for m in body.messages:
            content = m.content
            if not isinstance(content, str):  # content parts: keep the text ones
                content = "".join(p.text or "" for p in content if p.type == "text")
            conversation.append({"role": m.role, "content": content})
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        return conversation

    def completion_prompt(self, body: CompletionRequest) -> str | dict:
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return {"prompt_token_ids": prompt}
        raise InvalidRequestError("prompt", "expected a string or an array of token ids")

    async def handle(self, request: Request, *, chat: bool) -> Response:
        try:
            body = parse_request(
                await read_body(request, self.max_body_bytes), chat=chat, limits=self.limits
            )
            served = self.get_model(body.model)
            engine = served.engine  # the version serving now: its tokenizer (NOTE: not pinned)
            params = sampling_params_from(body)
            if chat:
                prompt = self.chat_prompt(body, engine.tokenizer)
            else:
                prompt = self.completion_prompt(body)
            if chat:  # the template and tokenizer run off the event loop when it is long
                prompt = {"prompt_token_ids": await engine.encode_chat(prompt)}
            priority = _first(body.priority, 0)
            stream = _first(body.stream, False)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            deadline = _deadline(body.timeout, request.headers.get("x-request-timeout"))
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return error_response(400, str(e), e.field)
        request_id = engine_request_id("chatcmpl" if chat else "cmpl")
        results = served.generate(request_id, prompt, params, priority)
        reply = Reply(request_id, served.name, engine.tokenizer, chat, params)
        try:  # the first output: admission, validation and engine errors surface before a stream
            async with asyncio.timeout_at(deadline):
                first = await anext(results)
        except BaseException as e:
            await results.aclose()
            return _error_for(e)
        results = _chain(first, results)
        reply.version = first.model_version
        if stream:
            chunks = self._stream(reply, results, include_usage, deadline)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            final = await _collect_unless_disconnected(results, request, deadline)
        except BaseException as e:
            return _error_for(e)
        if final is None:  # the client left; its request is aborted already
            return Response(status_code=499)
        return json_response(self._full_body(reply, final))

    def _full_body(self, reply: Reply, output: RequestOutput) -> dict:
        choices = []
        num_logprobs, tokenizer = reply.params.logprobs or 0, reply.tokenizer
        for o in output.outputs:
            choice: dict[str, Any] = {"index": o.index, "finish_reason": o.finish_reason}
            if reply.chat:
                choice["message"] = {"role": "assistant", "content": o.text}
                choice["logprobs"] = _logprobs_chat(o, tokenizer, num_logprobs)
            else:
                choice["text"] = o.text
                choice["logprobs"] = _logprobs_completion(o, tokenizer, num_logprobs)
            choices.append(choice)
        return {
            "id": reply.request_id,
            "object": "chat.completion" if reply.chat else "text_completion",
            "created": int(time.time()),
            "model": reply.model_name,
            **reply.fingerprint(),
            "choices": choices,
            "usage": _usage(output),
        }

    async def _stream(
        self,
        reply: Reply,
        results: AsyncIterator[RequestOutput],
        include_usage: bool,
        deadline: float | None,
    ) -> AsyncIterator[bytes]:
        request_id, params, chat = reply.request_id, reply.params, reply.chat
        fingerprint = reply.fingerprint()
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        hold = _held_back(params)
        sent = [0] * params.n
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

        def delta_of(o) -> dict | None:
            """The choice chunk for one sequence's new text, held back near stop strings."""
            done = o.finish_reason is not None
            end = len(o.text) if done else max(sent[o.index], len(o.text) - hold)
            delta = o.text[sent[o.index] : end]
            if not delta and not done:
                return None
            sent[o.index] = end
            body = {"delta": {"content": delta}} if chat else {"text": delta}
            return {"index": o.index, **body, "finish_reason": o.finish_reason, "logprobs": None}

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
                    choices = [c for o in output.outputs if (c := delta_of(o)) is not None]
                    if choices:
                        yield chunk(choices)
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
    version: str | None = None  # a model repository's version (None: a fixed model)

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
) -> APIRouter:
    """The OpenAI routes for a router's models (or one engine named `model_name`)."""
    models = as_router(engine, model_name)
    server = OpenAIServer(models, max_body_bytes, limits or RequestLimits())
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
                    }
                )
        return json_response({"object": "list", "data": data})

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    return router
