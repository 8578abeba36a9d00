"""A model's `generation_config.json`, read without torch: the end-of-turn tokens it stops on
and the sampling defaults its authors chose (Llama 3.1 Instruct: temperature 0.6, top_p 0.9).

As in vLLM (`--generation-config auto`, its default): a request that leaves a field out gets
the model's value, then OpenAI's; `--generation-config vllm` keeps OpenAI's defaults, and a
folder reads the file from there instead. Its `eos_token_id`s are end tokens whatever the
mode: an instruct model's config.json may name only the end of text, its generation config
the end of a turn too (`hf_loader.read_hf_config` merges them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lantau.errors import ModelLoadError

FILE_NAME = "generation_config.json"
# generation_config.json's sampling fields -> SamplingParams' (vLLM's set)
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
MODES = ("auto", "vllm")  # or a folder holding a generation_config.json


def read_generation_config(folder: Path | None) -> dict[str, Any]:
    """The folder's generation_config.json ({} when there is none); ModelLoadError when it is
    there but not a JSON object."""
    if folder is None or not (folder / FILE_NAME).is_file():
        return {}
    path = folder / FILE_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return data


def eos_token_ids(generation: dict[str, Any]) -> tuple[int, ...]:
    """Its end tokens (`eos_token_id`: one id or a list)."""
    eos = generation.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams field -> the model's default, for the fields it sets (null and values of
    the wrong kind are left out: the request's or OpenAI's default applies)."""
    defaults: dict[str, Any] = {}
    for name, field in SAMPLING_FIELDS.items():
        value = generation.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if field in ("top_k", "max_tokens"):
            if isinstance(value, int):
                defaults[field] = value
        elif math.isfinite(value):
            defaults[field] = float(value)
    return defaults


def model_sampling_defaults(model_folder: Path | None, mode: str = "auto") -> dict[str, Any]:
    """The defaults a served model's requests get: its own (`auto`; an HF or engine folder's
    generation_config.json), none (`vllm`), or those of the generation_config.json in the
    folder `mode` names."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        return sampling_defaults(read_generation_config(model_folder))
    folder = Path(mode)
    if not (folder / FILE_NAME).is_file():
        raise ModelLoadError(
            f"--generation-config: {mode!r} is neither auto, vllm nor a folder holding a "
            f"{FILE_NAME}"
        )
    return sampling_defaults(read_generation_config(folder))


def source_folder(source) -> Path | None:
    """Where a model source's generation_config.json would be (an HF or engine folder)."""
    return source.path if source.kind in ("hf", "engine") else None


def check_mode(mode: str) -> None:
    """ModelLoadError for a --generation-config that is neither a mode nor such a folder."""
    if mode not in MODES:
        model_sampling_defaults(None, mode)


def describe(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
