"""`lantau build` and engine folders: the weights load back exactly (random and HF sources),
and every way a folder can be wrong is a ModelLoadError saying what differs and what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from lantau.cli import main
from lantau.errors import ModelLoadError
from lantau.model.build import build_engine
from lantau.model.manifest import MANIFEST_NAME, compute_fingerprint, read_manifest
from lantau.model.source import resolve_model_source
from lantau.request import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 300, 9]}, {"prompt_token_ids": [1, 2, 3]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("repo") / "tiny" / "1"
    assert main(["build", "random:tiny", "--out", str(out), "--seed", "7"]) == 0
    return out


def token_ids(model: str, **kwargs) -> list[list[int]]:
    from lantau.llm import LLM

    llm = LLM(model, device="cpu", max_model_len=64, num_kv_blocks=32, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_random_build_loads_the_same_weights(tiny_engine):
    manifest = read_manifest(tiny_engine)
    assert manifest.dtype == "bfloat16" and manifest.is_random_weights
    assert "model.layers.0.self_attn.qkv_proj.weight" in manifest.tensors  # fused as served
    assert (tiny_engine / "tokenizer.json").is_file()
    assert resolve_model_source(str(tiny_engine)).kind == "engine"
    assert token_ids(str(tiny_engine)) == token_ids("random:tiny", seed=7, dtype="bfloat16")


def test_hf_build_matches_the_hf_folder(tiny_llama_dir, tmp_path):
    out = tmp_path / "hf-engine"
    build_engine(str(tiny_llama_dir), out, dtype="fp32", max_shard_bytes=100_000)
    manifest = read_manifest(out)
    assert len(manifest.shards) > 1  # several shards, read in parallel
    assert token_ids(str(out)) == token_ids(str(tiny_llama_dir), dtype="float32")


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def edit_manifest(folder, change) -> None:
    path = folder / MANIFEST_NAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_corrupt_shard_is_a_checksum_error(tiny_engine, tmp_path):
    from lantau.llm import LLM

    folder = copy_of(tiny_engine, tmp_path)
    shard = next(folder.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="checksum mismatch.*rebuild"):
        LLM(str(folder), device="cpu", max_model_len=64, num_kv_blocks=32)


def load_weights(folder):
    """The folder's model on the CPU: its state dict."""
    import torch

    from lantau.model.loader import build_model

    manifest = read_manifest(folder)
    model = build_model(resolve_model_source(str(folder)), manifest.model_config,
                        torch.bfloat16, torch.device("cpu"), 0)  # fmt: skip
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def hashed(monkeypatch, tmp_path):
    """The shards the loads hash, a name each time (the test may clear it); stamps under
    tmp_path/cache, with no minimum age."""
    from lantau.model import engine_loader

    monkeypatch.setenv("LANTAU_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_loader, "STAMP_MIN_AGE_S", 0.0)
    names: list[str] = []
    load_hashed = engine_loader._load_hashed

    def spy_load_hashed(plan, reader):
        names.append(plan.path.name)
        return load_hashed(plan, reader)

    monkeypatch.setattr(engine_loader, "_load_hashed", spy_load_hashed)
    return names


def test_a_verified_shard_is_hashed_once_a_change(tiny_engine, tmp_path, hashed):
    import os
    import time

    import torch

    folder = copy_of(tiny_engine, tmp_path)
    shards = sorted(read_manifest(folder).shards)
    first = load_weights(folder)
    assert sorted(hashed) == shards  # every shard hashed, a stamp each
    assert len(list((tmp_path / "cache" / "verified").glob("*.json"))) == len(shards)
    hashed.clear()
    again = load_weights(folder)
    assert hashed == []  # unchanged since: no hash
    assert all(torch.equal(first[k], again[k]) for k in first)
    # one byte flipped in place, the mtime set back: the ctime still moves
    shard = folder / shards[0]
    st = shard.stat()
    time.sleep(0.05)  # past the file system's timestamp tick
    with open(shard, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        load_weights(folder)
    assert hashed == [shards[0]]


def test_pieces_of_a_shard_load_the_same_weights(tiny_engine, tmp_path, hashed, monkeypatch):
    """A shard hashed before is read in pieces by any thread (here pieces far smaller than
    its tensors, on more threads than shards): the same weights as the hashed whole-shard
    read."""
    import torch

    from lantau.model import engine_loader

    folder = copy_of(tiny_engine, tmp_path)
    whole = load_weights(folder)
    assert hashed  # that load hashed (and stamped) every shard
    hashed.clear()
    monkeypatch.setattr(engine_loader, "PIECE_BYTES", 1000)
    pieces: list[int] = []
    load_piece = engine_loader._load_piece

    def spy_load_piece(path, dst, offset, reader):
        pieces.append(dst.numel())
        return load_piece(path, dst, offset, reader)

    monkeypatch.setattr(engine_loader, "_load_piece", spy_load_piece)
    again = load_weights(folder)
    assert hashed == [] and max(pieces) == 1000 and len(pieces) > 100
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def test_stamps_need_an_old_file_and_a_cache(tiny_engine, tmp_path, hashed, monkeypatch):
    from lantau.model import engine_loader

    folder = copy_of(tiny_engine, tmp_path)  # files just written
    monkeypatch.setattr(engine_loader, "STAMP_MIN_AGE_S", 60.0)
    load_weights(folder)
    load_weights(folder)
    assert sorted(hashed) == sorted(read_manifest(folder).shards * 2)  # too fresh to stamp
    assert not (tmp_path / "cache" / "verified").exists()
    monkeypatch.setattr(engine_loader, "STAMP_MIN_AGE_S", 0.0)
    monkeypatch.setenv("LANTAU_CACHE_DIR", "off")
    hashed.clear()
    load_weights(folder)
    load_weights(folder)
    assert sorted(hashed) == sorted(read_manifest(folder).shards * 2)  # each load hashed them
    assert not (tmp_path / "cache").exists()


def test_a_truncated_shard_is_named(tiny_engine, tmp_path):
    folder = copy_of(tiny_engine, tmp_path)
    shard = next(folder.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"{shard.name}: 1000 bytes, the manifest says"):
        read_manifest(folder)


def test_an_edited_manifest_fails_its_fingerprint(tiny_engine, tmp_path):
    folder = copy_of(tiny_engine, tmp_path)
    edit_manifest(folder, lambda d: d["model_config"].update(rope_theta=1.0))
    with pytest.raises(ModelLoadError, match="fingerprint mismatch"):
        read_manifest(folder)


def test_a_layout_change_names_the_tensor(tiny_engine, tmp_path):
    """What a lantau upgrade that changes the model's layout sees: the tensor named."""
    from lantau.llm import LLM

    folder = copy_of(tiny_engine, tmp_path)

    def rename(data):
        tensors = data["tensors"]
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors.pop(
            "model.layers.0.self_attn.qkv_proj.weight"
        )
        m = read_manifest(tiny_engine)
        specs = {n: type(next(iter(m.tensors.values())))(tuple(s), t) for n, (s, t) in
                 tensors.items()}  # fmt: skip
        data["fingerprint"] = compute_fingerprint(m.model_config, m.dtype, 1, specs)

    edit_manifest(folder, rename)
    with pytest.raises(ModelLoadError, match=r"missing \['model.layers.0.self_attn.qkv_proj"):
        LLM(str(folder), device="cpu", max_model_len=64, num_kv_blocks=32)


def test_a_folder_without_its_manifest_is_not_a_version(tiny_engine, tmp_path):
    folder = copy_of(tiny_engine, tmp_path)
    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(ModelLoadError, match="without its manifest"):
        resolve_model_source(str(folder))
    with pytest.raises(ModelLoadError, match="not a complete engine folder"):
        read_manifest(folder)


def test_a_newer_format_says_rebuild(tiny_engine, tmp_path):
    folder = copy_of(tiny_engine, tmp_path)
    edit_manifest(folder, lambda d: d.update(engine_format=99))
    with pytest.raises(ModelLoadError, match="engine format 99.*rebuild it with `lantau build"):
        read_manifest(folder)


def test_fp8_build_loads_the_quantized_weights(tmp_path):
    """An fp8 engine folder stores e4m3 weights with their row scales and serves the tokens
    of the same model quantized at load."""
    out = tmp_path / "tiny" / "1"
    assert main(["build", "random:tiny", "--out", str(out), "--seed", "7", "--dtype", "fp8"]) == 0
    manifest = read_manifest(out)
    assert manifest.dtype == "fp8" and manifest.model_config.quantization == "fp8"
    qkv = manifest.tensors["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dtype == "float8_e4m3fn"
    assert token_ids(str(out)) == token_ids("random:tiny", seed=7, dtype="fp8")


def test_dtype_mismatch_and_rebuild(tiny_engine, capsys):
    from lantau.engine.args import build_engine_config

    with pytest.raises(ValueError, match="built as bfloat16; serve it with --dtype auto"):
        build_engine_config(str(tiny_engine), dtype="float32")
    assert main(["build", "random:tiny", "--out", str(tiny_engine / "x"), "--dtype", "fp4"]) == 1
    assert "--dtype: 'fp4' is not one of" in capsys.readouterr().err
    assert main(["build", "random:tiny", "--out", str(tiny_engine)]) == 1
    assert "versions are immutable" in capsys.readouterr().err
