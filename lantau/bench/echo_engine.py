"""EchoEngine: a stand-in for AsyncLLM that generates instantly, so a benchmark of the server
measures the frontend alone (routing, JSON, SSE, HTTP).

It offers the part of AsyncLLM's interface the routes use. Each request yields `max_tokens`
cumulative RequestOutputs, one token (`token_text`) more each time, with the event loop given a
turn between tokens, as tokens arriving from the engine-core process would. No tokenizer: a
string prompt is split on whitespace into fake ids, and stop strings are not looked for.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from lantau.engine.async_llm import EngineOverloadedError
from lantau.engine.llm_engine import token_ids
from lantau.engine.protocol import StepStats
from lantau.errors import InvalidRequestError
from lantau.outputs import CompletionOutput, RequestOutput
from lantau.request import SamplingParams, validate_prompt


@dataclass(frozen=True)
class _ThisProcess:
    """Stands for the engine-core process, which here is the server's own."""

    pid: int = field(default_factory=os.getpid)

    def is_alive(self) -> bool:
        return True


class EchoEngine:
    def __init__(
        self,
        max_model_len: int = 4096,
        vocab_size: int = 32000,
        token_text: str = " tok",
        max_pending_requests: int = 1 << 16,
    ) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_text = token_text
        self.token_id = 1
        self.max_pending_requests = max_pending_requests
        self.tokenizer = None  # the routes then refuse chat (no template); completions work
        self.sampling_defaults: dict = {}  # the model's (none): AsyncLLM's
        # NOTE: as in AsyncLLM, a request is in here exactly while its generate() runs; nothing
        # is ever put in the queues (there is no core to hear from)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = StepStats()
        self.num_blocks = 0
        self.kv_cache_dtype = "none"  # no KV cache
        self.tensor_parallel_size = 1
        self.dead: str | None = None
        self.process = _ThisProcess()
        self.startup_s: dict[str, float] = {}

    def is_live(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def is_ready(self, max_silence_s: float = 0.0) -> bool:
        return self.dead is None

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(text, fake token ids): one id per whitespace-separated word."""
        if isinstance(prompt, dict):
            text, ids = None, token_ids(prompt.get("prompt_token_ids"))
        elif isinstance(prompt, str):
            text, ids = prompt, [hash(w) % self.vocab_size for w in prompt.split()]
        else:
            raise InvalidRequestError("prompt", f"must be a string, got {type(prompt).__name__}")
        validate_prompt(ids, self.max_model_len, self.vocab_size)
        return text, ids

    async def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """`params.max_tokens` RequestOutputs, one token more in each of the n sequences each
        time; the last one is finished (reason "length")."""
        text, ids = self.tokenize(prompt)
        if len(self.queues) >= self.max_pending_requests:
            raise EngineOverloadedError(f"{len(self.queues)} requests pending")
        if request_id in self.queues:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        output = RequestOutput(
            request_id, text, ids, [CompletionOutput(i, "", [], None) for i in range(params.n)]
        )
        self.queues[request_id] = asyncio.Queue()
        self.stats.num_running = len(self.queues)
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(0)  # the event loop's turn, as between two core messages
                is_last = step == params.max_tokens - 1
                for seq in output.outputs:
                    seq.token_ids.append(self.token_id)
                    seq.text += self.token_text
                    if is_last:
                        seq.finish_reason = "length"
                output.finished = is_last
                self.stats.num_generated_tokens += params.n
                yield output
        finally:  # finished, or the consumer left early: either way no longer in flight
            self.queues.pop(request_id, None)
            self.stats.num_running = len(self.queues)
