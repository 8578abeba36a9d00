"""A local HF model folder: config.json, *.safetensors (memory-mapped), tokenizer files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from lantau.config import ModelConfig
from lantau.errors import ModelLoadError
from lantau.model.generation_config import eos_token_ids, read_generation_config
from lantau.model.hf_quant import UNUSED_SCALES, CheckpointQuantization, checkpoint_quantization

if TYPE_CHECKING:  # NOTE: configs and tokenizers are read without torch (the frontend)
    import torch

    from lantau.model.fp8 import BlockQuantizedWeight, QuantizedWeight

    HfWeight = QuantizedWeight | BlockQuantizedWeight


HF_QUANT_CONFIG = "hf_quant_config.json"


def _read_config_json(folder: Path, name: str = "config.json") -> dict:
    path = folder / name
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the model config: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return data


def read_hf_quantization(folder: Path, config: dict | None = None) -> CheckpointQuantization | None:
    """The checkpoint's FP8 scheme (lantau/model/hf_quant.py), None when unquantized;
    `config`: its config.json when already read."""
    config = _read_config_json(folder) if config is None else config
    hf_quant = None  # ModelOpt's older checkpoints describe it beside config.json
    if "quantization_config" not in config and (folder / HF_QUANT_CONFIG).is_file():
        hf_quant = _read_config_json(folder, HF_QUANT_CONFIG)
    try:
        return checkpoint_quantization(config, hf_quant)
    except ValueError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def read_hf_config(folder: Path) -> ModelConfig:
    """The model's shape; an FP8 checkpoint's is `quantization="fp8"` (how it runs unless the
    engine's dtype says otherwise). Its end tokens are config.json's and generation_config.
    json's (an instruct model's end of turn may be named only there)."""
    path = folder / "config.json"
    data = _read_config_json(folder)
    quantization = read_hf_quantization(folder, data)
    try:
        config = ModelConfig.from_hf(data)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: unsupported or incomplete config: {e}") from e
    eos = config.eos_token_ids
    extra = eos_token_ids(read_generation_config(folder))
    eos += tuple(i for i in extra if i not in eos and i < config.vocab_size)
    return dataclasses.replace(
        config, quantization="fp8" if quantization else None, eos_token_ids=eos
    )


def _safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    return files


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor | HfWeight]]:
    """(HF name, CPU tensor) for every tensor, one file memory-mapped at a time; an FP8
    checkpoint's e4m3 weights come with their scales (`paired_fp8_weights`)."""
    quantization = read_hf_quantization(folder)
    tensors = _iter_tensors(folder)
    return paired_fp8_weights(tensors, quantization) if quantization else tensors


def paired_fp8_weights(
    tensors: Iterator[tuple[str, torch.Tensor]], quantization: CheckpointQuantization
) -> Iterator[tuple[str, torch.Tensor | HfWeight]]:
    """An FP8 checkpoint's tensors with each e4m3 `X.weight` and its `X.weight_scale` (or
    `X.weight_scale_inv`) as one `X.weight` (fp8.checkpoint_weight: a QuantizedWeight, or a
    BlockQuantizedWeight for block-wise scales), whichever comes first held until the other
    does; the scales lantau does not use dropped (hf_quant.UNUSED_SCALES); the rest as they
    are."""
    import torch

    from lantau.model.fp8 import checkpoint_weight

    weights: dict[str, torch.Tensor] = {}  # module -> e4m3 weight waiting for its scale
    scales: dict[str, torch.Tensor] = {}  # module -> scale waiting for its weight
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in UNUSED_SCALES:
            continue
        if leaf in ("weight_scale", "weight_scale_inv"):
            scales[module] = tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if leaf != "weight" or tensor.dtype != torch.float8_e4m3fn:
                raise ModelLoadError(f"{name}: {tensor.dtype} is not read (only e4m3fn weights)")
            weights[module] = tensor
        else:
            yield name, tensor
            continue
        if module in weights and module in scales:
            try:
                q, scale = weights.pop(module), scales.pop(module)
                weight = checkpoint_weight(q, scale, quantization.block)
            except ValueError as e:
                raise ModelLoadError(f"{module}.weight: {e}") from e
            yield f"{module}.weight", weight
    if weights:
        raise ModelLoadError(f"e4m3 weights without a weight_scale: {sorted(weights)[:4]}")
    if scales:
        raise ModelLoadError(f"weight scales without an e4m3 weight: {sorted(scales)[:4]}")


def _iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
