"""What the routes serve: models by name, each with the versions it serves. The OpenAI and
KServe routes see only this interface; `lantau serve MODEL` is one fixed model
(`SingleModelRouter`), `lantau serve --model-repository` a `model_control.ModelManager`.

A request picks its version when its generator first runs and stays on it to the end; that is
what lets a swap move traffic at once while in-flight requests finish where they started."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lantau.engine.async_llm import AsyncLLM
    from lantau.outputs import RequestOutput
    from lantau.request import SamplingParams

SINGLE_VERSION = "1"  # the version a fixed model reports


class ServedModel:
    """One model name as the routes see it."""

    name: str
    parent: str | None = None  # a LoRA adapter's base model

    @property
    def engine(self) -> AsyncLLM:
        """The engine unversioned requests go to now (its tokenizer, max_model_len)."""
        raise NotImplementedError

    def versions(self) -> list[str]:
        """The versions served, newest first."""
        raise NotImplementedError

    def is_ready(self) -> bool:
        raise NotImplementedError

    def config_fields(self) -> dict:
        """The fields of its Triton model config (config.pbtxt) as read, in Triton's JSON
        form; none for a model served without one."""
        return {}

    def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        priority: int = 0,
        version: str = "",
    ) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError


class ModelRouter:
    """Models by name; `get(None)` is the default one (OpenAI requests without a model)."""

    def get(self, name: str | None) -> ServedModel | None:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def engines(self) -> list[AsyncLLM]:
        """Every engine running (all versions of all models)."""
        raise NotImplementedError

    def is_live(self) -> bool:
        return all(e.is_live() for e in self.engines())

    def num_in_flight(self) -> int:
        return sum(len(e.queues) for e in self.engines())

    def fail_requests(self, reason: str) -> None:
        for engine in self.engines():
            engine.fail_requests(reason)

    @property
    def dead(self) -> str | None:
        """Why the server should exit (a fixed model's engine died), or None."""
        return None

    async def shutdown(self) -> None:
        raise NotImplementedError


class SingleModel(ServedModel):
    def __init__(self, engine: AsyncLLM, name: str, is_ready: Callable[[], bool]) -> None:
        self._engine, self.name, self._is_ready = engine, name, is_ready

    @property
    def engine(self) -> AsyncLLM:
        return self._engine

    def versions(self) -> list[str]:
        return [SINGLE_VERSION]

    def is_ready(self) -> bool:
        return self._is_ready()

    def generate(self, request_id, prompt, params, priority=0, version=""):
        return self._engine.generate(request_id, prompt, params, priority)


class AdapterModel(ServedModel):
    """A LoRA adapter of a served model, under its own name (`--lora-modules NAME=PATH`): its
    requests run on the base model's engine with SamplingParams.lora set to it."""

    def __init__(self, base: ServedModel, name: str) -> None:
        self.base, self.name, self.parent = base, name, base.name

    @property
    def engine(self) -> AsyncLLM:
        return self.base.engine

    def versions(self) -> list[str]:
        return self.base.versions()

    def is_ready(self) -> bool:
        return self.base.is_ready()

    def generate(self, request_id, prompt, params, priority=0, version=""):
        params = dataclasses.replace(params, lora=self.name)
        return self.base.generate(request_id, prompt, params, priority, version)


class SingleModelRouter(ModelRouter):
    """`lantau serve MODEL`: one engine under one name, and any aliases (`--served-model-name
    NAME ALIAS...`: requests may name any; answers name the first), and its LoRA adapters
    each under its own name (the engine's `lora_modules`)."""

    def __init__(
        self,
        engine: AsyncLLM,
        name: str,
        is_ready: Callable[[], bool],
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.model = SingleModel(engine, name, is_ready)
        self.aliases = tuple(a for a in aliases if a != name)
        taken = set(self.adapter_names()) & {name, *self.aliases}
        if taken:
            raise ValueError(f"lora module {sorted(taken)[0]!r}: the served model's own name")

    def adapter_names(self) -> list[str]:
        """The engine's LoRA adapters now (start-up ones, and those loaded since)."""
        return list(getattr(self.model.engine, "lora_names", ()))

    def get(self, name: str | None) -> ServedModel | None:
        if name is None or name in (self.model.name, *self.aliases):
            return self.model
        in_dir = getattr(self.model.engine, "lora_dir_has", None)  # --lora-dir: loads it
        if name in self.adapter_names() or (in_dir is not None and in_dir(name)):
            return AdapterModel(self.model, name)
        return None

    def names(self) -> list[str]:
        return [self.model.name, *self.aliases, *self.adapter_names()]

    def engines(self) -> list[AsyncLLM]:
        return [self.model.engine]

    @property
    def dead(self) -> str | None:
        return self.model.engine.dead

    async def shutdown(self) -> None:
        await self.model.engine.shutdown()


def as_router(
    engine_or_router, name: str | None = None, is_ready: Callable[[], bool] | None = None
) -> ModelRouter:
    """A router as given, or one engine wrapped as a fixed model."""
    if isinstance(engine_or_router, ModelRouter):
        return engine_or_router
    assert name is not None
    engine = engine_or_router
    return SingleModelRouter(engine, name, is_ready or (lambda: engine.is_ready(5.0)))
