"""The frontend's half of the engine: tokenization, `n` samples per prompt, detokenization
and stop strings (OutputProcessor), and LLMEngine, which drives an in-process EngineCore with it.
The server's AsyncLLM uses the same OutputProcessor across a process boundary.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lantau.engine.detokenizer import IncrementalDetokenizer
from lantau.errors import InvalidRequestError
from lantau.metrics.gc_pauses import FrozenWhileBusy
from lantau.outputs import CompletionOutput, RequestOutput
from lantau.request import UINT64_MAX, FinishReason, Request, SamplingParams
from lantau.scheduler.output import EngineCoreOutput

if TYPE_CHECKING:  # NOTE: the frontend (AsyncLLM) imports this module, and must not load torch
    from lantau.engine.core import EngineCore


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class _Sequence:
    """One of a request's n samples, as the frontend sees it."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


@dataclass
class _RequestState:
    output: RequestOutput
    sequences: list[_Sequence] = field(default_factory=list)
    num_unfinished: int = 0


def token_ids(ids) -> list[int]:
    """A prompt's ids as Python ints: a list, a tuple or a 1-D array of integers, numpy's
    included (np.int64 ids, an array's rows); no bools, no floats."""
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:
        ids = ids.tolist()  # a numpy array or a 1-D tensor
    if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) for t in ids):
        raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise InvalidRequestError("prompt_token_ids", "must be a list of integers") from None


class OutputProcessor:
    """Turns core outputs (token ids per child request) into RequestOutputs per request."""

    def __init__(
        self, tokenizer, eos_token_ids: tuple[int, ...], fold_ids_at: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.fold_ids_at = fold_ids_at  # IncrementalDetokenizer's
        self.eos_token_ids = eos_token_ids
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return None, token_ids(prompt.get("prompt_token_ids"))
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt", f"must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt", "is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer; pass token ids")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> list[Request]:
        """Track a validated request; returns the `params.n` child Requests for the core."""
        if request_id in self.states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        state = _RequestState(RequestOutput(request_id, text, ids), num_unfinished=params.n)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                # each sample its own seed stream; sample 0 matches the same seed with n=1
                seed = None if params.seed is None else params.seed + i
                if seed is not None and seed > UINT64_MAX:  # torch's seeds wrap at 64 bits
                    seed -= UINT64_MAX + 1
                # the prompt's logprobs from sample 0 alone: the same for all
                prompt_logprobs = params.prompt_logprobs if i == 0 else None
                child_params = dataclasses.replace(
                    params, n=1, seed=seed, prompt_logprobs=prompt_logprobs
                )
            logprobs = [] if params.logprobs is not None else None
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, child_params, ids, self.fold_ids_at)
            state.sequences.append(_Sequence(CompletionOutput(i, "", [], None, logprobs), detok))
            child_id = child_request_id(request_id, i)
            self.child_to_parent[child_id] = (request_id, i)
            children.append(
                Request(child_id, list(ids), child_params, self.eos_token_ids, priority=priority)
            )
        state.output.outputs = [s.output for s in state.sequences]
        self.states[request_id] = state
        return children

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished child ids, for the core to abort."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        children = [child_request_id(request_id, i) for i in range(len(state.sequences))]
        return [c for c in children if self.child_to_parent.pop(c, None) is not None]

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process(
        self, core_outputs: list[EngineCoreOutput], prompt_logprobs: dict | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs advanced by these outputs, child ids a stop string ended).

        A finished RequestOutput is returned once, with `finished` set, and then forgotten.
        """
        touched: dict[str, RequestOutput] = {}
        stopped: list[str] = []
        for core_out in core_outputs:
            if core_out.request_id not in self.child_to_parent:
                continue  # aborted while the step ran
            request_id = self._process_one(core_out, stopped)
            if prompt_logprobs and core_out.request_id in prompt_logprobs:  # sample 0's
                self.states[request_id].output.prompt_logprobs = prompt_logprobs[
                    core_out.request_id
                ]
            touched[request_id] = self.states[request_id].output
        for request_id, output in touched.items():
            if self.states[request_id].num_unfinished == 0:
                output.finished = True
                del self.states[request_id]
        return list(touched.values()), stopped

    def _process_one(self, core_out: EngineCoreOutput, stopped: list[str]) -> str:
        request_id, index = self.child_to_parent[core_out.request_id]
        state = self.states[request_id]
        seq = state.sequences[index]
        if index == 0:
            state.output.num_cached_tokens = core_out.num_cached_tokens
        out = seq.output
        reason = core_out.finish_reason
        for i, token_id in enumerate(core_out.new_token_ids):
            out.token_ids.append(token_id)
            if core_out.new_logprobs is not None and out.logprobs is not None:
                out.logprobs.append(core_out.new_logprobs[i])
            if seq.detokenizer is not None and seq.detokenizer.add_token(token_id):
                if reason is None:  # a stop string: the core does not know it ended
                    stopped.append(core_out.request_id)
                reason = FinishReason.STOP
                out.stop_reason = seq.detokenizer.stop_reason
                break
        if seq.detokenizer is not None:
            out.text = seq.detokenizer.text
        if reason is not None:
            out.finish_reason = str(reason)
            if out.stop_reason is None and reason == FinishReason.STOP:
                out.stop_reason = out.token_ids[-1]
            state.num_unfinished -= 1
            self.child_to_parent.pop(core_out.request_id)
        return request_id


class LLMEngine:
    """An EngineCore in this process, with the frontend's OutputProcessor around it."""

    def __init__(self, core: EngineCore, tokenizer, fold_ids_at: int | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        eos = core.config.model_config.eos_token_ids
        self.processor = OutputProcessor(tokenizer, eos, fold_ids_at)
        self.gc = FrozenWhileBusy()

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        return self.processor.tokenize(prompt)

    def add_request(
        self, request_id: str, prompt: str | dict, params: SamplingParams, priority: int = 0
    ) -> None:
        """Validate, then queue `params.n` sequences; nothing is queued if anything is wrong."""
        text, ids = self.processor.tokenize(prompt)
        self.core.validate(ids, params)
        for child in self.processor.add_request(request_id, text, ids, params, priority):
            self.core.add_request(child)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort_request(request_id))
        self.gc.track(self.has_unfinished_requests)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests

    @property
    def states(self):
        return self.processor.states

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutputs it advanced (finished ones last seen here).
        From the first step with requests to the last one done, the heap is frozen (self.gc)."""
        self.gc.track(self.has_unfinished_requests)
        core_outputs = self.core.step()
        prompt_logprobs = self.core.scheduler.take_prompt_logprobs()
        outputs, stopped = self.processor.process(core_outputs, prompt_logprobs)
        if stopped:
            self.core.abort_requests(stopped, FinishReason.STOP)
        self.gc.track(self.has_unfinished_requests)
        return outputs
