"""An engine folder's weights load on a thread once the engine core has sized its KV cache,
while it captures its CUDA graphs: the served engine reports the stages in that order, the wait
for the load within the load's own time."""

from __future__ import annotations

import asyncio
import time

import pytest

from lantau.engine.async_llm import AsyncLLM
from lantau.llm import build_engine_config
from lantau.model.build import build_engine
from lantau.model.source import load_tokenizer


@pytest.fixture(scope="module")
def engine_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("repo") / "tiny" / "1"
    build_engine("random:tiny", out, device="cpu", max_shard_bytes=200_000)
    return out


def test_served_engine_reports_the_background_load(engine_folder):
    async def run() -> tuple[dict, float]:
        config, source = build_engine_config(
            str(engine_folder), device="cpu", max_model_len=256, num_kv_blocks=64
        )
        engine = AsyncLLM(config, source, load_tokenizer(source))
        started = time.perf_counter()
        await engine.start()
        try:
            return dict(engine.startup_s), time.perf_counter() - started
        finally:
            await engine.shutdown()

    stages, took = asyncio.run(run())
    assert 0 <= stages["engine_core"] <= took
    # the core's stages: its process and imports, the model built, the KV cache sized, its
    # weights loading (beside the graphs on CUDA), then the wait for them
    assert list(stages)[:5] == ["engine_core", "core_process", "core_imports", "model",
                                "kv_profile"]  # fmt: skip
    inner = ("core_process", "core_imports", "model", "kv_profile", "weights_wait")
    assert sum(stages[name] for name in inner) <= stages["engine_core"]
    # the wait also covers the loading thread's own start (its clock starts inside it): on a
    # busy 2-core box a few ms more than the load on CPU, where nothing runs beside it
    assert stages["weights"] >= 0 and stages["weights_wait"] <= stages["weights"] + 0.05
