"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming).

Request bodies are parsed with orjson and checked by hand into SamplingParams: no pydantic on
the hot path. Streamed chunks are pre-encoded bytes. Errors have OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from lantau.server.body import RequestBodyError, read_body

_ids = itertools.count()


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


async def read_json(request: Request, max_bytes: int) -> dict:
    try:
        raw = await read_body(request, max_bytes)
    except RequestBodyError as e:
        raise APIError(e.status, e.message) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        and kind is not bool
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise APIError(400, f"{name}: expected {getattr(kind, '__name__', kind)}", name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise APIError(400, f"{name}: expected {names}, got {type(value).__name__}", name)
    return value


def sampling_params_from(body: dict, *, chat: bool) -> SamplingParams:
    """OpenAI fields (plus vLLM's extras: top_k, min_p, repetition_penalty, ignore_eos)."""
    num = (int, float)
    max_tokens = _get(body, "max_completion_tokens", int) if chat else None
    max_tokens = max_tokens or _get(body, "max_tokens", int, 16 if not chat else 512)
    stop = _get(body, "stop", (str, list), ())
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop: expected a string or a list of strings", "stop")
    if chat:
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool) else None
    else:
        logprobs = _get(body, "logprobs", int)
    try:
        return SamplingParams(
            n=_get(body, "n", int, 1),
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", num, 1.0)),
            top_p=float(_get(body, "top_p", num, 1.0)),
            top_k=_get(body, "top_k", int, 0),
            min_p=float(_get(body, "min_p", num, 0.0)),
            repetition_penalty=float(_get(body, "repetition_penalty", num, 1.0)),
            presence_penalty=float(_get(body, "presence_penalty", num, 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", num, 0.0)),
            seed=_get(body, "seed", int),
            stop=stop,
            stop_token_ids=_get(body, "stop_token_ids", list, ()),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            logprobs=logprobs,
        )
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.field) from None
    except TypeError as e:
        raise APIError(400, str(e)) from None


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
    def __init__(self, engine: AsyncLLM, model_name: str, max_body_bytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.tokenizer = engine.tokenizer

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist", "model", "NotFoundError")

    def chat_prompt(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages: expected a non-empty list", "messages")
        conversation = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, "messages: each needs a string role", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
            if not isinstance(content, str):
                raise APIError(400, "messages: content must be a string or text parts", "messages")
            conversation.append({"role": m["role"], "content": content})
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        return conversation

    def completion_prompt(self, body: dict) -> str | dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return {"prompt_token_ids": prompt}
        raise APIError(400, "prompt: expected a string or a list of token ids", "prompt")

    async def handle(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await read_json(request, self.max_body_bytes)
            self.check_model(body)
            params = sampling_params_from(body, chat=chat)
            prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
            if chat:  # the template and tokenizer run off the event loop when it is long
                prompt = {"prompt_token_ids": await self.engine.encode_chat(prompt)}
            priority = _get(body, "priority", int, 0)
            stream = _get(body, "stream", bool, False)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            deadline = _deadline(body, request)
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except InvalidRequestError as e:
            return _error_for(e)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
        results = self.engine.generate(request_id, prompt, params, priority)
        try:  # the first output: admission, validation and engine errors surface before a stream
            async with asyncio.timeout_at(deadline):
                first = await anext(results)
        except BaseException as e:
            await results.aclose()
            return _error_for(e)
        results = _chain(first, results)
        if stream:
            chunks = self._stream(request_id, results, params, chat, include_usage, deadline)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            final = await _collect_unless_disconnected(results, request, deadline)
        except BaseException as e:
            return _error_for(e)
        if final is None:  # the client left; its request is aborted already
            return Response(status_code=499)
        return json_response(self._full_body(request_id, final, chat, params))

    def _full_body(
        self, request_id: str, output: RequestOutput, chat: bool, params: SamplingParams
    ) -> dict:
        choices = []
        for o in output.outputs:
            choice: dict[str, Any] = {"index": o.index, "finish_reason": o.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": o.text}
                choice["logprobs"] = _logprobs_chat(o, self.tokenizer, params.logprobs or 0)
            else:
                choice["text"] = o.text
                choice["logprobs"] = _logprobs_completion(o, self.tokenizer, params.logprobs or 0)
            choices.append(choice)
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(output),
        }

    async def _stream(
        self,
        request_id: str,
        results: AsyncIterator[RequestOutput],
        params: SamplingParams,
        chat: bool,
        include_usage: bool,
        deadline: float | None,
    ) -> AsyncIterator[bytes]:
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
                "model": self.model_name,
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


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]):
    yield first
    if not first.finished:
        try:
            async for output in rest:
                yield output
        finally:
            await rest.aclose()


def _deadline(body: dict, request: Request) -> float | None:
    """Loop time by which the request must finish: `timeout` (s) in the body or the
    `x-request-timeout` header."""
    timeout = body.get("timeout", request.headers.get("x-request-timeout"))
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise APIError(400, "timeout: expected a number of seconds", "timeout") from None
    if not seconds > 0:
        raise APIError(400, "timeout: must be > 0", "timeout")
    return asyncio.get_running_loop().time() + seconds


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


def make_openai_router(engine: AsyncLLM, model_name: str, max_body_bytes: int) -> APIRouter:
    server = OpenAIServer(engine, model_name, max_body_bytes)
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "lantau",
                        "max_model_len": engine.max_model_len,
                    }
                ],
            }
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    return router
