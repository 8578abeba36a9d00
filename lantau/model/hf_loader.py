"""A local HF model folder: config.json, *.safetensors (memory-mapped), tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from lantau.config import ModelConfig
from lantau.errors import ModelLoadError

if TYPE_CHECKING:  # NOTE: configs and tokenizers are read without torch (the frontend)
    import torch


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the model config: {e}") from e
    try:
        return ModelConfig.from_hf(data)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: unsupported or incomplete config: {e}") from e


def _safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    return files


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor, one file memory-mapped at a time."""
    for path in _safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file: {e}") from e


# tokenizer_config.json classes that are transformers' generic tokenizer.json wrapper itself
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_hf_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it ships no tokenizer files. A tokenizer.json of
    the generic class loads through that class directly: AutoTokenizer's module imports torch
    (seconds, more on a GPU machine whose engine core reads its weights at the same time), and
    the server's frontend process holds no torch. Model-specific classes go through
    AutoTokenizer, which knows them."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    if (folder / "tokenizer.json").is_file() and _tokenizer_class(folder) in (
        None,
        *GENERIC_TOKENIZER_CLASSES,
    ):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _tokenizer_class(folder: Path) -> str | None:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None
