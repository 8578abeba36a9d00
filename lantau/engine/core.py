"""The engine core: owns the device, the scheduler and the runner.

step() with overlapped scheduling (the default), step N in flight on the device:

    schedule N+1 -> launch N+1 (queued behind N) -> collect N (waits for N's token ids only)
    -> update N (stop checks, outputs) -> sample N+1 (queued) -> return N's outputs

so the host schedules and prepares step N+1, and turns step N's tokens into outputs, while the
device runs. Without it (`async_scheduling=False`): schedule -> launch -> sample -> collect ->
update, one step at a time.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable

import torch

from lantau.config import EngineConfig
from lantau.engine.args import resolve_device
from lantau.engine.pacer import StepKey, StepPacer, step_key
from lantau.engine.tp_workers import (
    SplitRunner,
    Workers,
    agree_num_blocks,
    check_devices,
    share_cpu_threads,
    stop_split_engine,
)
from lantau.errors import InvalidRequestError
from lantau.kv_cache.manager import KVCacheManager, cdiv
from lantau.model.loader import ModelSource, PendingWeights, build_model, load_in_background
from lantau.model.parallel import SINGLE, TensorParallel, init_tensor_parallel
from lantau.request import FinishReason, Request, SamplingParams, validate_prompt
from lantau.runner.memory import engine_memory_baseline
from lantau.runner.model_runner import LaunchedStep, ModelRunner
from lantau.scheduler.output import EngineCoreOutput, SchedulerOutput
from lantau.scheduler.scheduler import Scheduler
from lantau.structured import model_tokenizer_json

# the served loop paces its steps only while requests keep arriving: with none in this long
# (a burst's tail, a quiet server) no arrival is there to join the next step, and steps launch
# back to back as offline, with no launch cut close to the step before's end
PACE_WINDOW_S = 1.0

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        paced: bool = False,
        defer_weights: bool = False,
    ) -> None:
        """`defer_weights`: return while an engine folder's weights still load in the
        background, its tensors zeroed first; the caller must call `wait_weights` before any
        step whose results matter (the served core's warm-up on CUDA runs before it:
        warmup.py)."""
        config = resolve_device(config, torch.cuda.is_available())
        self.device = torch.device(config.device)
        # seconds of each start-up stage, in order (the server reports them)
        self.startup_s: dict[str, float] = {}
        tp, self.workers = SINGLE, None
        if config.tensor_parallel_size > 1:  # ranks 1.. build their slices meanwhile
            check_devices(config, torch.cuda.device_count())
            share_cpu_threads(config)
            tp = TensorParallel(0, config.tensor_parallel_size)
            self.workers = Workers(config, source)
            stop = weakref.finalize(self, stop_split_engine, self.workers)
        self._pending_weights: PendingWeights | None = None
        try:
            self._start(config, source, tp, paced, defer_weights)
            if not defer_weights:
                self.wait_weights()
        except BaseException:
            if self.workers is not None:
                stop()
            raise

    def _start(
        self, config: EngineConfig, source, tp: TensorParallel, paced: bool, defer: bool
    ) -> None:
        dtype = getattr(torch, config.dtype)
        clock = time.perf_counter()
        # an engine folder's weights load on a thread while the CUDA graphs are captured,
        # which do not depend on the weights' values; the KV cache is sized before the load
        # starts: that first forward pass pages in the CUDA libraries and kernels, which from
        # a cold disk would wait behind the weights' reads
        background = source.kind == "engine"
        baseline = engine_memory_baseline(config, self.device)
        model = build_model(
            source,
            config.model_config,
            dtype,
            self.device,
            config.seed,
            ops=config.attention_backend,
            max_positions=config.scheduler.max_model_len,
            kernels=config.kernels,
            load=not background,
            tp=tp,
            lora_modules=config.lora_modules,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
        )
        if self.workers is not None:
            self.workers.wait_built()
            init_tensor_parallel(0, tp.size, self.workers.address, self.device)
        self.startup_s["model" if background else "weights"] = time.perf_counter() - clock
        clock = time.perf_counter()
        num_blocks = config.cache.num_blocks or ModelRunner.num_kv_blocks(config, model, baseline)
        if self.workers is not None:  # what the tightest rank holds
            num_blocks = agree_num_blocks(num_blocks)
        self.startup_s["kv_profile"] = time.perf_counter() - clock
        pending = load_in_background(model, source, zero=defer) if background else None
        needed = cdiv(config.scheduler.max_model_len, config.cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks, fewer than the {needed} one request of "
                f"max_model_len={config.scheduler.max_model_len} may need; lower max_model_len "
                "or give the cache more memory"
            )
        self.config = config.with_num_blocks(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.cache.block_size)
        self.kv_cache = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.num_generated_tokens = 0  # since start, for stats
        self.num_steps = 0  # steps launched, since start
        # called with each step's record (core_process.StepLog: --step-log)
        self.on_step: Callable[[dict], None] | None = None
        self.last_batch_size = 0  # requests scheduled by the last step, for stats
        self.last_num_batched_tokens = 0
        self.runner = ModelRunner(
            self.config,
            model,
            num_blocks,
            self.device,
            functools.partial(model_tokenizer_json, source),
        )
        if self.workers is not None:  # each call that moves state, repeated on the workers
            self.runner = SplitRunner(self.runner, self.workers)
        self.async_scheduling = config.async_scheduling
        # the step on the device whose tokens have not been collected yet
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._collected_early: list[EngineCoreOutput] = []  # see add_request
        # late scheduling (lantau/engine/pacer.py) for the served loop (`paced`), which calls
        # schedule_at(); offline steps launch back to back and are not timed
        paced = paced and self.device.type == "cuda" and self.async_scheduling
        self.pacer = StepPacer() if paced else None
        self.last_arrival_s = float("-inf")  # time.monotonic() of the last add_request
        # the step in flight's shape, events and number
        self._timed: tuple[StepKey, StepTimer, int] | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if config.attention_backend != "triton":
                raise ValueError("CUDA graphs need attention_backend='triton' (or enforce_eager)")
            clock, cpu = time.perf_counter(), time.thread_time()
            try:
                self.runner.capture_cuda_graphs()
            except RuntimeError as e:
                if pending is None or pending.done:
                    raise
                logger.warning("CUDA graph capture beside the weights' load failed (%s); "
                               "capturing again after it", e)  # fmt: skip
                pending.wait()
                self.runner.capture_cuda_graphs()
            self.startup_s["cuda_graphs"] = time.perf_counter() - clock
            # this thread's CPU time in it: far below the wall time, it waited (the GIL, a
            # busy CPU, page faults on a cold disk) rather than worked
            self.startup_s["cuda_graphs_cpu"] = time.thread_time() - cpu
            self.scheduler.padded_step_tokens = self.runner.mixed_graphs.padded_tokens
        self._pending_weights = pending

    def wait_weights(self) -> None:
        """Wait for the weights' background load, if one is still pending (an engine folder's,
        started while the KV cache was sized); its seconds go into startup_s."""
        pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        clock = time.perf_counter()
        pending.wait()
        self.startup_s["weights"] = pending.seconds  # beside the stages before
        self.startup_s["weights_wait"] = time.perf_counter() - clock

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        vocab_size = self.config.model_config.vocab_size
        validate_prompt(prompt_token_ids, self.config.scheduler.max_model_len, vocab_size)
        if params is not None:
            params.check_vocab(vocab_size)
            if params.lora is not None and params.lora not in self.runner.lora_slots:
                served = ", ".join(self.runner.lora_slots) or "none"
                raise InvalidRequestError(
                    "lora", f"{params.lora!r} is not a LoRA adapter of this engine ({served})"
                )

    def add_request(self, request: Request) -> None:
        self.last_arrival_s = time.monotonic()
        self.validate(request.prompt_token_ids, request.sampling_params)
        if request.sampling_params.structured_outputs is not None:
            self.runner.grammars.prepare()  # the first: its tokenizer (InvalidRequestError)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        request.max_model_len = self.config.scheduler.max_model_len
        if self._in_flight is not None and request.request_id in self._in_flight[1].sample_ids:
            # NOTE: a finished request of the same id still has a token in flight; collect
            # it now, or it would land on the new one
            self._collected_early += self._update(*self._in_flight)
            self._in_flight = None
            if self.pacer is not None:
                self.pacer.forget()
                self._timed = None
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self.scheduler.finish_requests(request_ids, reason)

    def load_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter into a free slot, on every rank (ModelLoadError or ValueError: why
        not; nothing changes then)."""
        from lantau.model.lora import check_name

        if self.runner.adapter_slots is None:
            raise ValueError("this engine has no LoRA adapter slots (--max-loras)")
        check_name(name, "lora adapter")
        self.runner.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """A LoRA adapter out of its slot (ValueError: unknown, or requests still use it)."""
        if name not in self.runner.lora_slots:
            raise ValueError(f"lora adapter {name!r} is not loaded")
        users = [r for r in self.scheduler.requests.values() if r.sampling_params.lora == name]
        if users:
            raise ValueError(f"lora adapter {name!r} is in use by {len(users)} request(s)")
        self.runner.unload_adapter(name)
        # its cached blocks stay unreachable: a later adapter of this name hashes apart
        self.kv_cache.lora_epochs[name] = self.kv_cache.lora_epochs.get(name, 0) + 1

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix not in use; returns the number of blocks forgotten."""
        return self.kv_cache.pool.reset_prefix_cache()

    @property
    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished
            or self._in_flight is not None
            or bool(self._collected_early)
        )

    def schedule_at(self, arrived: bool = False) -> float | None:
        """The time.monotonic() at which to call step() next so that it launches just as
        the step in flight ends (requests arriving until then join it); None: at once.
        `arrived`: requests came in since the last step (the next one has prompt tokens)."""
        if self.pacer is None or (self.scheduler.num_waiting and not arrived):
            return None  # NOTE: with requests waiting for room, arrivals gain nothing
        if not arrived and time.monotonic() - self.last_arrival_s > PACE_WINDOW_S:
            return None  # none is coming (PACE_WINDOW_S)
        return self.pacer.schedule_at(arrived or self.scheduler.has_partial_prompts)

    def step(self) -> list[EngineCoreOutput]:
        """Advance by one step; returns the outputs of the step that completed (with
        overlapped scheduling, the one launched by the previous call)."""
        started = time.monotonic()
        out = self.scheduler.schedule()
        self.last_batch_size = len(out.num_scheduled_tokens)
        self.last_num_batched_tokens = out.total_num_scheduled_tokens
        timer = StepTimer() if self.pacer is not None else None
        # for the step log: the step in flight had ended, its ids copied, before this launch
        # (the device idle until it: the host the slower side)
        in_flight = self._in_flight if self.on_step is not None else None
        behind = in_flight is not None and in_flight[1].sampled.copied()
        step = self.runner.launch(out)
        launched_at = time.monotonic()
        if not self.async_scheduling:  # one step at a time: its own outputs
            self.runner.sample(step)
            outputs = self._update(out, step)
            self.num_steps += 1
            if self.on_step is not None:
                record = self._step_record(
                    out, started, launched_at, True, None, False, self.num_steps
                )
                self.on_step(record)
            return outputs
        key = step_key(self.last_batch_size, self.last_num_batched_tokens)
        outputs, self._collected_early = self._collected_early, []
        done_at, waited = launched_at, True  # nothing in flight: this step starts at once
        collected = None  # the number of the step this call collected, if any
        if self._in_flight is not None:
            outputs += self._update(*self._in_flight)
            done_at, waited = time.monotonic(), self._in_flight[1].sampled.waited
            collected = self.num_steps
        self.runner.sample(step)
        self._in_flight = (out, step) if step.sample_ids else None
        self.num_steps += 1
        timed = None  # (number, device seconds) of the step just collected, where timed
        if self.pacer is not None:
            if self._timed is not None:  # the step just collected
                timed = self._timed[2], self._timed[1].time(self.pacer, self._timed[0])
            self._timed = None
            if step.sample_ids:
                self.pacer.launched(key, launched_at - started)
                timer.stop()
                self._timed = (key, timer, self.num_steps)
            self.pacer.collected(done_at, waited, key if self._in_flight else None)
        if self.on_step is not None:
            record = self._step_record(out, started, launched_at, waited, timed, behind, collected)
            self.on_step(record)
        return outputs

    def _step_record(
        self, out: SchedulerOutput, started, launched_at, waited, timed, behind: bool,
        collected: int | None,
    ) -> dict:  # fmt: skip
        """One step: when it began (time.monotonic()), the host's time to launch it and the
        whole call's (with overlapped steps, the wait for the step before included), its
        batch; whether the step before had ended before its launch; and the device time of
        the step it collected (CUDA events, when paced); `collected`: the number of the step
        whose results the call took (its own one at a time; the one in flight overlapped;
        None where that step sampled nothing, a prompt's chunk alone)."""
        now = time.monotonic()
        return {
            "step": self.num_steps,
            "t": round(started, 6),
            "host_ms": round(1e3 * (launched_at - started), 3),
            "call_ms": round(1e3 * (now - started), 3),
            "reqs": self.last_batch_size,
            "tokens": self.last_num_batched_tokens,
            "decodes": sum(1 for n in out.num_scheduled_tokens.values() if n == 1),
            "new": len(out.scheduled_new_reqs),
            "waited": waited,  # the host waited for the step before: the device was busy
            "behind": behind,  # the step before had ended before this launch: the device idled
            "timed_step": timed[0] if timed else None,
            "device_ms": round(1e3 * timed[1], 3) if timed and timed[1] is not None else None,
            "collected": collected,
        }

    def _update(self, out: SchedulerOutput, step: LaunchedStep) -> list[EngineCoreOutput]:
        result = self.runner.collect(step)
        self.num_generated_tokens += len(result.sampled_token_ids)
        return self.scheduler.update(out, result)


class StepTimer:
    """CUDA events around a step on the current stream: from where the stream reaches the
    step's launch (the end of the step before it) to the end of its sampling."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def stop(self) -> None:
        self.end.record()

    def time(self, pacer: StepPacer, key: StepKey) -> float | None:
        """The step's device time into the pacer, and returned (once collected, its events
        are done)."""
        if not self.end.query():
            return None
        seconds = self.start.elapsed_time(self.end) / 1000
        pacer.timed(key, seconds)
        return seconds
