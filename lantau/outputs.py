"""What `LLM.generate` returns (the vLLM shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lantau.request import Logprob


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, when asked for
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp[t].logprob for lp, t in zip(self.logprobs, self.token_ids, strict=True))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = False
    model_version: str | None = None  # the version that served it (a model repository's)
    # SamplingParams.prompt_logprobs: each prompt token's (None for the first), once known
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
