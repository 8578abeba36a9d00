"""An engine folder's manifest (`lantau build` writes it last): what the folder holds and what
must match for it to load. Read without torch (the server's frontend and the repository
scanner read it).

    REPO/NAME/VERSION/
        lantau-engine.json        this manifest (written last, atomically: no manifest, no version)
        model-00000-of-00003.safetensors ...   weights as the model holds them (qkv / gate_up fused)
                                  (built for N tensor-parallel ranks: rank{r}-model-... each
                                  rank's slice, lantau/model/parallel.py)
        tokenizer.json, tokenizer_config.json, ...
        kernels/<key>/            compiled Triton kernels, a cache outside the manifest
                                  (`--compile-kernels`, lantau/model/kernel_cache.py)

The fingerprint is a sha256 over what must match at load (engine format, model config, dtype,
tensor-parallel size, every tensor's name, shape and dtype), not over lantau's version: an
upgrade that keeps the layout loads old folders; one that changes it says what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lantau.config import ModelConfig, RopeScaling
from lantau.errors import ModelLoadError

MANIFEST_NAME = "lantau-engine.json"
ENGINE_FORMAT = 1  # bump when the folder's layout or the weights' meaning changes
# `lantau build --dtype` names -> the dtype stored (torch's name; fp8 has its own)
BUILD_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8"}


def check_dtype_available(dtype: str) -> str:
    """The stored dtype for `--dtype NAME`."""
    if dtype not in BUILD_DTYPES:
        raise ModelLoadError(f"--dtype: {dtype!r} is not one of {', '.join(BUILD_DTYPES)}")
    return BUILD_DTYPES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # torch's name: "bfloat16", ...


@dataclass(frozen=True)
class Manifest:
    engine_format: int
    lantau_version: str
    source: str  # what it was built from (informative; "random:NAME" marks random weights)
    model_config: ModelConfig
    dtype: str  # of the weights, as stored (BUILD_DTYPES' values)
    tensor_parallel_size: int
    tensors: dict[str, TensorSpec]  # parameter name -> its spec
    files: dict[str, dict[str, Any]]  # file name -> {"sha256", "size"}: weights and tokenizer
    shards: tuple[str, ...]  # the weight files, in order
    fingerprint: str

    def shards_of(self, rank: int) -> tuple[str, ...]:
        """The weight files tensor-parallel rank `rank` reads (all of them on one rank)."""
        if self.tensor_parallel_size == 1:
            return self.shards
        return tuple(s for s in self.shards if s.startswith(rank_prefix(rank)))

    @property
    def is_random_weights(self) -> bool:
        return self.source.startswith("random:")

    @property
    def tokenizer_digest(self) -> str:
        """One sha256 over the tokenizer files' own: equal digests, the same tokenizer."""
        files = sorted((n, e["sha256"]) for n, e in self.files.items() if n not in self.shards)
        return hashlib.sha256(json.dumps(files).encode()).hexdigest()

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["tensors"] = {n: [list(t.shape), t.dtype] for n, t in self.tensors.items()}
        data["shards"] = list(self.shards)
        return data


def rank_prefix(rank: int) -> str:
    """How a rank's weight files are named in a folder built for several ranks."""
    return f"rank{rank}-"


def compute_fingerprint(
    model_config: ModelConfig, dtype: str, tensor_parallel_size: int, tensors: dict[str, TensorSpec]
) -> str:
    """sha256 over what must match at load (the module docstring's list)."""
    covered = {
        "engine_format": ENGINE_FORMAT,
        "model_config": dataclasses.asdict(model_config),
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "tensors": {n: [list(t.shape), t.dtype] for n, t in sorted(tensors.items())},
    }
    return hashlib.sha256(json.dumps(covered, sort_keys=True).encode()).hexdigest()


def model_config_from_json(data: dict) -> ModelConfig:
    rope = data.get("rope_scaling")
    return ModelConfig(
        **{
            **data,
            "rope_scaling": RopeScaling(**rope) if rope else None,
            "eos_token_ids": tuple(data.get("eos_token_ids") or ()),
        }
    )


