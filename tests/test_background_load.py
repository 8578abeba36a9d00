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


def _greedy(core, prompts: list[list[int]]) -> dict[str, list[int]]:
    from lantau.request import Request, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    for i, ids in enumerate(prompts):
        core.add_request(Request(f"r{i}", ids, params, []))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_warm_up_beside_the_load_then_the_loaded_weights(engine_folder, monkeypatch):
    """The served core's warm-up runs before the weights' load ends (`defer_weights`): it reads
    zeros, not stale memory, and the requests after `wait_weights` get the loaded model's
    tokens, as from a core that waited for its weights before returning."""
    import threading

    import torch

    from lantau.engine.core import EngineCore
    from lantau.engine.warmup import warm_up
    from lantau.model import engine_loader

    config, source = build_engine_config(
        str(engine_folder), device="cpu", max_model_len=256, num_kv_blocks=64
    )
    prompts = [[5, 9, 200, 31], list(range(40, 140)), [7]]
    expected = _greedy(EngineCore(config, source), prompts)

    release, load = threading.Event(), engine_loader.load_engine_weights

    def held_load(*args, **kwargs):
        assert release.wait(60)
        return load(*args, **kwargs)

    monkeypatch.setattr(engine_loader, "load_engine_weights", held_load)
    core = EngineCore(config, source, defer_weights=True)
    tensors = engine_loader.engine_tensors(core.runner.model).values()
    assert all(not t.any() for t in tensors)  # zeros until the load writes them
    warm_up(core)  # every wave, on the zeros
    assert "weights" not in core.startup_s
    release.set()
    core.wait_weights()
    assert core.startup_s["weights_wait"] >= 0
    assert any(t.any() for t in tensors)
    assert _greedy(core, prompts) == expected
    core.wait_weights()  # once only: nothing pending
    assert torch.isfinite(core.runner.model.lm_head.weight).all()
