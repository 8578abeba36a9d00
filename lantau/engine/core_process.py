"""The engine core in its own process: owns the device, runs a busy loop of steps, and talks
to the frontend over two ZeroMQ sockets (requests in, per-step output diffs out)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from lantau import envs
from lantau.config import EngineConfig
from lantau.engine import import_ahead
from lantau.engine.protocol import (
    HEARTBEAT_S,
    AbortRequests,
    AddRequests,
    CoreOutputs,
    CoreReady,
    FrontendMessage,
    LoadAdapter,
    StepStats,
)
from lantau.errors import InvalidRequestError, ModelLoadError
from lantau.metrics.gc_pauses import GcPauses, freeze_startup_heap

if TYPE_CHECKING:  # NOTE: imported by the frontend; torch loads only in the core process
    from lantau.engine.core import EngineCore
    from lantau.model.source import ModelSource

logger = logging.getLogger(__name__)

CORE_PROCESS_NAME = "lantau-engine-core"  # the served engine core's process


# NOTE: test-only: a file holding seconds to sleep after each step (read at most every
# 0.2 s), so a live test can slow a served engine down and speed it up again


@dataclass
class StepClock:
    """Steps and the time spent in them since start, and the last one's."""

    num_steps: int = 0
    total_s: float = 0.0
    last_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.num_steps += 1
        self.total_s += seconds
        self.last_s = seconds


class StepLog:
    """`lantau serve --step-log FILE`: each step's record (EngineCore._step_record) as one
    JSON line with the core's model and pid, appended (every core of a repository's versions
    writes to the one file, a whole line a write)."""

    def __init__(self, path: str, model: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.prefix = {"model": model, "pid": os.getpid()}

    def __call__(self, record: dict) -> None:
        os.write(self.fd, (json.dumps({**self.prefix, **record}) + "\n").encode())


class StepDelay:
    """The test-only step delay (envs.test_step_delay_file); None of it exists unless set.
    The file holds seconds, or lines `MODEL_SUFFIX SECONDS`: only a core whose model path
    ends with MODEL_SUFFIX sleeps (one slow version of a repository's model)."""

    def __init__(self, path: str, model: str = "") -> None:
        self.path, self.model, self.seconds, self.read_at = path, model, 0.0, 0.0

    @classmethod
    def from_env(cls, model: str = "") -> StepDelay | None:
        path = envs.test_step_delay_file()
        return cls(path, model) if path else None

    def _parse(self, text: str) -> float:
        for line in text.strip().splitlines():
            suffix, _, seconds = line.strip().rpartition(" ")
            if not suffix or self.model.rstrip("/").endswith(suffix):
                return float(seconds or 0)
        return 0.0

    def sleep(self) -> None:
        now = time.monotonic()
        if now - self.read_at > 0.2:
            self.read_at = now
            try:
                with open(self.path) as f:
                    self.seconds = self._parse(f.read())
            except (OSError, ValueError):
                self.seconds = 0.0
        if self.seconds > 0:
            time.sleep(self.seconds)


def core_stats(core: EngineCore, clock: StepClock) -> StepStats:
    sched, kv = core.scheduler, core.kv_cache
    return StepStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        kv_cache_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks,
        num_preemptions=sched.num_preemptions,
        num_generated_tokens=core.num_generated_tokens,
        timestamp=time.time(),
        num_steps=clock.num_steps,
        step_time_total_s=clock.total_s,
        num_prefix_queried_tokens=sched.num_prefix_queried_tokens,
        num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
        step_time_s=clock.last_s,
        batch_size=core.last_batch_size,
        num_batched_tokens=core.last_num_batched_tokens,
    )


def run_engine_core(
    config: EngineConfig | None,
    source: ModelSource | None,
    input_addr: str,
    output_addr: str,
    spawned_at: float | None = None,
) -> None:
    """Process entry point. Exits when the frontend process goes away, however it went.
    `config` None: a standby core (async_llm.spawn_core), which takes its config and source
    as the first message. `spawned_at`: the frontend's time.monotonic() at the spawn (the
    clock is the machine's, one for both processes), for the start-up's first stage."""
    clock = time.monotonic()
    # the start-up's stages before the model: the process (interpreter, this module's
    # imports), the engine's imports (torch), a standby's wait for its config
    early = {"core_process": clock - spawned_at} if spawned_at is not None else {}
    parent = os.getppid()
    # NOTE: Ctrl-C reaches the whole process group; the frontend drains, then stops the core
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    ctx = zmq.Context()
    # NOTE: linger 0: with the frontend gone, unsent messages must not hold the exit for ever
    ctx.setsockopt(zmq.LINGER, 0)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    import_ahead.start()  # the files torch's import will read, asked of the disk at once
    try:
        import torch

        from lantau.engine.args import resolve_device
        from lantau.engine.core import EngineCore
        from lantau.engine.warmup import compiles_kernels, warm_up
        from lantau.model.kernel_cache import prehash_triton, seed_engine_kernels

        imported = time.monotonic()
        early["core_imports"] = imported - clock
        if config is None:  # a standby: the imports above ran while the frontend chose
            config, source = pickle.loads(in_sock.recv())
            early["config_wait"] = time.monotonic() - imported
        config = resolve_device(config, torch.cuda.is_available())  # "auto" chosen once
        on_cuda = config.device.startswith("cuda")
        prehash_triton(config.device)  # meanwhile: the model, the first kernel's launch
        seeded = seed_engine_kernels(source, config.device)  # before the first Triton compile
        # on CUDA an engine folder's weights may still be loading when it returns: the
        # warm-up runs beside the load (its results are thrown away), the first request after
        core = EngineCore(config, source, paced=True, defer_weights=on_cuda)
        core.startup_s = {**early, **seeded, **core.startup_s}
        warmed = compiles_kernels(core)
        if warmed:  # no kernel compiles while a user waits
            core.startup_s["warm_up"] = warm_up(core)
        core.wait_weights()
        import_ahead.record()
    except Exception as e:  # report why, then exit: the frontend fails its start with it
        out_sock.send(encoder.encode(CoreReady(0, 0, error=f"{type(e).__name__}: {e}")))
        return
    if warmed:  # from here on a compile is a gap in the warm-up
        _log_late_compiles()
    # every collection timed for /metrics, the first one the full collection of start-up's
    # objects before they are frozen out of every later walk (gc_pauses.py: one of them
    # stalled every stream ~0.1 s)
    pauses = GcPauses().install()
    if path := envs.step_log_path():  # the serving steps' records, not the warm-up's
        core.on_step = StepLog(path, core.config.model)
    frozen = freeze_startup_heap()
    logger.info("froze %d start-up objects out of the garbage collector's walks", frozen)
    core_config = core.config
    ready = CoreReady(
        core_config.cache.num_blocks, core_config.scheduler.max_model_len, None, core.startup_s
    )
    out_sock.send(encoder.encode(ready))
    _busy_loop(core, parent, in_sock, out_sock, pauses)


