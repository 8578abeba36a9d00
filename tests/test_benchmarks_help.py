"""Every benchmark script imports and parses `--help` on CPU: they run only on a GPU, so this is
what keeps them from rotting as lantau changes under them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the tools (a name starting with _ is a module they share)
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))


def test_the_tools_are_there():
    assert {p.stem for p in SCRIPTS} >= {"gpu_h200", "kernel_sweep", "decode_arms", "step_profile"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_parses_help(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    done = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
