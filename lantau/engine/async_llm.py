"""AsyncLLM: the server's handle on an engine core running in its own process.

Tokenization, validation, detokenization and stop strings stay here (OutputProcessor), so the
core process only ever sees token ids. `generate` is an async iterator of RequestOutputs;
leaving it early (client disconnect, deadline, cancellation) aborts the request in the core,
which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from typing import NamedTuple

import jinja2
import msgspec
import orjson
import zmq
import zmq.asyncio

from lantau.config import EngineConfig
from lantau.engine.core_process import CORE_PROCESS_NAME, run_engine_core
from lantau.engine.llm_engine import OutputProcessor
from lantau.engine.protocol import (
    HEARTBEAT_S,
    AbortRequests,
    AddRequests,
    CoreOutputs,
    CoreReady,
    LoadAdapter,
    NewRequest,
    StepStats,
)
from lantau.errors import EngineStartError, InvalidRequestError
from lantau.metrics.stats import CURRENT_REQUEST, EngineMetrics, RequestTiming
from lantau.model.source import ModelSource, borrowed_vocab_size
from lantau.outputs import RequestOutput
from lantau.request import FinishReason, SamplingParams, validate_prompt
from lantau.scheduler.output import EngineCoreOutput

logger = logging.getLogger(__name__)


OFF_LOOP_CHARS = 16384  # texts longer than this are tokenized on a worker thread


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes one token stands for: its vocabulary entry's UTF-8 length
    (byte-level BPE spells each byte with a character of 1-2 bytes; SentencePiece's marks and
    <0xNN> byte tokens are longer than what they stand for)."""
    if tokenizer is None:
        return 1  # token ids only: no text prompt is tokenized
    return max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)


class EngineDeadError(RuntimeError):
    """The engine-core process exited or stopped reporting."""


class ServerShuttingDownError(EngineDeadError):
    """The server stopped before the request finished (drain timeout or a second signal)."""


class EngineOverloadedError(RuntimeError):
    """Admission refused: too many requests or prompt tokens already pending."""


class SpawnedCore(NamedTuple):
    """An engine core process started by spawn_core, not yet talked to."""

    process: multiprocessing.process.BaseProcess
    ipc_dir: str  # its two sockets' folder
    started: float  # time.perf_counter() of the spawn
    standby: bool = False  # spawned without a config: AsyncLLM.start sends it one

    @property
    def in_addr(self) -> str:
        return f"ipc://{self.ipc_dir}/in"

    @property
    def out_addr(self) -> str:
        return f"ipc://{self.ipc_dir}/out"

    def stop(self) -> None:
        """Stop the process (stop_process) and remove its sockets' folder."""
        stop_process(self.process)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def stop_process(process: multiprocessing.process.BaseProcess, timeout_s: float = 5.0) -> None:
    """Terminate the process; kill it if it is still there after timeout_s (hung, or
    stopped): an engine core must not outlive its server."""
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join(timeout_s)


