"""lantau: an LLM serving system for Llama-family models.

Names load lazily, so `import lantau.scheduler` or `lantau.kv_cache` pulls in no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "lantau.llm",
    "CompletionOutput": "lantau.outputs",
    "RequestOutput": "lantau.outputs",
    "FinishReason": "lantau.request",
    "Logprob": "lantau.request",
    "SamplingParams": "lantau.request",
    "InvalidRequestError": "lantau.errors",
    "ModelLoadError": "lantau.errors",
}

__all__ = [*_EXPORTS, "version"]


def version() -> str:
    """The installed lantau's version (0.0.0 run from a source tree not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("lantau")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lantau' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
