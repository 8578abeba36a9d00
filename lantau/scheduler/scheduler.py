"""Token-budget scheduler: no prefill or decode phase (plain Python, no torch).

Each step every scheduled request's `num_computed_tokens` moves towards its `num_tokens`:
a whole prompt, a chunk of it, or the one token sampled last step. Prefix-cache hits count as
computed. Running requests go first, highest priority first; when blocks run out the lowest
priority (then newest) running request is preempted and later recomputed. Waiting requests are
admitted FCFS within a priority while the token budget and `max_num_seqs` allow, and, under the
"guaranteed_no_evict" policy, only while the blocks that every admitted request may still need
(prompt + max_tokens, within max_model_len) fit the cache: then no request is ever preempted.

Steps may overlap: the engine schedules step N+1 while step N runs, so a request whose token
from step N is still pending is scheduled one token ahead (`Request.num_pending_tokens`). A
request that step N finishes by its stop token wastes that one row. One that step N finishes
by length is known to end: step N+1 skips it, and a waiting request may take its seat
(`max_num_seqs` counts the requests a step can still schedule), so that a batch whose requests
all end together is followed at once by the next prompts' prefill, not by an empty step while
the host collects, frees and schedules.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from lantau.config import SchedulerConfig
from lantau.kv_cache.manager import KVCacheManager, cdiv
from lantau.request import FinishReason, Request, RequestStatus
from lantau.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}  # every unfinished request
        # NOTE: a heap with lazy deletion: entries whose request left the waiting state are
        # skipped when they reach the top.
        self._waiting: list[tuple[tuple[int, int], Request]] = []
        self.running: list[Request] = []
        self._arrival = itertools.count()
        self._finished_since_last_step: set[str] = set()
        # request id -> its prompt's logprobs, from its first output until taken (take_prompt_
        # logprobs): beside the outputs, not in each, which cross to the frontend every step
        self.prompt_logprobs: dict[str, list] = {}
        self.num_preemptions = 0  # since start, for stats and tests
        self.num_prefix_queried_tokens = 0  # since start: tokens of admitted requests ...
        self.num_prefix_hit_tokens = 0  # ... and those of them the prefix cache held
        self.newly_scheduled: list[str] = []  # scheduled for the first time; the core drains it
        # the tokens a step with prompt tokens really computes, given its own (its CUDA graph
        # bucket's padding; the runner's, set once its graphs are captured): a prompt's chunk
        # grows into that padding instead of leaving it to filler tokens
        self.padded_step_tokens: Callable[[int], int] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_partial_prompts(self) -> bool:
        """A running request has more than its next token to compute (a prompt not all
        scheduled yet, or one resumed after preemption): the next step has prompt tokens."""
        return any(
            r.num_tokens + r.num_pending_tokens - r.num_computed_tokens > 1 for r in self.running
        )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        request.arrival_seq = next(self._arrival)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (request.priority_key, request))

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            request = self._waiting[0][1]
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                return request
            heapq.heappop(self._waiting)  # stale: admitted or finished since
        return None

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """End requests at any point (abort, stop string); frees their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            self.kv_cache.free(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            self._finished_since_last_step.add(request_id)
            finished.append(request)
        return finished

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget, num_ending = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget, num_ending)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """Schedules running requests first: (budget left, requests passed over because the
        step in flight ends them)."""
        self.running.sort(key=lambda r: r.priority_key)
        i = num_ending = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._ends_in_flight(request):
                i += 1  # nothing left to compute
                num_ending += 1
                continue
            num_tokens = request.num_tokens + request.num_pending_tokens
            remaining = num_tokens - request.num_computed_tokens
            num_new = min(self._chunk(remaining, self._num_scheduled(budget)), budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                # NOTE: self.running is sorted, so the victim is never a request already
                # scheduled in this step; it may be `request` itself.
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            out.scheduled_cached_reqs.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            self._commit(request, num_new, out)
            budget -= num_new
            i += 1
        return budget, num_ending

    @staticmethod
    def _ends_in_flight(request: Request) -> bool:
        """Its tokens in flight reach its length limit: the step that samples them ends it."""
        num_tokens = request.num_tokens + request.num_pending_tokens
        return request.num_pending_tokens > 0 and num_tokens >= request.max_num_tokens

    def _num_scheduled(self, budget: int) -> int:
        """Tokens already in this step, from the budget left."""
        return self.config.max_num_batched_tokens - budget

    def _chunk(self, remaining: int, num_scheduled: int) -> int:
        """A request's prompt tokens this step, before the budget: a prompt longer than the
        threshold is cut into equal chunks no longer than it (467 at 256: 234 + 233, so that
        neither step is much longer than the other), except that a chunk takes the padding
        its step would compute anyway (padded_step_tokens; beside 25 decodes, 234 tokens make
        a 259-token step padded to 320, so the chunk takes 295 and the next 172)."""
        cap = self.config.long_prefill_token_threshold
        if not cap or remaining <= cap or not self.config.enable_chunked_prefill:
            return remaining
        chunk = cdiv(remaining, cdiv(remaining, cap))
        if self.padded_step_tokens is not None:
            padded = self.padded_step_tokens(num_scheduled + chunk)
            chunk = max(chunk, min(remaining, padded - num_scheduled))
        return chunk

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.add(request.request_id)
        self._push_waiting(request)

    def _blocks_to_finish(self, request: Request) -> int:
        """Blocks the request may still take: up to its last possible token."""
        held = len(self.kv_cache.req_to_blocks.get(request.request_id, ()))
        return max(cdiv(request.max_num_tokens, self.kv_cache.block_size) - held, 0)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, num_ending: int) -> None:
        no_evict = self.config.policy == "guaranteed_no_evict"
        # blocks the running requests may still take; admission keeps them free
        reserved = sum(self._blocks_to_finish(r) for r in self.running) if no_evict else 0
        # the seats of requests that end in flight are free for this step (their blocks are
        # not: they go back when their last token is collected)
        seats = self.config.max_num_seqs - len(self.running) + num_ending
        while budget > 0 and seats > 0:
            request = self._peek_waiting()
            if request is None or request.num_pending_tokens:
                # NOTE: a request preempted while a token of it was in flight waits for it
                return
            if (
                no_evict
                and reserved + self._blocks_to_finish(request) > self.kv_cache.num_free_blocks
            ):
                return  # FCFS: nothing behind it jumps the queue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new = self._chunk(request.num_tokens - num_cached, self._num_scheduled(budget))
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = budget
            request.num_computed_tokens = num_cached
            if self.kv_cache.allocate_slots(request, num_new, computed_blocks) is None:
                request.num_computed_tokens = 0
                return
            heapq.heappop(self._waiting)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                self.newly_scheduled.append(request.request_id)
            self.num_prefix_queried_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_cached
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache.block_ids(request.request_id),
                    num_computed_tokens=num_cached,
                    eos_token_ids=tuple(request.eos_token_ids),
                )
            )
            self._commit(request, num_new, out)
            budget -= num_new
            seats -= 1
            if no_evict:
                reserved += self._blocks_to_finish(request)

    def _commit(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        # NOTE: counted as computed at schedule time: the runner writes these tokens' KV in
        # this step, and the next schedule may be built before this step's results return.
        out.num_scheduled_tokens[request.request_id] = num_new
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens:
            request.num_pending_tokens += 1  # this step samples its next token

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens; finish requests on stop tokens or length.

        A request preempted after this step was scheduled still takes its token (it resumes
        from all of its tokens); a finished or aborted one does not.
        """
        outputs = []
        prompt_logprobs = result.prompt_logprobs
        for request_id, token_id in result.sampled_token_ids.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished or aborted while the step ran
            request.num_pending_tokens -= 1
            request.append_output_token(token_id)
            reason = request.check_stop_token()
            logprobs = result.logprobs.get(request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    new_logprobs=None if logprobs is None else [logprobs],
                    finish_reason=reason,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
            if prompt_logprobs and request_id in prompt_logprobs:
                self.prompt_logprobs[request_id] = prompt_logprobs[request_id]
            if reason is not None:
                self.finish_requests([request_id], reason)
        return outputs

    def take_prompt_logprobs(self) -> dict[str, list]:
        """The prompt logprobs of the requests whose first output came since the last call."""
        taken, self.prompt_logprobs = self.prompt_logprobs, {}
        return taken

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens > 0
            assert request.num_computed_tokens <= request.num_tokens + request.num_pending_tokens
        held = set(self.kv_cache.req_to_blocks)
        assert held == {r.request_id for r in self.running}, "blocks held outside running"
