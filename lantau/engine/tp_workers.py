"""Tensor parallelism in the engine: ranks 1..N-1 as worker processes, each with its own
ModelRunner over its slice of the model (lantau/model/parallel.py), driven in lockstep by rank
0's, which the engine core owns:

    engine core (rank 0)                      worker (rank r)
      scheduler.schedule() -> out
      runner.launch(out) ──── out ─────────►    runner.launch(out)
        forward: all-reduces, all-gather ◄══►     forward: the same collectives
      runner.sample(step) ─── serial ──────►    runner.sample(step)
      runner.collect(step) ── serial ──────►    runner.collect(step)

Every runner call rank 0 makes (`SplitRunner`), each worker makes with the same arguments in
the same order (one typed message a call, `WorkerMessage`, as msgpack: a 384-row step encodes
~7x faster than as a pickle on rank 0's side, 37 against 254 us on a CI core), so the ranks'
request states, KV caches (each its own heads) and sampled tokens stay the same: the logits are
all-gathered whole on every rank, and the samplers' and the requests' generators are seeded
alike. Only rank 0's outputs are used; only rank 0 schedules.

Start-up: every rank builds its slice of the model first (no collective yet: a rank that fails
there is reported, not waited on), then the group forms, and the KV cache is sized to what the
tightest rank holds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from lantau.config import EngineConfig
from lantau.model.parallel import TensorParallel, init_tensor_parallel
from lantau.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


# -- what rank 0 sends its workers: each one call of their runner's (msgpack, tagged) --------


class Launch(msgspec.Struct, tag=True, array_like=True):
    out: SchedulerOutput  # the step rank 0 scheduled


class Sample(msgspec.Struct, tag=True, array_like=True):
    serial: int  # the launch it samples (LaunchedStep.serial)


class Collect(msgspec.Struct, tag=True, array_like=True):
    serial: int


class CaptureCudaGraphs(msgspec.Struct, tag=True, array_like=True):
    pass


class UseCopyStreams(msgspec.Struct, tag=True, array_like=True):
    on: bool


class Adapter(msgspec.Struct, tag=True, array_like=True):
    name: str
    path: str  # "": unload


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


WorkerMessage = Launch | Sample | Collect | CaptureCudaGraphs | UseCopyStreams | Adapter | Stop


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU (of those visible), or the CPU."""
    if config.device.startswith("cuda"):
        return torch.device("cuda", rank)
    return torch.device(config.device)


def check_devices(config: EngineConfig, num_gpus: int) -> None:
    """ValueError when the ranks would not each have a GPU of their own."""
    if config.device.startswith("cuda") and config.tensor_parallel_size > num_gpus:
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs, one a "
            f"rank; {num_gpus} visible (CUDA_VISIBLE_DEVICES)"
        )


def share_cpu_threads(config: EngineConfig) -> None:
    """On the CPU (gloo: the tests' ranks), each rank takes its share of the cores: two ranks
    of two threads each on two cores ran a token in 31 ms, of one thread each in 8 ms."""
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))


