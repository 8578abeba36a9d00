"""The typed contracts between scheduler, runner and engine (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lantau.request import FinishReason, Logprob, SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no valid state for: first scheduled, or resumed after
    preemption (its KV was dropped and is recomputed from `token_ids`)."""

    request_id: str
    token_ids: list[int]  # prompt + output tokens so far
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens already in the cache (prefix hits) before this step
    eos_token_ids: tuple[int, ...] = ()  # banned with stop_token_ids before min_tokens


@dataclass
class CachedRequestData:
    """A running request the runner already holds: only what changed (a diff)."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # tokens in the cache before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens computed for it in this step (chunk, prompt rest, or 1 for decode)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests that ended since the last step: the runner drops their state
    finished_req_ids: set[str] = field(default_factory=set)
    # requests preempted in this step: their KV blocks are already freed
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class RunnerOutput:
    # request id -> sampled token, only for requests whose scheduled tokens reached their end
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request id -> {token id: Logprob} (chosen + top-n), for requests asking for logprobs
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # request id -> its prompt's logprobs (None for the first token), with its first sample
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: the diff the frontend turns into text."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
