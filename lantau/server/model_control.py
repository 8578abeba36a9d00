"""Model control over a repository (`lantau serve --model-repository`): which versions of
which models run, version swaps with no dropped request, rollback (asked for, or automatic),
the canary phase, poll mode, and the repository API (HTTP here, gRPC in kserve_grpc).

Each loaded version is its own engine core process (`VersionEngine`). A request picks its
version once, when its generator first runs (`RepoModel.generate`), and holds it to the end, so:

    side_by_side (default)              drain_first (memory for one version only)
    new core starts + warms up + canary  new requests wait (gate closed)
    primary = new   (one assignment)     old drains (in-flight finish), its process stops
    old drains, its process stops        new core starts + warms up + canary, gate opens
    load fails -> stop new, old serves   load fails -> old started again, gate opens

Every transition is logged on `lantau.repository` and counted for /metrics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request

from lantau.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    SpawnedCore,
)
from lantau.errors import InvalidRequestError, ModelLoadError
from lantau.metrics.gc_pauses import PROCESS_GC
from lantau.metrics.stats import EngineFigures, EngineMetrics, parse_buckets
from lantau.request import SamplingParams
from lantau.server.kserve_http import (
    ErrorCode,
    KServeError,
    invalid,
    json_response,
    read_body,
    with_kserve_errors,
)
from lantau.server.models import AdapterModel, ModelRouter, ServedModel
from lantau.server.repo_config import ModelConfigError, RepoModelConfig, read_model_config
from lantau.server.repository import (
    CONTROL_MODES,
    ModelRepository,
    RepositoryOptions,
    bad_name_reason,
)

if TYPE_CHECKING:
    from lantau.server.app import ServerConfig

logger = logging.getLogger("lantau.repository")

CANARY_PROMPT = {"prompt_token_ids": [1, 2, 3, 4]}
CANARY_TIMEOUT_S = 120.0
# a side-by-side start that fails for want of memory is retried drain-first
OUT_OF_MEMORY_HINTS = ("out of memory", "outofmemory", "the kv cache holds")


class LoadFailed(Exception):
    """A version did not start or failed its warm-up canary."""


@dataclass
class Window:
    """The requests a version served during a canary phase."""

    latencies_s: list[float] = field(default_factory=list)  # of those that completed
    num_errors: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_done(self) -> int:
        return len(self.latencies_s) + self.num_errors

    def p95(self) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class VersionEngine:
    """One loaded version: its engine and the requests holding it."""

    def __init__(self, version: int, engine: AsyncLLM) -> None:
        self.version, self.engine = version, engine
        self.num_active = 0  # requests that picked this version and have not ended
        self.idle = asyncio.Event()
        self.idle.set()
        self.window: Window | None = None  # set during a canary phase

    def acquire(self) -> None:
        self.num_active += 1
        self.idle.clear()

    def release(self, latency_s: float | None, failed: bool) -> None:
        self.num_active -= 1
        assert self.num_active >= 0
        if self.window is not None and (failed or latency_s is not None):
            if failed:
                self.window.num_errors += 1
            else:
                self.window.latencies_s.append(latency_s)
            self.window.changed.set()
        if self.num_active == 0:
            self.idle.set()


class RepoModel(ServedModel):
    """A repository model as the routes see it: the versions loaded, the one unversioned
    requests go to (`primary`), and during a canary phase the one taking a share."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.config: RepoModelConfig | None = None
        self.loaded: dict[int, VersionEngine] = {}
        self.retiring: list[VersionEngine] = []  # out of service, draining: still on /metrics
        self.primary: VersionEngine | None = None
        self.canary: VersionEngine | None = None
        self.canary_task: asyncio.Task | None = None
        self.num_routed = 0  # unversioned requests since the canary phase began
        self.gate = asyncio.Event()  # cleared while a drain-first swap holds new requests
        self.gate.set()
        self.busy: str | None = None  # what is in progress: "loading", "unloading", ...
        self.reason = ""  # why it is not serving (the last failure)
        self.history: list[int] = []  # versions that were primary, in order
        self.pinned: int | None = None  # a rollback's version (until an explicit load)
        self.rejected: set[int] = set()  # versions failed or rolled back (not re-polled)
        self.last_engine: AsyncLLM | None = None  # for the tokenizer while none is primary
        # (digest of its files, tokenizer): a version with the same files reuses it
        self.tokenizer: tuple[str, object] | None = None

    @property
    def engine(self) -> AsyncLLM:
        if self.primary is not None:
            return self.primary.engine
        if self.last_engine is None:
            raise EngineDeadError(f"model '{self.name}' has no version loaded")
        return self.last_engine

    @property
    def state(self) -> str:
        if self.busy in ("loading", "swapping"):
            return "LOADING" if self.primary is None else "READY"
        if self.busy == "unloading":
            return "UNLOADING"
        return "READY" if self.primary is not None else "UNAVAILABLE"

    def versions(self) -> list[str]:
        return [str(v) for v in sorted(self.loaded, reverse=True)]

    def config_fields(self) -> dict:
        return self.config.given if self.config is not None else {}

    def is_ready(self) -> bool:
        if not self.gate.is_set():  # a drain-first swap: requests wait, they are not refused
            return True
        return self.primary is not None and self.primary.engine.is_ready(5.0)

    def set_primary(self, ve: VersionEngine) -> None:
        self.primary = ve  # NOTE: the atomic move of traffic: one assignment on the loop
        self.last_engine = ve.engine
        if not self.history or self.history[-1] != ve.version:
            self.history.append(ve.version)

    async def pick(self, version: str) -> VersionEngine:
        if version:
            ve = self.loaded.get(int(version))
            if ve is None:
                raise EngineDeadError(f"model '{self.name}' version {version} is not loaded")
            return ve
        await self.gate.wait()  # a drain-first swap: wait for the new version
        if self.primary is None:
            raise EngineDeadError(f"model '{self.name}' has no version serving")
        canary = self.canary
        if canary is not None and self.config is not None:
            self.num_routed += 1
            share = self.config.canary.share  # every request where the share's floor steps
            if math.floor(self.num_routed * share) > math.floor((self.num_routed - 1) * share):
                return canary
        return self.primary

    async def generate(self, request_id, prompt, params, priority=0, version=""):
        if not priority and self.config is not None:  # dynamic_batching.default_priority_level
            priority = self.config.default_priority
        ve = await self.pick(version)
        ve.acquire()
        started, latency_s, failed = time.monotonic(), None, False
        try:
            async for out in ve.engine.generate(request_id, prompt, params, priority):
                out.model_version = str(ve.version)
                yield out
            latency_s = time.monotonic() - started
        except (InvalidRequestError, EngineOverloadedError):
            raise  # the request's, not the version's
        except Exception:
            failed = True
            raise
        finally:
            ve.release(latency_s, failed)


