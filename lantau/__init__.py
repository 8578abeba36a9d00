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

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lantau' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