def spawn_core(config: EngineConfig | None, source: ModelSource | None) -> SpawnedCore:
    """Start an engine core process for `config`. Its sockets connect to addresses that
    AsyncLLM.start binds later (ZeroMQ connects before a bind and delivers once it is there),
    so `lantau serve` spawns it before importing its web stack: the core's start (imports,
    CUDA context, weights) runs beside those imports. `config` None: a standby core, which
    imports the engine while the config is decided (a repository's versions: config.pbtxt,
    the manifest) and takes it as its first message."""
    ipc_dir = tempfile.mkdtemp(prefix="lantau-")
    core = SpawnedCore(None, ipc_dir, 0.0, standby=config is None)
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        args=(config, source, core.in_addr, core.out_addr, time.monotonic()),
        name=CORE_PROCESS_NAME,
        daemon=True,
    )
    started = time.perf_counter()
    process.start()
    return core._replace(process=process, started=started)


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        tokenizer,
        max_pending_requests: int = 1024,
        max_pending_tokens: int = 1 << 20,
        live_max_silence_s: float = 30.0,
        metrics: EngineMetrics | None = None,
        sampling_defaults: dict | None = None,
        chat_template: str | None = None,
        lora_dir: str | None = None,
    ) -> None:
        self.config = config
        self.chat_template = chat_template  # --chat-template: the tokenizer's own replaced
        # SamplingParams field -> the model's default, for what a request leaves out
        # (lantau/model/generation_config.py)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.metrics = metrics  # None: --disable-metrics, nothing is timed or counted
        self.live_max_silence_s = live_max_silence_s
        self.max_pending_requests = max_pending_requests
        self.max_pending_tokens = max_pending_tokens
        self.num_pending_tokens = 0  # prompt tokens of requests in flight, times n
        self.num_pending_seqs = 0  # sequences in flight: each request counts n times
        self.source = source
        self.set_tokenizer(tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.awaiting_first: set[str] = set()  # requests that have had no output yet
        self.timings: dict[str, RequestTiming] = {}  # requests in flight, when metrics are on
        self.stats = StepStats()
        # LoRA adapters served now (the start-up ones, then as loads and unloads succeed)
        self.lora_names: list[str] = [name for name, _ in config.lora_modules]
        self._adapter_calls: dict[str, asyncio.Future] = {}
        # --lora-dir: any adapter folder in it is served by its name, loaded on its first
        # request into a free slot, or the least recently used idle one it loaded
        self.lora_dir = lora_dir
        self.lora_slots = config.num_lora_slots
        self.lora_in_flight: dict[str, int] = {}  # adapter -> requests in flight here
        self._lora_used: dict[str, float] = {}  # adapter from lora_dir -> when last asked
        self._lora_loading: dict[str, asyncio.Future] = {}
        self.last_report = 0.0  # time.monotonic() of the core's last message
        self.last_progress = 0.0  # ... of its last message while requests were in flight
        self.num_blocks = 0
        self.dead: str | None = None  # why the engine is gone
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreOutputs)
        self._tasks: list[asyncio.Task] = []
        self.startup_s: dict[str, float] = {}  # start-up stages, seconds (start() fills it)

    def set_tokenizer(self, tokenizer) -> None:
        if tokenizer is not None and self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        self.tokenizer = tokenizer
        fold = borrowed_vocab_size(self.source, self.config.model_config, tokenizer)
        self.processor = OutputProcessor(tokenizer, self.config.model_config.eos_token_ids, fold)
        # a text longer than this cannot fit max_model_len tokens: refused before tokenizing
        self.max_prompt_chars = self.max_model_len * max_token_bytes(tokenizer)

    async def start(
        self,
        timeout_s: float = 600.0,
        tokenizer: Awaitable | None = None,
        core: SpawnedCore | None = None,
    ) -> None:
        """Spawn the core process (or take `core`, spawned earlier with this engine's config,
        or a standby, sent the config here) and wait until its model is loaded. `tokenizer`:
        one still loading (an awaitable), taken once the core is spawned, so the two load
        together."""
        core = core or spawn_core(self.config, self.source)
        self.process, self._ipc_dir = core.process, core.ipc_dir
        self._ctx = zmq.asyncio.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # never wait on a dead core at exit
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(core.in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(core.out_addr)
        if core.standby:  # NOTE: pickle: the spawn pickles the config the same way
            await self._in.send(pickle.dumps((self.config, self.source)))
        start = core.started
        if tokenizer is not None:
            self.set_tokenizer(await tokenizer)
            self.startup_s["tokenizer"] = time.perf_counter() - start
        ready = msgspec.msgpack.decode(
            await asyncio.wait_for(self._out.recv(), timeout_s), type=CoreReady
        )
        if ready.error:
            raise EngineStartError(f"engine core failed to start: {ready.error}")
        self.num_blocks = ready.num_blocks
        # the core's whole start (its process, imports, the stages it timed) and its stages
        self.startup_s.update(engine_core=time.perf_counter() - start, **ready.startup_s)
        if self.metrics is not None:
            self.metrics.block_size = self.config.cache.block_size
            self.metrics.num_blocks = ready.num_blocks
            self.metrics.max_loras = self.lora_slots
            self.metrics.in_flight = self.timings
        self.last_report = self.last_progress = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._output_loop()),
            asyncio.create_task(self._watch_process()),
        ]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if getattr(self, "process", None) is not None:
            await asyncio.to_thread(stop_process, self.process)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def kv_cache_dtype(self) -> str:
        return self.config.cache.kv_cache_dtype

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def is_ready(self, max_silence_s: float) -> bool:
        """Model loaded, the process alive, and the core heard from recently."""
        if self.dead is not None or not self.process.is_alive():
            return False
        return time.monotonic() - self.last_report <= max_silence_s

    def is_live(self) -> bool:
        """False once the core is dead, or silent (hung, stopped) for live_max_silence_s: the
        liveness probes then fail, so an orchestrator restarts the server."""
        return self.is_ready(self.live_max_silence_s)

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
        text, ids = self.processor.tokenize(prompt)
        validate_prompt(ids, self.max_model_len, self.config.model_config.vocab_size)
        return text, ids

    def check_prompt_chars(self, num_chars: int, field: str) -> None:
        """Refuse a text that cannot fit max_model_len tokens, before any work on it: each
        token is at most max_token_bytes long, and a character is at least a byte."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                field,
                f"{num_chars} characters cannot fit within max_model_len={self.max_model_len} "
                "tokens",
            )

    async def tokenize_async(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """tokenize(), off the event loop when the text is long enough to stall it."""
        if isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS:
            self.check_prompt_chars(len(prompt), "prompt")  # no thread for a refusal
            return await asyncio.to_thread(self.tokenize, prompt)
        return self.tokenize(prompt)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, whatever their count (`/tokenize`); off the event loop when
        long, refused unread when it cannot fit max_model_len."""
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer")
        self.check_prompt_chars(len(text), "prompt")

        def encode() -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(encode) if len(text) > OFF_LOOP_CHARS else encode()

    async def encode_chat(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """A conversation's prompt token ids through the chat template (the request's own
        `chat_template`, else the model's or the server's `--chat-template`; off the event
        loop when long), with the tools (OpenAI's, as HF templates take them) if any;
        InvalidRequestError when it cannot fit, or there is no template."""
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            raise InvalidRequestError("messages", "this model has no chat template")
        num_chars = sum(len(m["content"] or "") for m in conversation)
        if tools or any("tool_calls" in m for m in conversation):  # their JSON is rendered too
            num_chars += len(orjson.dumps([tools, [m.get("tool_calls") for m in conversation]]))
        self.check_prompt_chars(num_chars, "messages")

        def encode() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    conversation, tools=tools, tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, chat_template=template,
                    **(extra or {}),
                )  # fmt: skip
            except jinja2.TemplateError as e:  # the template's raise_exception (roles, order)
                raise InvalidRequestError(
                    "messages", f"refused by the chat template: {e}"
                ) from None
            except ValueError as e:  # transformers' own checks (continue_final_message's)
                raise InvalidRequestError("messages", str(e)) from None
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(encode) if num_chars > OFF_LOOP_CHARS else encode()

    async def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """RequestOutputs as the request advances; the last one has `finished` set."""
        arrival_s = time.monotonic()
        context = CURRENT_REQUEST.get()
        if context is not None and self.metrics is not None:
            context.metrics = self.metrics  # its answer counts here (a repository's version)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if params.n > self.max_pending_requests:
            raise InvalidRequestError(
                "n", f"{params.n} exceeds the server's {self.max_pending_requests} sequences"
            )
        text, ids = await self.tokenize_async(prompt)
        params.check_vocab(self.config.model_config.vocab_size)
        num_tokens = len(ids) * params.n
        if (
            self.num_pending_seqs + params.n > self.max_pending_requests
            or self.num_pending_tokens + num_tokens > self.max_pending_tokens
        ):
            raise EngineOverloadedError(
                f"{self.num_pending_seqs} sequences and {self.num_pending_tokens} prompt tokens "
                "pending"
            )
        lora = params.lora if self.lora_dir is not None else None
        if lora is not None:  # pinned in its slot from here until it ends
            self.lora_in_flight[lora] = self.lora_in_flight.get(lora, 0) + 1
        try:
            if lora is not None:
                await self._ensure_adapter(lora)
            children = self.processor.add_request(request_id, text, ids, params, priority)
        except BaseException:
            self._unpin(lora)
            raise
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        self.awaiting_first.add(request_id)
        self.num_pending_tokens += num_tokens
        self.num_pending_seqs += params.n
        if self.metrics is not None:
            timing = RequestTiming(arrival_s, len(ids), lora=params.lora)
            self.timings[request_id] = timing
            if context is not None and context.timing is None:  # its API request's first
                context.timing = timing
                self.metrics.record_http_in(context, timing)
        finished, last = False, None
        try:
            await self._send(AddRequests([NewRequest.of(c) for c in children]))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished, last = item.finished, item
                yield item
        finally:
            self.queues.pop(request_id, None)
            self.awaiting_first.discard(request_id)
            self.num_pending_tokens -= num_tokens
            self.num_pending_seqs -= params.n
            self._record_finished(request_id, last)
            self._unpin(lora)
            if not finished:  # disconnect, deadline or error: free its blocks now
                await self.abort(request_id)

    def _record_finished(self, request_id: str, last: RequestOutput | None) -> None:
        """Observe the request's figures; its record goes to the API request's context (the
        request log)."""
        timing = self.timings.pop(request_id, None)
        if timing is None:
            return
        timing.finished_s = time.monotonic()
        record = self.metrics.record_finished(request_id, timing, last)
        context = CURRENT_REQUEST.get()
        if context is not None:
            context.records.append(record)

    async def abort(self, request_id: str) -> None:
        child_ids = self.processor.abort_request(request_id)
        if child_ids and self.dead is None:
            await self._send(AbortRequests(child_ids))

    async def _send(self, msg) -> None:
        await self._in.send(self._encoder.encode(msg))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """A PEFT LoRA adapter into a free slot of the engine, served from then on under
        `name` (ValueError: why not: no slot, a name taken, an adapter that does not fit)."""
        await self._adapter_call(name, path)
        self.lora_names.append(name)

    async def unload_lora_adapter(self, name: str) -> None:
        """The adapter out of its slot (ValueError: unknown, or requests still use it)."""
        await self._adapter_call(name, "")
        self.lora_names.remove(name)
        self._lora_used.pop(name, None)

    def lora_dir_has(self, name: str) -> bool:
        """Whether `name` is an adapter folder of --lora-dir (a served name on its first
        request); the name is checked before it touches the filesystem."""
        from lantau.model.lora import NAME

        if self.lora_dir is None or not NAME.match(name):  # NOTE: never "." or ".."
            return False
        return os.path.isfile(os.path.join(self.lora_dir, name, "adapter_config.json"))

    def _unpin(self, lora: str | None) -> None:
        if lora is not None:
            self.lora_in_flight[lora] -= 1
            if not self.lora_in_flight[lora]:
                del self.lora_in_flight[lora]

    async def _ensure_adapter(self, name: str) -> None:
        """--lora-dir's adapter `name` in a slot: loaded now unless it is (one load however
        many requests ask at once), a slot freed first when none is (the least recently
        asked adapter this directory loaded with no request in flight); EngineOverloadedError
        when every slot holds an adapter with requests in flight.

        NOTE: the load runs as a task of its own that the requests await shielded: a client
        that leaves mid-load cancels its wait, never the load, so the frontend's list of
        loaded adapters always agrees with the core's slots."""
        if name in self.lora_names:
            if name in self._lora_used:
                self._lora_used[name] = time.monotonic()
            return
        loading = self._lora_loading.get(name)
        if loading is None:
            if not self.lora_dir_has(name):
                raise InvalidRequestError("model", f"{name!r} is not a LoRA adapter of this server")
            loading = self._lora_loading[name] = asyncio.ensure_future(self._load_from_dir(name))
            loading.add_done_callback(lambda task: self._lora_loaded(name, task))
        await asyncio.shield(loading)

    async def _load_from_dir(self, name: str) -> None:
        if len(self.lora_names) + len(self._lora_loading) - 1 >= self.lora_slots:
            await self._free_a_slot()
        try:
            await self.load_lora_adapter(name, os.path.join(self.lora_dir, name))
        except ValueError as e:  # an adapter this engine cannot apply: the client's 400
            raise InvalidRequestError("model", str(e)) from None
        self._lora_used[name] = time.monotonic()

    def _lora_loaded(self, name: str, task: asyncio.Future) -> None:
        self._lora_loading.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved: a load every requester left logs nothing

    async def _free_a_slot(self) -> None:
        for name in sorted(self._lora_used, key=self._lora_used.get):
            if self.lora_in_flight.get(name):
                continue
            try:
                await self.unload_lora_adapter(name)
            except ValueError:  # the core still holds a request of it (one just aborted)
                continue
            return
        raise EngineOverloadedError(
            f"all {self.lora_slots} LoRA adapter slots hold adapters with requests in flight"
        )

    async def _adapter_call(self, name: str, path: str) -> None:
        call_id = f"adapter-{time.monotonic_ns()}"
        done = self._adapter_calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send(LoadAdapter(call_id, name, path))
            error = await done
        finally:
            self._adapter_calls.pop(call_id, None)
        if error:
            raise ValueError(error)

    async def _output_loop(self) -> None:
        try:
            while True:
                await self._handle_outputs(self._decoder.decode(await self._out.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must fail requests, never leave them hanging
            logger.exception("engine output loop failed")
            self._fail_all(f"engine output loop failed: {type(e).__name__}: {e}")

    async def _handle_outputs(self, msg: CoreOutputs) -> None:
        self.last_report = time.monotonic()
        if msg.outputs:
            self.last_progress = self.last_report
        self.stats = msg.stats
        for child_id, error in msg.rejected.items():
            self._reject(child_id, error)
        for call_id, error in msg.adapter_calls.items():
            call = self._adapter_calls.get(call_id)
            if call is not None and not call.done():
                call.set_result(error)
        if msg.gc_pauses and self.metrics is not None:
            self.metrics.record_core_gc(msg.gc_pauses)
        if self.timings:
            self._note_first(msg.received, "received_s")
            self._note_first(msg.scheduled, "scheduled_s")
        core_outputs, prompt_logprobs = msg.outputs, msg.prompt_logprobs
        if self.awaiting_first:
            first, rest = self._split_first_tokens(core_outputs)
            if first and rest:
                await self._deliver(first, prompt_logprobs)
                await asyncio.sleep(0)  # their streams send their first chunks now
                core_outputs = rest
        await self._deliver(core_outputs, prompt_logprobs)

    async def _deliver(
        self, core_outputs: list[EngineCoreOutput], prompt_logprobs: dict | None = None
    ) -> None:
        """Detokenize core outputs and queue them to their streams."""
        outputs, stopped = self.processor.process(core_outputs, prompt_logprobs)
        if stopped:
            await self._send(AbortRequests(stopped, FinishReason.STOP))
        now, timings = self.last_report, self.timings
        for output in outputs:
            queue = self.queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
            timing = timings.get(output.request_id)
            if timing is not None:  # NOTE: the hot path: a few operations an output
                if timing.first_token_s:
                    self.metrics.itl.observe(now - timing.last_token_s)
                else:
                    timing.first_token_s = now
                timing.last_token_s = now

    def _split_first_tokens(self, core_outputs: list[EngineCoreOutput]):
        """(the first outputs of new requests, the running streams' next ones). The first
        ones are detokenized, queued and sent before the rest are even detokenized: a new
        request's time to first token waits behind no running stream (with 20 streams on
        the H200, W1-16 spent 1.0 ms from a first token's arrival to its bytes sent)."""
        waiting, parents = self.awaiting_first, self.processor.child_to_parent
        first, rest, started = [], [], set()
        for core_out in core_outputs:
            parent = parents.get(core_out.request_id, (None,))[0]
            if parent in waiting:
                first.append(core_out)
                started.add(parent)
            else:
                rest.append(core_out)
        waiting -= started
        return first, rest

    def _note_first(self, times: dict[str, float], field: str) -> None:
        """The core's times by child id (when it took each request, when it first scheduled
        it) into each request's timing `field`: its first child's."""
        for child_id, at in times.items():
            timing = self.timings.get(child_id.rsplit("#", 1)[0])
            if timing is not None and not getattr(timing, field):
                setattr(timing, field, at)

    def fail_requests(self, reason: str) -> None:
        """End every request in flight with ServerShuttingDownError; their routes abort them."""
        for queue in list(self.queues.values()):
            queue.put_nowait(ServerShuttingDownError(reason))

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        for queue in list(self.queues.values()):
            queue.put_nowait(EngineDeadError(reason))
        for call in self._adapter_calls.values():  # no answer is coming
            if not call.done():
                call.set_result(reason)

    def _reject(self, child_id: str, error: str) -> None:
        request_id = child_id.rsplit("#", 1)[0]
        queue = self.queues.get(request_id)
        if queue is not None:
            field, _, message = error.partition(": ")
            queue.put_nowait(InvalidRequestError(field, message))

    async def _watch_process(self) -> None:
        """Fail every waiting request once the core process is gone."""
        while self.process.is_alive():
            await asyncio.sleep(HEARTBEAT_S)
        logger.error("engine core exited with code %s", self.process.exitcode)
        self._fail_all(f"engine core exited with code {self.process.exitcode}")
