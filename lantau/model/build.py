"""`lantau build SRC --out FOLDER`: an engine folder from an HF folder, a GGUF file or a random
shape: the weights as the model holds them after loading (q/k/v and gate/up fused), in
safetensors shards of about `max_shard_bytes` (several, so loading reads them in parallel),
the tokenizer files, and the manifest (lantau/model/manifest.py), written last. Built for N
tensor-parallel ranks, each rank's slice is built and written in turn (its own shards): a rank
reads only its bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lantau.errors import ModelLoadError
from lantau.model.engine_loader import engine_tensors, tensor_specs
from lantau.model.loader import build_model
from lantau.model.manifest import (
    ENGINE_FORMAT,
    MANIFEST_NAME,
    Manifest,
    check_dtype_available,
    compute_fingerprint,
    rank_prefix,
)
from lantau.model.parallel import TensorParallel
from lantau.model.source import load_tokenizer, read_model_config, resolve_model_source

# what an HF folder's tokenizer is made of; copied as they are
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def lantau_version() -> str:
    try:
        return importlib.metadata.version("lantau")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def build_engine(
    src: str,
    out: str | Path,
    *,
    dtype: str = "auto",
    seed: int = 0,
    device: str = "auto",
    max_shard_bytes: int = 1 << 30,
    tensor_parallel_size: int = 1,
) -> Manifest:
    """Write the engine folder `out` (which must not hold a finished build) and return its
    manifest."""
    out = Path(out)
    if dtype != "auto":
        check_dtype_available(dtype)
    if (out / MANIFEST_NAME).exists():
        raise ModelLoadError(
            f"{out}: already a built engine; versions are immutable: build into a new "
            "version folder"
        )
    source = resolve_model_source(src)
    config = read_model_config(source)
    if dtype == "auto":  # the checkpoint's own: fp8 for an FP8 one, else bf16
        dtype = "fp8" if config.quantization == "fp8" else "bf16"
    stored_dtype = check_dtype_available(dtype)
    torch_dtype = torch.bfloat16 if stored_dtype == "fp8" else getattr(torch, stored_dtype)
    # e4m3 linears, bf16 rest; an FP8 checkpoint built wide is dequantized
    config = dataclasses.replace(config, quantization="fp8" if stored_dtype == "fp8" else None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tp_size = tensor_parallel_size
    if tp_size < 1:
        raise ValueError("--tensor-parallel-size: at least 1")
    config.check_split(tp_size)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):  # an earlier build that did not finish
        stale.unlink()
    shards = []
    for rank in range(tp_size):  # one rank's slice in memory at a time
        tp = TensorParallel(rank, tp_size)
        model = build_model(source, config, torch_dtype, torch.device(device), seed, tp=tp)
        prefix = rank_prefix(rank) if tp_size > 1 else ""
        shards += _write_shards(model, out, max_shard_bytes, prefix)
        tensors = tensor_specs(model)  # the same shapes on every rank
        del model
    tokenizer_files = _write_tokenizer(source, out)
    files = _checksums(out, [*shards, *tokenizer_files])
    manifest = Manifest(
        engine_format=ENGINE_FORMAT,
        lantau_version=lantau_version(),
        source=source.name if source.kind == "random" else str(src),
        model_config=config,
        dtype=stored_dtype,
        tensor_parallel_size=tp_size,
        tensors=tensors,
        files=files,
        shards=tuple(shards),
        fingerprint=compute_fingerprint(config, stored_dtype, tp_size, tensors),
    )
    # NOTE: written last and renamed into place: a folder with a manifest is complete
    tmp = out / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / MANIFEST_NAME)
    return manifest


def _write_shards(
    model: torch.nn.Module, out: Path, max_shard_bytes: int, prefix: str = ""
) -> list[str]:
    from safetensors.torch import save_file

    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, param in engine_tensors(model).items():  # a tied parameter appears once
        nbytes = param.numel() * param.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, param))
        size += nbytes
    names = [f"{prefix}model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups, strict=True):
        tensors = {n: p.detach().to("cpu").contiguous() for n, p in group}
        save_file(tensors, str(out / name), metadata={"format": "lantau"})
        os.chmod(out / name, 0o644)  # safetensors writes 0600
    return names


def _write_tokenizer(source, out: Path) -> list[str]:
    """The source's tokenizer files (HF: copied; GGUF and random: saved from the tokenizer)."""
    if source.kind == "hf":
        names = [n for n in TOKENIZER_FILES if (source.path / n).is_file()]
        for name in names:
            shutil.copyfile(source.path / name, out / name)
        return names
    tokenizer = load_tokenizer(source)
    if tokenizer is None:  # a random shape without the default model's tokenizer at hand
        return []
    return [Path(p).name for p in tokenizer.save_pretrained(str(out)) if Path(p).is_file()]


def _checksums(out: Path, names: list[str]) -> dict[str, dict]:
    def entry(name: str) -> dict:
        hasher = hashlib.sha256()
        with open(out / name, "rb") as f:
            while chunk := f.read(16 << 20):
                hasher.update(chunk)
        return {"sha256": hasher.hexdigest(), "size": (out / name).stat().st_size}

    with ThreadPoolExecutor(min(8, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(entry, names), strict=True))
