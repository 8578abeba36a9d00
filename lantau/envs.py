"""Every environment variable lantau reads, typed, in one place."""

from __future__ import annotations

import os


def pdl_enabled() -> bool:
    """LANTAU_PDL (default 1): 0 launches the decode path's kernels without programmatic
    dependent launch (KernelConfig.enable_pdl)."""
    return os.environ.get("LANTAU_PDL", "1") != "0"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels through its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
