"""Requests and their sampling parameters (pure Python, no torch)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from lantau.errors import InvalidRequestError

# integers cross to the engine core as msgpack: at most 64 bits
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit bias


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed; waits to be recomputed
    FINISHED = enum.auto()


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token under the model's raw distribution


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token; the vLLM field names and meanings.

    Penalties follow vLLM: repetition_penalty over prompt and output tokens, presence and
    frequency penalties over output tokens only. Temperature 0 means greedy.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0  # none of EOS, stop_token_ids or stop strings ends it before these
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's and the top-k's
    # None: none; k: each prompt token's logprob (after the first) and the top-k's there
    # (no prefix-cache hits for such a request: every prompt position is computed)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks), no text or stop strings
    # added to the token's logit before sampling (OpenAI's: -100 bans a token, 100 forces it)
    logit_bias: dict[int, float] | None = None
    # the grammar the output follows (lantau/structured.py): {"json": schema}, {"json_object":
    # true}, {"regex": ...}, {"choice": [...]} or {"grammar": lark}
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: requests share cached prefixes only with requests of the same salt (a tenant's
    # own), so one cannot learn from its timing what another's prompts began with
    cache_salt: str | None = None
    # the grammar holds only once the output ends with these tokens (a reasoning model's end
    # of thinking: the routes set it with --reasoning-parser)
    grammar_after: tuple[int, ...] = ()
    # the LoRA adapter (its --lora-modules name) the request runs with; None: the base model
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "grammar_after", tuple(self.grammar_after or ()))
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias", "must be a map of token ids to numbers")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias or {}) or None)
        self._validate()
        object.__setattr__(
            self,
            "_processes_logits",
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.logit_bias is not None
            or self.structured_outputs is not None,
        )
        if self.structured_outputs is not None:
            from lantau.structured import grammar_of

            grammar_of(self.structured_outputs)  # InvalidRequestError if it is not valid

    def _validate(self) -> None:
        for name, ok, message in self._checks():
            if not ok:
                shown = json.dumps(getattr(self, name), default=repr)
                raise InvalidRequestError(name, f"{message}, got {shown[:80]}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        """(field, holds, what it must be); numbers finite, integers within 64 bits."""
        penalty = "must be in [-2, 2]"
        return [
            ("n", _is_int(self.n, 1), "must be an integer >= 1"),
            ("max_tokens", _is_int(self.max_tokens, 1), "must be an integer >= 1"),
            (
                "min_tokens",
                _is_int(self.min_tokens, 0) and self.min_tokens <= self.max_tokens,
                "must be an integer in [0, max_tokens]",
            ),
            ("temperature", _is_number(self.temperature, 0.0), "must be a finite number >= 0"),
            ("top_k", _is_int(self.top_k, -1), "must be -1, 0 or >= 1"),
            ("top_p", _is_number(self.top_p, 0.0, 1.0) and self.top_p > 0, "must be in (0, 1]"),
            ("min_p", _is_number(self.min_p, 0.0, 1.0), "must be in [0, 1]"),
            (
                "repetition_penalty",
                _is_number(self.repetition_penalty, 0.0) and self.repetition_penalty > 0,
                "must be a finite number > 0",
            ),
            ("presence_penalty", _is_number(self.presence_penalty, -2.0, 2.0), penalty),
            ("frequency_penalty", _is_number(self.frequency_penalty, -2.0, 2.0), penalty),
            (
                "seed",
                self.seed is None or _is_int(self.seed, INT64_MIN, UINT64_MAX),
                "must be null or a 64-bit integer",
            ),
            (
                "logprobs",
                self.logprobs is None or _is_int(self.logprobs, 0),
                "must be null or an integer >= 0",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or _is_int(self.prompt_logprobs, 0),
                "must be null or an integer >= 0",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(_is_int(t, 0) for t in self.stop_token_ids),
                "must be non-negative integers",
            ),
            (
                "logit_bias",
                all(
                    _is_int(t, 0) and _is_number(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                    for t, b in (self.logit_bias or {}).items()
                ),
                f"must map token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}]",
            ),
            (
                "grammar_after",
                all(_is_int(t, 0) for t in self.grammar_after),
                "must be non-negative integers",
            ),
            (
                "cache_salt",
                self.cache_salt is None
                or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 1024),
                "must be null or a string of 1 to 1024 characters",
            ),
            (
                "lora",
                self.lora is None or (isinstance(self.lora, str) and 0 < len(self.lora) <= 128),
                "must be null or an adapter's name",
            ),
        ]

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidRequestError if a logit bias names a token the model does not have."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidRequestError(
                "logit_bias",
                f"token {max(self.logit_bias)} is not in the vocabulary [0, {vocab_size})",
            )

    @property
    def processes_logits(self) -> bool:
        """Its logits change before sampling (penalties, logit bias, a grammar): no pick of
        the raw logits (a CUDA graph's greedy ids) stands for its token. NOTE: asked of every
        row every step: worked out once, in __post_init__."""
        return self._processes_logits

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object, low: int, high: int = INT64_MAX) -> bool:
    """An int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object, low: float, high: float = math.inf) -> bool:
    """A finite int or float (not a bool) in [low, high]."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return low <= value <= high  # NOTE: an int compares exactly, however large


@dataclass
class Request:
    """One sequence being generated: the scheduler's and KV manager's unit of work.

    `num_computed_tokens` catches up to `num_tokens`; the last token of a running request is
    the one sampled in the previous step, whose KV is not written yet. With overlapped steps a
    request may also be scheduled past its known tokens: `num_pending_tokens` were sampled in
    steps whose results have not come back; the runner feeds them from the device.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    priority: int = 0  # lower runs first; ties by arrival
    arrival_seq: int = 0  # set by the scheduler: FCFS order
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or is being written)
    num_pending_tokens: int = 0  # sampled in steps still in flight, not yet appended
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache; -1: not scheduled
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt + output tokens at which the request ends by length (max_tokens or
        max_model_len, whichever comes first)."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, self.max_model_len)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def priority_key(self) -> tuple[int, int]:
        """Smaller is scheduled first and preempted last."""
        return (self.priority, self.arrival_seq)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> FinishReason | None:
        """Finish reason after the last appended token, from token ids and lengths only."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) <= params.min_tokens:  # the sampler banned them so far
            return FinishReason.LENGTH if self.num_tokens >= self.max_num_tokens else None
        if not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        if self.num_tokens >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None


def validate_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequestError for a prompt the engine cannot serve."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(prompt_token_ids)} tokens leave no room for output within "
            f"max_model_len={max_model_len}",
        )
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError("prompt_token_ids", f"must be integers in [0, {vocab_size})")