class ModelManager(ModelRouter):
    def __init__(
        self,
        options: RepositoryOptions,
        engine_args: dict,
        server: ServerConfig,
        metrics: EngineMetrics | None = None,
        standby: SpawnedCore | None = None,
    ) -> None:
        if options.control_mode not in CONTROL_MODES:
            raise ValueError(f"--model-control-mode: expected one of {', '.join(CONTROL_MODES)}")
        self.options = options
        self.repo = ModelRepository(options.path)
        self.engine_args = engine_args  # lantau serve's, under each model's config
        self.server = server
        # the server's figures (requests no version took); None: metrics off. Each version's
        # engine gets its own, labelled with its model and version (`_start_engine`)
        self.metrics = metrics
        self.models: dict[str, RepoModel] = {}
        # (model, kind, from version, to version) -> transitions
        self.transitions: collections.Counter = collections.Counter()
        self._poller: asyncio.Task | None = None
        # an engine core spawned at the command's start, importing the engine while the
        # server's own imports run: the first version started takes it (`_start_engine`)
        self.standby = standby

    # -- the router --------------------------------------------------------------------

    def get(self, name: str | None) -> ServedModel | None:
        if name is None:
            names = self.model_names()
            return self.models[names[0]] if names else None
        model = self.models.get(name)
        if model is not None:
            return model if model.last_engine is not None else None
        base = self._adapter_owner(name)
        return AdapterModel(base, name) if base is not None else None

    def model_names(self) -> list[str]:
        """The models with a version loaded (their adapters apart)."""
        return sorted(n for n, m in self.models.items() if m.loaded)

    def names(self) -> list[str]:
        """The models with a version loaded, then the LoRA adapters their versions serve
        (config.pbtxt's `lora_modules`), each under its own name."""
        return self.model_names() + sorted(self.adapter_names())

    def adapter_names(self) -> dict[str, str]:
        """Adapter name -> the model serving it (its primary version's engine's adapters)."""
        return {
            adapter: m.name
            for m in self.models.values() if m.primary is not None
            for adapter in getattr(m.primary.engine, "lora_names", ())
        }  # fmt: skip

    def _adapter_owner(self, name: str) -> RepoModel | None:
        owner = self.adapter_names().get(name)
        return None if owner is None else self.models[owner]

    def engines(self) -> list[AsyncLLM]:
        return [ve.engine for m in self.models.values() for ve in m.loaded.values()]

    def is_live(self) -> bool:
        return all(e.is_live() for e in self.engines())

    def is_ready(self) -> bool:
        """Ready when every model that has a version serving is ready (none: ready too, as
        an explicit-mode server before its first load)."""
        return all(m.is_ready() for m in self.models.values() if m.primary is not None)

    # -- start, stop, poll -------------------------------------------------------------

    async def start(self) -> None:
        mode = self.options.control_mode
        names = self.repo.model_names() if mode != "explicit" else self.options.load_models
        for name in names:
            try:
                await self.load(name, explicit=False)
            except KServeError as e:
                logger.error("model %s not loaded at start: %s", name, e)
        await self._stop_standby()  # no version took it
        if mode == "poll":
            self._poller = asyncio.create_task(self._poll_loop())

    async def shutdown(self) -> None:
        tasks = [self._poller] + [m.canary_task for m in self.models.values()]
        for task in tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(e.shutdown() for e in self.engines()), return_exceptions=True)
        await self._stop_standby()

    async def _stop_standby(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None:
            await asyncio.to_thread(standby.stop)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.poll_secs)
            try:
                await self.poll_once()
            except Exception:
                logger.exception("repository poll failed")

    async def poll_once(self) -> None:
        """Load what is new, swap to new complete versions, unload what was removed."""
        names = set(self.repo.model_names())
        for name in sorted(names):
            model = self.models.get(name)
            if model is not None and (model.busy or model.canary is not None):
                continue
            try:
                config = read_model_config(self.repo.model_dir(name))
            except ModelConfigError as e:
                logger.error("model %s: %s", name, e)
                continue
            target = self._target_versions(model or RepoModel(name), config)
            if target and (model is None or target != sorted(model.loaded, reverse=True)):
                try:
                    await self.load(name, explicit=False)
                except KServeError as e:
                    logger.error("model %s: %s", name, e)
        for name, model in list(self.models.items()):
            if name not in names and model.loaded and not model.busy:
                await self.unload(name, explicit=False)

    # -- the repository API ------------------------------------------------------------

    def _check_control(self, action: str, explicit: bool) -> None:
        if explicit and self.options.control_mode != "explicit":
            raise invalid(
                f"explicit model {action} is not allowed in model control mode "
                f"'{self.options.control_mode}' (start with --model-control-mode explicit)"
            )

    def _model_for(self, name: str, must_exist: bool = True) -> RepoModel:
        reason = bad_name_reason(name)
        if reason is not None:
            raise invalid(f"model name {name!r}: {reason}")
        if must_exist and not self.repo.model_dir(name).is_dir():
            raise KServeError(ErrorCode.NOT_FOUND, f"no model '{name}' in the repository")
        return self.models.setdefault(name, RepoModel(name))

    def _claim(self, model: RepoModel, what: str) -> None:
        if model.busy is not None:
            raise KServeError(
                ErrorCode.ALREADY_EXISTS,
                f"model '{model.name}' is already {model.busy}; retry once it is done",
            )
        model.busy = what

    def _target_versions(self, model: RepoModel, config: RepoModelConfig) -> list[int]:
        """The versions the model should serve, newest first."""
        available = self.repo.versions(model.name)
        if model.pinned is not None and model.pinned in available:
            return [model.pinned]
        return config.version_policy.select([v for v in available if v not in model.rejected])

    async def load(self, name: str, explicit: bool = True) -> None:
        """Load the model, or reload it: new versions swap in. An explicit load forgets
        earlier failures and rollbacks (they are retried)."""
        self._check_control("load", explicit)
        model = self._model_for(name)
        self._claim(model, "loading" if not model.loaded else "swapping")
        try:
            try:
                config = read_model_config(self.repo.model_dir(name))
            except ModelConfigError as e:
                raise invalid(str(e)) from None
            if config.ignored:
                logger.info("model %s: config fields ignored: %s", name, ", ".join(config.ignored))
            if config.num_replicas > 1:
                logger.warning("model %s: instance_group asks %d replicas; one runs here "
                               "(run a server a GPU behind lantau route)", name,
                               config.num_replicas)  # fmt: skip
            self._check_adapter_names(name, config)
            if explicit:
                model.rejected.clear()
                model.pinned = None
            target = self._target_versions(model, config)
            if not target:
                raise invalid(self._no_version_message(name))
            model.config = config
            kind = "swap" if model.primary is not None else "load"
            await self._transition(model, config, target, kind)
        finally:
            model.busy = None if model.canary_task is None else model.busy

    def _check_adapter_names(self, name: str, config: RepoModelConfig) -> None:
        """A model's adapters must not take another model's name or another model's
        adapter's: a request names either, and must reach one engine."""
        from lantau.model.lora import parse_lora_modules

        served = self.adapter_names()
        for adapter, _ in parse_lora_modules(config.engine_args.get("lora_modules", ())):
            if adapter == name or adapter in self.repo.model_names():
                raise invalid(f"model '{name}': lora module {adapter!r} is a model's name")
            if served.get(adapter, name) != name:
                raise invalid(f"model '{name}': lora module {adapter!r} is served by model "
                              f"'{served[adapter]}' already")  # fmt: skip

    def _no_version_message(self, name: str) -> str:
        pending = self.repo.incomplete_versions(name)
        note = f" (version folders without a manifest: {pending})" if pending else ""
        return (
            f"model '{name}' has no complete version to serve{note}: build one with "
            f"`lantau build SRC --out {self.repo.model_dir(name)}/N`"
        )

    async def unload(self, name: str, explicit: bool = True) -> None:
        self._check_control("unload", explicit)
        model = self._model_for(name, must_exist=False)
        if not model.loaded:
            raise KServeError(ErrorCode.NOT_FOUND, f"model '{name}' is not loaded")
        self._claim(model, "unloading")
        try:
            from_version = model.primary.version if model.primary else None
            for version in list(model.loaded):
                await self._stop(model, version)
            model.last_engine = model.tokenizer = None  # its tokenizer goes too (404)
            self._record(model, "unload", from_version, None)
        finally:
            model.busy = None

    async def rollback(self, name: str, to: int | None = None) -> int:
        """Serve `to` (default: the version served before this one) in place of the current
        one, which is not polled back in. Returns the version now serving."""
        model = self._model_for(name, must_exist=False)
        if model.canary_task is not None and to is None:  # a canary phase: end it, old stays
            model.canary_task.cancel()
            await asyncio.gather(model.canary_task, return_exceptions=True)
            return model.primary.version
        if model.primary is None:
            raise KServeError(ErrorCode.NOT_FOUND, f"model '{name}' has no version serving")
        current = model.primary.version
        if to is None:
            earlier = [v for v in model.history if v != current]
            if not earlier:
                raise invalid(f"model '{name}' has served no other version to roll back to")
            to = earlier[-1]
        if to == current:
            raise invalid(f"model '{name}' already serves version {to}")
        if to not in self.repo.versions(name):
            raise KServeError(
                ErrorCode.NOT_FOUND, f"model '{name}' has no complete version {to} to roll back to"
            )
        self._claim(model, "rolling back")
        try:
            pinned, model.pinned = model.pinned, to
            try:
                await self._transition(model, model.config, [to], "rollback")
            except KServeError:
                model.pinned = pinned
                raise
            model.rejected.add(current)
        finally:
            model.busy = None
        return to

    def index(self, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: each model (and loaded version) with its state."""
        entries = []
        for name in sorted(set(self.repo.model_names()) | set(self.models)):
            model = self.models.get(name)
            if model is None or not model.loaded:
                state = model.state if model is not None else "UNAVAILABLE"
                if not ready_only:
                    reason = model.reason if model is not None else ""
                    entries.append({"name": name, "version": "", "state": state,
                                    "reason": reason})  # fmt: skip
                continue
            for version in model.versions():
                entries.append({"name": name, "version": version, "state": model.state,
                                "reason": model.reason})  # fmt: skip
        return [e for e in entries if not ready_only or e["state"] == "READY"]

    def status(self) -> dict:
        """/status: each model's versions, primary, canary and history."""
        return {
            name: {
                "state": m.state,
                "busy": m.busy,
                "versions": m.versions(),
                "primary": m.primary.version if m.primary else None,
                "canary": m.canary.version if m.canary else None,
                "history": m.history,
                "rejected": sorted(m.rejected),
                "reason": m.reason,
                "engine_pids": {str(v): ve.engine.process.pid for v, ve in m.loaded.items()},
            }
            for name, m in self.models.items()
        }

    # -- transitions -------------------------------------------------------------------

    async def _transition(
        self, model: RepoModel, config: RepoModelConfig, target: list[int], kind: str
    ) -> None:
        """Serve exactly `target` (newest first), the first as primary."""
        to_start = [v for v in target if v not in model.loaded]
        to_stop = [v for v in model.loaded if v not in target]
        previous = model.primary.version if model.primary else None
        if not to_start and not to_stop and previous == target[0]:
            return  # already serving exactly these: nothing moves
        drain_first = config.swap == "drain_first" and to_start and to_stop
        if not drain_first:
            try:
                started = await self._start_versions(model, config, to_start)
            except LoadFailed as e:
                if not (to_stop and _is_out_of_memory(str(e))):
                    self._refuse(model, kind, previous, target[0], str(e))
                logger.warning("model %s: no memory beside version %s (%s): swapping "
                               "drain-first", model.name, previous, e)  # fmt: skip
                drain_first = True
            else:
                model.loaded.update(started)
                if config.canary.share > 0 and previous is not None and kind == "swap":
                    self._begin_canary(model, config, model.loaded[target[0]], to_stop)
                    return
                model.set_primary(model.loaded[target[0]])
                model.reason = ""
                self._record(model, kind, previous, target[0])
                for version in to_stop:
                    await self._stop(model, version)
                return
        await self._drain_first(model, config, target, to_start, to_stop, kind, previous)

    async def _drain_first(self, model, config, target, to_start, to_stop, kind, previous):
        """New requests wait (the gate) while the old versions drain and stop; then the new
        ones start. If they fail, the old ones start again."""
        model.gate.clear()
        try:
            for version in to_stop:
                await self._stop(model, version)
            try:
                started = await self._start_versions(model, config, to_start)
            except LoadFailed as e:
                logger.error("model %s: version %s failed (%s); starting %s again",
                             model.name, target[0], e, to_stop)  # fmt: skip
                try:
                    model.loaded.update(await self._start_versions(model, config, to_stop))
                except LoadFailed as again:
                    model.reason = f"{e}; and the previous version failed too: {again}"
                if model.loaded:
                    model.set_primary(model.loaded[max(model.loaded)])
                self._refuse(model, kind, previous, target[0], str(e))
            model.loaded.update(started)
            model.set_primary(model.loaded[target[0]])
            model.reason = ""
            self._record(model, kind, previous, target[0])
        finally:
            model.gate.set()

    def _refuse(self, model: RepoModel, kind: str, previous, version: int, reason: str):
        """A load that failed: the version is not retried by polls; what served stays."""
        model.rejected.add(version)
        model.reason = f"version {version}: {reason}"
        if previous is not None:
            self._record(model, "auto_rollback", version, previous, reason)
        else:
            self._record(model, "load_failed", None, version, reason)
        raise invalid(f"model '{model.name}' version {version} failed to load: {reason}")

    async def _start_versions(
        self, model: RepoModel, config: RepoModelConfig, versions: list[int]
    ) -> dict[int, VersionEngine]:
        started: dict[int, VersionEngine] = {}
        try:
            for version in versions:
                engine = await self._start_engine(model, config, version)
                started[version] = VersionEngine(version, engine)
        except LoadFailed:
            await asyncio.gather(*(ve.engine.shutdown() for ve in started.values()))
            raise
        return started

    async def _start_engine(
        self, model: RepoModel, config: RepoModelConfig, version: int
    ) -> AsyncLLM:
        """A version's engine core started, warmed up and, unless turned off, answering a
        canary request; LoadFailed otherwise (its process stopped). The tokenizer loads
        while the core starts, unless the last version's has the same files."""
        from lantau.engine.args import build_engine_config
        from lantau.model.generation_config import model_sampling_defaults
        from lantau.model.manifest import read_manifest
        from lantau.model.source import load_tokenizer

        name = model.name
        folder = self.repo.model_dir(name) / str(version)
        args = {**self.engine_args, **config.engine_args}
        if config.max_num_seqs is not None:
            args["max_num_seqs"] = config.max_num_seqs
        if config.device == "cpu":
            args["device"] = "cpu"
        started = time.perf_counter()
        try:
            engine_config, source = await asyncio.to_thread(
                build_engine_config, str(folder), **args
            )
            digest = read_manifest(folder).tokenizer_digest
            defaults = model_sampling_defaults(folder, self.server.generation_config)
        except (ModelLoadError, ValueError, OSError) as e:
            raise LoadFailed(str(e)) from None
        metrics = None
        if self.metrics is not None:
            metrics = EngineMetrics(
                name,
                engine_config.scheduler.max_model_len,
                parse_buckets(list(self.server.metrics_buckets)),
                model_version=str(version),
            )
        reused = model.tokenizer[1] if model.tokenizer and model.tokenizer[0] == digest else None
        core, self.standby = self.standby, None
        engine = AsyncLLM(
            engine_config,
            source,
            None,
            max_pending_requests=config.max_pending_requests or self.server.max_pending_requests,
            max_pending_tokens=self.server.max_pending_tokens,
            live_max_silence_s=self.server.live_max_silence_s,
            metrics=metrics,
            sampling_defaults=defaults,
            chat_template=self.server.chat_template,
        )
        try:
            if reused is not None:
                engine.set_tokenizer(reused)
                await engine.start(core=core)
            else:
                tokenizer = asyncio.to_thread(load_tokenizer, source)
                await engine.start(tokenizer=tokenizer, core=core)
                model.tokenizer = (digest, engine.tokenizer)
            if config.warmup_canary:
                await asyncio.wait_for(_canary_request(engine), CANARY_TIMEOUT_S)
        except Exception as e:
            await engine.shutdown()
            raise LoadFailed(f"{type(e).__name__}: {e}") from None
        logger.info("model %s version %d ready in %.1f s (engine core pid %d)", name, version,
                    time.perf_counter() - started, engine.process.pid)  # fmt: skip
        return engine

    async def _stop(self, model: RepoModel, version: int) -> None:
        """Take the version out of service, let its requests finish (up to the drain
        timeout), then stop its engine core (its process, and the memory it held, go)."""
        ve = model.loaded.pop(version)
        if model.primary is ve:
            model.primary = None
        model.retiring.append(ve)  # its requests still finish, and count, till it stops
        try:
            await asyncio.wait_for(ve.idle.wait(), self.server.drain_timeout_s)
        except TimeoutError:
            logger.warning("model %s version %d: %d requests past the drain timeout",
                           model.name, version, ve.num_active)  # fmt: skip
            ve.engine.fail_requests(f"version {version} unloaded")
        try:
            await ve.engine.shutdown()
        finally:
            model.retiring.remove(ve)  # its series leave /metrics
        PROCESS_GC.collect_released()  # its frontend objects may be frozen (gc_pauses.py)
        logger.info("model %s version %d stopped", model.name, version)

    # -- the canary phase --------------------------------------------------------------

    def _begin_canary(self, model, config, canary: VersionEngine, to_stop: list[int]) -> None:
        model.canary, model.num_routed = canary, 0
        canary.window, model.primary.window = Window(), Window()
        model.busy = "in its canary phase"
        self._record(model, "canary", model.primary.version, canary.version)
        model.canary_task = asyncio.create_task(self._judge_canary(model, config, to_stop))

    async def _judge_canary(self, model: RepoModel, config, to_stop: list[int]) -> None:
        canary, baseline, policy = model.canary, model.primary, config.canary
        verdict, figures = "cancelled (rollback asked)", ""
        deadline = time.monotonic() + policy.window_s
        try:
            while canary.window.num_done < policy.num_requests:
                canary.window.changed.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break  # the window's time is up: judged on what it saw
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(canary.window.changed.wait(), remaining)
            verdict = judge_canary(canary.window, baseline.window, policy)
            figures = describe_windows(canary.window, baseline.window)
        except asyncio.CancelledError:
            pass
        finally:
            model.canary = None
            canary.window = baseline.window = None
            model.canary_task = None
            model.busy = None
        if verdict is None:
            model.set_primary(canary)
            self._record(model, "promote", baseline.version, canary.version, figures)
            for version in to_stop:
                await self._stop(model, version)
        else:
            model.rejected.add(canary.version)
            model.reason = f"version {canary.version}: canary {verdict}"
            kind = "rollback" if verdict.startswith("cancelled") else "auto_rollback"
            self._record(model, kind, canary.version, baseline.version, verdict)
            await self._stop(model, canary.version)

    # -- transitions, counted and logged -----------------------------------------------

    def _record(self, model: RepoModel, kind: str, from_v, to_v, reason: str = "") -> None:
        key = (model.name, kind, "" if from_v is None else str(from_v),
               "" if to_v is None else str(to_v))  # fmt: skip
        self.transitions[key] += 1
        log = logger.warning if kind in ("auto_rollback", "load_failed") else logger.info
        log("model %s: %s %s -> %s%s", model.name, kind, key[2] or "-", key[3] or "-",
            f" ({reason})" if reason else "")  # fmt: skip

    def collector(self):
        return RepositoryCollector(self)

    def figures(self) -> list[EngineFigures]:
        """/metrics' engines: the server's answers to requests no version took, then each
        version loaded or still draining (a version gone has no series left)."""
        figures = [EngineFigures(self.metrics, None)]
        for model in self.models.values():
            draining = [ve for ve in model.retiring if ve.version not in model.loaded]
            for ve in (*model.loaded.values(), *draining):
                if ve.engine.metrics is not None:
                    figures.append(EngineFigures(ve.engine.metrics, ve.engine.stats))
        return figures


def judge_canary(canary: Window, baseline: Window, policy) -> str | None:
    """None when the canary passes; else why it failed."""
    error_rate = canary.num_errors / max(1, canary.num_done)
    if error_rate > policy.max_error_rate:
        return f"error rate {error_rate:.0%} > {policy.max_error_rate:.0%}"
    if len(canary.latencies_s) >= 3 and len(baseline.latencies_s) >= 3:
        new, old = canary.p95(), baseline.p95()
        if new > policy.p95_ratio * old:
            return (
                f"P95 {new * 1000:.0f} ms > {policy.p95_ratio:g} x the previous version's "
                f"{old * 1000:.0f} ms"
            )
    return None


def describe_windows(canary: Window, baseline: Window) -> str:
    def one(w: Window) -> str:
        p95 = f"P95 {w.p95() * 1000:.0f} ms" if w.latencies_s else "no P95"
        return f"{p95}, {w.num_errors}/{w.num_done} failed"

    return f"canary {one(canary)}; previous {one(baseline)}"


def _is_out_of_memory(message: str) -> bool:
    return any(hint in message.lower() for hint in OUT_OF_MEMORY_HINTS)


async def _canary_request(engine: AsyncLLM) -> None:
    """The warm-up request, before the version serves: no client sent it, so it is not in
    the version's request figures (the engine's step counters do see it)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    metrics, engine.metrics = engine.metrics, None  # NOTE: no other request on it yet
    try:
        async for _ in engine.generate(f"canary-{time.monotonic_ns()}", CANARY_PROMPT, params):
            pass
    finally:
        engine.metrics = metrics


class RepositoryCollector:
    """/metrics: the transitions since start, and which versions serve."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self):
        from lantau.metrics.prometheus import counter_family, gauge_family

        yield counter_family(
            "lantau:model_transitions",
            "Model version transitions (load, swap, canary, promote, rollback, auto_rollback, "
            "load_failed, unload).",
            ["model_name", "kind", "from_version", "to_version"],
            self.manager.transitions.items(),
        )
        samples = []
        for name, model in self.manager.models.items():
            for version, ve in model.loaded.items():
                role = (
                    "primary"
                    if ve is model.primary
                    else ("canary" if ve is model.canary else "loaded")
                )
                samples.append(((name, str(version), role), 1))
        yield gauge_family(
            "lantau:model_version_serving",
            "1 for each loaded version, by role (primary, canary, loaded).",
            ["model_name", "version", "role"],
            samples,
        )


def make_repository_router(manager: ModelManager) -> APIRouter:
    """Triton's repository extension over HTTP, and lantau's rollback."""
    router = APIRouter()

    async def body_of(request: Request) -> dict:
        raw = await read_body(request, 1 << 20)
        if not raw.strip():
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise invalid(f"request body: {e}") from None
        if not isinstance(body, dict):
            raise invalid("request body: expected a JSON object")
        return body

    async def index(request: Request):
        body = await body_of(request)
        return json_response(manager.index(ready_only=bool(body.get("ready", False))))

    async def load(name: str, request: Request):
        parameters = (await body_of(request)).get("parameters") or {}
        if parameters:
            raise invalid(f"load parameters are not supported: {sorted(parameters)}")
        await manager.load(name)
        return json_response({})

    async def unload(name: str, request: Request):
        await body_of(request)  # unload_dependents: nothing depends on a model here
        await manager.unload(name)
        return json_response({})

    async def rollback(name: str, request: Request):
        version = (await body_of(request)).get("version")
        try:
            to = int(version) if version not in (None, "") else None
        except (TypeError, ValueError):
            raise invalid(f"version: {version!r} is not a version number") from None
        serving = await manager.rollback(name, to)
        return json_response({"name": name, "version": str(serving)})

    router.add_api_route("/v2/repository/index", with_kserve_errors(index), methods=["POST"])
    for action, endpoint in (("load", load), ("unload", unload), ("rollback", rollback)):
        router.add_api_route(
            f"/v2/repository/models/{{name:path}}/{action}",
            with_kserve_errors(endpoint),
            methods=["POST"],
        )
    return router
