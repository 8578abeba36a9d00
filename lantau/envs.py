"""Every environment variable lantau reads, typed, in one place."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def pdl_enabled() -> bool:
    """LANTAU_PDL (default 1): 0 launches the decode path's kernels without programmatic
    dependent launch (KernelConfig.enable_pdl)."""
    return os.environ.get("LANTAU_PDL", "1") != "0"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels through its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


TEST_STEP_DELAY_FILE = "LANTAU_TEST_STEP_DELAY_FILE"


def test_step_delay_file() -> str | None:
    """LANTAU_TEST_STEP_DELAY_FILE (tests only): a file holding seconds the engine core sleeps
    after each step, re-read as it changes (the monitoring test slows the server with it), or
    lines `MODEL_SUFFIX SECONDS` slowing only the cores whose model path ends so (one version
    of a repository model, in the repository tests)."""
    return os.environ.get(TEST_STEP_DELAY_FILE) or None


STEP_LOG = "LANTAU_STEP_LOG"


def step_log_path() -> str | None:
    """LANTAU_STEP_LOG (`lantau serve --step-log FILE` sets it): a file every engine core
    appends one JSON line a step to (engine/core_process.py's `StepLog`)."""
    return os.environ.get(STEP_LOG) or None


def cache_dir() -> str | None:
    """LANTAU_CACHE_DIR: where lantau keeps what it derives from model files (tokenizers
    rebuilt from GGUF metadata, engine shards' verified stamps); default
    $XDG_CACHE_HOME/lantau or ~/.cache/lantau; "" or "off": no cache."""
    value = os.environ.get("LANTAU_CACHE_DIR")
    if value is not None:
        return None if value in ("", "off") else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lantau")


def cache_entry(kind: str, key: str) -> Path | None:
    """cache_dir()/KIND/<sha256 of key, 32 hex digits>: where an entry derived from what `key`
    names lives; None when caching is off."""
    root = cache_dir()
    if root is None:
        return None
    return Path(root) / kind / hashlib.sha256(key.encode()).hexdigest()[:32]