def _busy_loop(core: EngineCore, parent: int, in_sock, out_sock, pauses: GcPauses) -> None:
    """Take messages, step, send what the step produced (or a heartbeat), until orphaned."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(FrontendMessage)
    clock, delay = StepClock(), StepDelay.from_env(core.config.model)
    scheduled: dict[str, float] = {}  # first schedulings not sent yet
    received: dict[str, float] = {}  # requests taken, not reported yet
    last_sent = 0.0
    while os.getppid() == parent:
        rejected: dict[str, str] = {}
        calls: dict[str, str] = {}  # LoadAdapter call id -> "" or why not
        # late scheduling: take requests until the step in flight nearly ends (pacer.py)
        due = core.schedule_at() if core.has_unfinished_requests else None
        arrived = False
        while due is not None and (remaining := due - time.monotonic()) > 0:
            if in_sock.poll(int(remaining * 1000)):
                _handle(core, decoder.decode(in_sock.recv()), rejected, received, calls)
                if not arrived:  # the next step has prompt tokens: it takes the host longer
                    arrived = True
                    due = core.schedule_at(arrived=True)
            elif remaining < 1e-3:  # poll's timeout is in whole milliseconds
                time.sleep(remaining)
        timeout_ms = 0 if core.has_unfinished_requests else int(HEARTBEAT_S * 1000)
        while in_sock.poll(timeout_ms):
            _handle(core, decoder.decode(in_sock.recv()), rejected, received, calls)
            timeout_ms = 0
        outputs = []
        if core.has_unfinished_requests:
            start = time.monotonic()
            outputs = core.step()
            clock.add(time.monotonic() - start)
            if core.scheduler.newly_scheduled:
                scheduled.update(dict.fromkeys(core.scheduler.newly_scheduled, start))
                core.scheduler.newly_scheduled.clear()
            if delay is not None:
                delay.sleep()
        now = time.monotonic()
        if outputs or rejected or calls or now - last_sent >= HEARTBEAT_S:
            stats = core_stats(core, clock)
            message = CoreOutputs(
                outputs, stats, rejected, scheduled, received, pauses.drain(),
                core.scheduler.take_prompt_logprobs(), calls,
            )  # fmt: skip
            out_sock.send(encoder.encode(message))
            scheduled, received, last_sent = {}, {}, now


def _log_late_compiles():
    """From here on a Triton compile holds up a serving step (a warm-up gap): say which, and
    for how long. Returns the installed CompileWatch (None without triton)."""
    if "triton" not in sys.modules:
        return None
    from lantau.model.kernel_cache import CompileWatch

    def warn(kernel: str, seconds: float, signature: str) -> None:
        logger.warning("a serving step waited %.3f s for Triton to compile or load %s: %s",
                       seconds, kernel, signature[:400])  # fmt: skip

    return CompileWatch(warn).install()


def exit_with_parent(parent: int, poll_s: float = 0.2) -> None:
    """The watchdog: a frontend killed (SIGKILL, a crash) cannot stop its core, so the core
    stops itself as soon as it is re-parented, whatever its main thread is doing."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    logger.error("the frontend process %d is gone; the engine core exits", parent)
    os._exit(0)


def _handle(
    core: EngineCore, msg, rejected: dict[str, str], received: dict[str, float],
    calls: dict[str, str],
) -> None:  # fmt: skip
    if isinstance(msg, AddRequests):
        received.update(dict.fromkeys((new.request_id for new in msg.requests), time.monotonic()))
        for new in msg.requests:
            try:
                core.add_request(new.to_request())
            except InvalidRequestError as e:
                rejected[new.request_id] = str(e)
    elif isinstance(msg, AbortRequests):
        core.abort_requests(msg.request_ids, msg.reason)
    elif isinstance(msg, LoadAdapter):
        try:
            if msg.path:
                core.load_adapter(msg.name, msg.path)
            else:
                core.unload_adapter(msg.name)
            calls[msg.call_id] = ""
        except (ModelLoadError, ValueError) as e:
            calls[msg.call_id] = str(e)
