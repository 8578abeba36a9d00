"""Messages between the frontend and the engine-core process (msgspec over ZeroMQ).

Frontend -> core: AddRequests, AbortRequests, LoadAdapter. Core -> frontend: CoreOutputs, one
per step (only the requests that advanced: diffs, not whole states), and one at least every
second so the frontend's watchdog sees the core is alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from lantau.request import FinishReason, Logprob, Request, SamplingParams
from lantau.scheduler.output import EngineCoreOutput

HEARTBEAT_S = 0.5  # an idle core still reports this often: the frontend's watchdog


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    priority: int

    @classmethod
    def of(cls, request: Request) -> NewRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            request.priority,
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_ids,
            priority=self.priority,
        )


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


class LoadAdapter(msgspec.Struct, tag=True, array_like=True):
    """A LoRA adapter into a free slot at runtime (path "": unload it); the core answers in
    CoreOutputs.adapter_calls under `call_id`."""

    call_id: str
    name: str
    path: str = ""


@dataclass
class StepStats:
    """The core's state after a step: for readiness, metrics and the web page."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks in use
    num_free_blocks: int = 0
    num_preemptions: int = 0  # since start
    num_generated_tokens: int = 0  # since start
    timestamp: float = 0.0  # time.time() of the step
    # for /metrics: counts since start (exact however many steps sent no message) ...
    num_steps: int = 0
    step_time_total_s: float = 0.0  # wall time inside EngineCore.step()
    num_prefix_queried_tokens: int = 0  # tokens of admitted requests looked up in the cache
    num_prefix_hit_tokens: int = 0  # ... of which were found there
    # ... and the last step's
    step_time_s: float = 0.0
    batch_size: int = 0  # requests scheduled
    num_batched_tokens: int = 0  # tokens scheduled


class CoreOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: StepStats
    # requests the core could not take (bad input that slipped past the frontend)
    rejected: dict[str, str] = msgspec.field(default_factory=dict)
    # request id -> time.monotonic() of the step that first scheduled it (for queue times;
    # CLOCK_MONOTONIC is one clock for every process of the machine)
    scheduled: dict[str, float] = msgspec.field(default_factory=dict)
    # request id -> time.monotonic() when the core took it off its socket (dispatch times)
    received: dict[str, float] = msgspec.field(default_factory=dict)
    # the core's garbage collections since its last message: (generation, seconds) each
    gc_pauses: list[tuple[int, float]] = msgspec.field(default_factory=list)
    # request id -> its prompt's logprobs, with its first output (Scheduler.prompt_logprobs)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = msgspec.field(
        default_factory=dict
    )
    # LoadAdapter call id -> "" done, else why not
    adapter_calls: dict[str, str] = msgspec.field(default_factory=dict)


class CoreReady(msgspec.Struct, array_like=True):
    num_blocks: int
    max_model_len: int
    error: str | None = None
    startup_s: dict[str, float] = {}  # seconds of each start-up stage (EngineCore.startup_s)


FrontendMessage = AddRequests | AbortRequests | LoadAdapter