def agree_num_blocks(num_blocks: int) -> int:
    """The fewest KV blocks any rank holds (every rank calls this)."""
    t = torch.tensor([num_blocks], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


class Workers:
    """Ranks 1..N-1 of a tensor-parallel engine: their processes and a pipe to each."""

    def __init__(self, config: EngineConfig, source) -> None:
        if torch.distributed.is_initialized():
            raise RuntimeError(
                "this process is in a tensor-parallel group already: one split engine a "
                "process (on the CPU, a stopped one's group is left; on GPUs it stays until "
                "the process exits)"
            )
        self.size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="lantau-tp-")
        self.address = f"file://{self._dir}/rendezvous"
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.processes = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=run_worker,
                args=(config, source, rank, self.address, theirs, os.getpid()),
                name=f"lantau-tp-rank{rank}",
                daemon=True,
            )
            with _children_allowed():
                process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        self.stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        threading.Thread(target=self._watch, name="lantau-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """A worker that dies leaves rank 0 waiting in its next collective (NCCL: until the
        group's timeout): a served engine core exits at once instead, so its server reports
        the engine dead and fails the requests in flight (gloo raises in rank 0 by itself)."""
        processes = list(self.processes)
        ready = multiprocessing.connection.wait([p.sentinel for p in processes])
        if self.stopping:
            return
        dead = next(p for p in processes if p.sentinel in ready)
        dead.join(1.0)  # its exit code
        logger.error("tensor-parallel worker %s exited (code %s); the engine cannot go on",
                     dead.name, dead.exitcode)  # fmt: skip
        from lantau.engine.core_process import CORE_PROCESS_NAME

        if multiprocessing.current_process().name == CORE_PROCESS_NAME:
            os._exit(1)

    def wait_built(self) -> None:
        """Wait until every worker has its slice of the model; RuntimeError with the first
        failure (the workers stopped)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(max(deadline - time.monotonic(), 0)):
                self.stop()
                raise RuntimeError(f"tensor-parallel rank {rank} did not start in time")
            try:
                status, detail = pipe.recv()
            except EOFError:
                status, detail = "error", "its process exited"
            if status != "built":
                self.stop()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def send(self, message: WorkerMessage) -> None:
        data = self._encoder.encode(message)  # once for every worker
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def stop(self) -> None:
        self.stopping = True
        stop = self._encoder.encode(Stop())
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # a worker already gone
                pipe.send_bytes(stop)
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.processes = [], []
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def _children_allowed():
    """NOTE: a served engine core is a daemonic process (it must not outlive the server), and
    multiprocessing refuses children to those; its workers are safe to start all the same:
    each exits as soon as the core is gone (its watchdog), and a core that exits normally
    terminates them first (they are daemonic themselves)."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def stop_split_engine(workers: Workers) -> None:
    """Rank 0's end: its workers stopped, its side of the group left (another split engine
    may start in this process after it, on the CPU)."""
    workers.stop()
    leave_group()


def leave_group() -> None:
    """Destroy this process's group, but for NCCL's: destroying one whose collectives were
    captured in CUDA graphs can hang (pytorch#115388), so a GPU process keeps its group until
    it exits (one split engine a process there)."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "nccl":
        torch.distributed.destroy_process_group()


class SplitRunner:
    """Rank 0's ModelRunner with each call that moves the ranks' state repeated on the
    workers; everything else is the runner's own (attribute access passes through)."""

    def __init__(self, runner, workers: Workers) -> None:
        self.runner = runner
        self.workers = workers
        self._num_launched = 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def launch(self, out):
        self.workers.send(Launch(out))
        step = self.runner.launch(out)
        step.serial = self._num_launched  # sample and collect name it by this
        self._num_launched += 1
        return step

    def sample(self, step) -> None:
        if step.sample_ids:
            self.workers.send(Sample(step.serial))
        self.runner.sample(step)

    def collect(self, step):
        if step.sample_ids:
            self.workers.send(Collect(step.serial))
        return self.runner.collect(step)

    def execute(self, out):
        step = self.launch(out)
        self.sample(step)
        return self.collect(step)

    def capture_cuda_graphs(self) -> None:
        self.workers.send(CaptureCudaGraphs())
        self.runner.capture_cuda_graphs()

    def use_copy_streams(self, on: bool) -> None:
        self.workers.send(UseCopyStreams(on))
        self.runner.use_copy_streams(on)

    def load_adapter(self, name: str, path: str) -> None:
        self.runner.load_adapter(name, path)  # rank 0 first: a bad adapter stops here
        self.workers.send(Adapter(name, path))

    def unload_adapter(self, name: str) -> None:
        self.runner.unload_adapter(name)
        self.workers.send(Adapter(name, ""))


def run_worker(
    config: EngineConfig, source, rank: int, address: str, pipe: Connection, parent: int
) -> None:
    """A worker process: build this rank's slice, join the group, then repeat rank 0's
    runner calls until told to stop (or orphaned)."""
    from lantau.engine.core_process import exit_with_parent
    from lantau.model.loader import build_model
    from lantau.runner.memory import engine_memory_baseline
    from lantau.runner.model_runner import ModelRunner

    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    share_cpu_threads(config)
    device = rank_device(config, rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        baseline = engine_memory_baseline(config, device)
        tp = TensorParallel(rank, config.tensor_parallel_size)
        model = build_model(
            source, config.model_config, getattr(torch, config.dtype), device, config.seed,
            ops=config.attention_backend, max_positions=config.scheduler.max_model_len,
            kernels=config.kernels, tp=tp, lora_modules=config.lora_modules,
            max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
        )  # fmt: skip
    except Exception as e:  # reported: rank 0 stops waiting and fails its start with it
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("built", None))
    init_tensor_parallel(rank, config.tensor_parallel_size, address, device)
    num_blocks = agree_num_blocks(
        config.cache.num_blocks or ModelRunner.num_kv_blocks(config, model, baseline)
    )
    from lantau.structured import model_tokenizer_json

    runner = ModelRunner(
        config.with_num_blocks(num_blocks), model, num_blocks, device,
        functools.partial(model_tokenizer_json, source),
    )  # fmt: skip
    _serve_rank_zero(runner, pipe)
    leave_group()


def _serve_rank_zero(runner, pipe: Connection) -> None:
    """Make each runner call rank 0 sends, in order, until Stop (or rank 0 is gone)."""
    steps: dict[int, object] = {}  # launched steps with rows to sample, by serial
    num_launched = 0
    decoder = msgspec.msgpack.Decoder(WorkerMessage)
    while True:
        try:
            msg = decoder.decode(pipe.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, Launch):
            step = runner.launch(msg.out)
            if step.sample_ids:
                steps[num_launched] = step
            num_launched += 1
        elif isinstance(msg, Sample):
            runner.sample(steps[msg.serial])
        elif isinstance(msg, Collect):
            runner.collect(steps.pop(msg.serial))
        elif isinstance(msg, CaptureCudaGraphs):
            runner.capture_cuda_graphs()
        elif isinstance(msg, UseCopyStreams):
            runner.use_copy_streams(msg.on)
        elif isinstance(msg, Adapter):
            if msg.path:
                runner.load_adapter(msg.name, msg.path)
            else:
                runner.unload_adapter(msg.name)
        else:  # Stop
            return
