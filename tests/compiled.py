"""Code run as the GPU would compile it, without a GPU: a subprocess without TRITON_INTERPRET
(so Triton's JIT objects and its own ptxas are real), lantau and benchmarks/ (sass_loops.py's
compile_sm90 and disassemble) on its path."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(code: str) -> str:
    """`code`'s stdout; its stderr's tail in the failure when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