def is_engine_folder(folder: Path) -> bool:
    """A folder `lantau build` finished (its manifest exists); half-written ones are not."""
    return (folder / MANIFEST_NAME).is_file()


def read_manifest(folder: Path) -> Manifest:
    """The folder's manifest, checked against itself (format, fingerprint) and the files'
    sizes; ModelLoadError saying what differs and what to do."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"{folder}: no {MANIFEST_NAME}, so not a complete engine folder (a build writes it "
            "last); run `lantau build SRC --out FOLDER` again"
        )
    try:
        data = json.loads(path.read_text())
        fmt = data["engine_format"]
        if fmt != ENGINE_FORMAT:
            raise ModelLoadError(
                f"{folder}: engine format {fmt} (built by lantau {data.get('lantau_version')}); "
                f"this lantau reads format {ENGINE_FORMAT}: rebuild it with `lantau build "
                f"{data.get('source', 'SRC')} --out {folder}`"
            )
        manifest = Manifest(
            engine_format=fmt,
            lantau_version=data["lantau_version"],
            source=data["source"],
            model_config=model_config_from_json(data["model_config"]),
            dtype=data["dtype"],
            tensor_parallel_size=int(data["tensor_parallel_size"]),
            tensors={n: TensorSpec(tuple(s), d) for n, (s, d) in data["tensors"].items()},
            files=dict(data["files"]),
            shards=tuple(data["shards"]),
            fingerprint=data["fingerprint"],
        )
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: unreadable or incomplete manifest: {e!r}") from e
    check_manifest(folder, manifest)
    return manifest


def check_manifest(folder: Path, m: Manifest) -> None:
    """The fingerprint recomputed, tensor parallelism, every listed file present at its size."""
    expected = compute_fingerprint(m.model_config, m.dtype, m.tensor_parallel_size, m.tensors)
    if expected != m.fingerprint:
        raise ModelLoadError(
            f"{folder}: build fingerprint mismatch (manifest says {m.fingerprint[:12]}, its "
            f"contents give {expected[:12]}): the manifest was edited or damaged; rebuild it"
        )
    if m.tensor_parallel_size < 1 or any(not m.shards_of(r) for r in range(m.tensor_parallel_size)):
        raise ModelLoadError(
            f"{folder}: built for tensor-parallel size {m.tensor_parallel_size}, but some rank "
            "has no weight files: rebuild this folder"
        )
    for name, entry in m.files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            raise ModelLoadError(f"{folder}/{MANIFEST_NAME}: bad file name {name!r}")
        path = folder / name
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (listed in the manifest); rebuild this folder")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ModelLoadError(
                f"{path}: {size} bytes, the manifest says {entry['size']}: truncated or "
                "changed after the build; rebuild this folder"
            )


def check_layout(folder: Path, m: Manifest, expected: dict[str, TensorSpec]) -> None:
    """The model this lantau builds from the manifest's config must hold exactly the stored
    tensors; otherwise name what differs."""
    missing = sorted(set(expected) - set(m.tensors))
    extra = sorted(set(m.tensors) - set(expected))
    changed = sorted(n for n in set(expected) & set(m.tensors) if expected[n] != m.tensors[n])
    if missing or extra or changed:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}")
        if extra:
            parts.append(f"unexpected {extra[:4]}")
        if changed:
            n = changed[0]
            parts.append(
                f"{len(changed)} with another shape or dtype (e.g. {n}: stored "
                f"{list(m.tensors[n].shape)} {m.tensors[n].dtype}, expected "
                f"{list(expected[n].shape)} {expected[n].dtype})"
            )
        raise ModelLoadError(
            f"{folder}: its tensors do not match this lantau's model (built by lantau "
            f"{m.lantau_version}): {'; '.join(parts)}; rebuild it with `lantau build "
            f"{m.source} --out {folder}`"
        )
