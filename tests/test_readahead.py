"""The frontend reads a model's weight files into the page cache while the engine core starts:
which files, every byte of them once, none when they would not fit, and an early stop."""

from __future__ import annotations

import asyncio
import time

import pytest

from lantau.engine.async_llm import AsyncLLM
from lantau.llm import build_engine_config
from lantau.model import readahead
from lantau.model.build import build_engine
from lantau.model.manifest import read_manifest
from lantau.model.readahead import ReadAhead, weight_files
from lantau.model.source import default_model_path, load_tokenizer, resolve_model_source


@pytest.fixture(scope="module")
def engine_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("repo") / "tiny" / "1"
    build_engine("random:tiny", out, device="cpu", max_shard_bytes=200_000)
    return out


def test_the_files_the_loader_reads(engine_folder, tiny_llama_dir):
    shards = read_manifest(engine_folder).shards
    assert len(shards) > 1
    assert weight_files(resolve_model_source(str(engine_folder))) == [
        engine_folder / s for s in shards
    ]
    hf = weight_files(resolve_model_source(str(tiny_llama_dir)))
    assert hf and all(p.suffix == ".safetensors" and p.parent == tiny_llama_dir for p in hf)
    assert weight_files(resolve_model_source(None)) == [default_model_path()]
    random = resolve_model_source("random:tiny")
    assert weight_files(random) == [] and ReadAhead.for_source(random) is None


def test_every_byte_read_once(engine_folder):
    reader = ReadAhead.for_source(resolve_model_source(str(engine_folder)))
    reader.join(timeout=30)
    assert reader.done
    assert reader.num_bytes == sum(p.stat().st_size for p in reader.paths)


def test_too_large_for_the_page_cache_is_not_read(engine_folder, monkeypatch, caplog):
    total = sum(p.stat().st_size for p in weight_files(resolve_model_source(str(engine_folder))))
    monkeypatch.setattr(readahead, "available_memory_bytes", lambda: 2 * total - 2)
    with caplog.at_level("INFO", logger="lantau.model.readahead"):
        assert ReadAhead.for_source(resolve_model_source(str(engine_folder))) is None
    assert "not read ahead" in caplog.text
    monkeypatch.setattr(readahead, "available_memory_bytes", lambda: 2 * total)
    ReadAhead.for_source(resolve_model_source(str(engine_folder))).join(timeout=30)


def test_stop_ends_the_threads_early(tmp_path):
    paths = []
    for i in range(40):
        path = tmp_path / f"sparse-{i}.bin"
        with open(path, "wb") as f:
            f.truncate(16 << 20)  # 16 MB of holes: read from no disk
        paths.append(path)
    reader = ReadAhead(paths, num_threads=2)
    reader.stop()
    reader.join(timeout=10)
    assert reader.done and not any(t.is_alive() for t in reader._threads)
    assert reader.num_bytes < 40 * (16 << 20)


def test_a_missing_file_is_left_to_the_loader(tmp_path, engine_folder):
    reader = ReadAhead([tmp_path / "absent.safetensors"])
    reader.join(timeout=10)
    assert reader.done and reader.num_bytes == 0
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in engine_folder.iterdir():
        if path.is_file():
            (broken / path.name).write_bytes(path.read_bytes())
    source = resolve_model_source(str(broken))
    (broken / "lantau-engine.json").write_text("{")  # a corrupt manifest: the loader says so
    assert ReadAhead.for_source(source) is None


def test_served_engine_reports_its_read_ahead(engine_folder):
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
    assert 0 <= stages["read_ahead"] <= took
    # the core's stages first: the model built, its weights loading beside the KV-cache
    # sizing (and on CUDA the graphs), then the wait for them
    assert list(stages)[:2] == ["engine_core", "model"]
    assert stages["weights"] >= 0 and stages["weights_wait"] <= stages["weights"]
