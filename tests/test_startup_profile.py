"""benchmarks/serve_ready.py --profile's summary: py-spy's raw stacks as each thread's call tree
in seconds, importlib's frames dropped, one-child chains on one line, small branches left out."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_ready import startup_tree  # noqa: E402

IMPORT = ";".join([
    "_find_and_load (<frozen importlib._bootstrap>:1176)",
    "_call_with_frames_removed (<frozen importlib._bootstrap>:241)",
])  # fmt: skip
MAIN = "thread (11): MainThread;run (core.py:5)"
RAW = "\n".join([
    f"{MAIN};{IMPORT};<module> (torch/__init__.py:10);{IMPORT};<module> (torch/nn.py:3) 300",
    f"{MAIN};{IMPORT};<module> (torch/__init__.py:12) 100",
    f"{MAIN};capture (graph.py:40);_step (graph.py:90) 500",
    f"{MAIN};capture (graph.py:41);synchronize (cuda.py:7) 98",
    f"{MAIN};tiny (x.py:1) 2",
    "thread (12): lantau-load;load (loader.py:3);pread (loader.py:9) 400",
    "thread (13): idle;wait (threading.py:1) 1",
])  # fmt: skip


def test_each_thread_as_a_call_tree_in_seconds(tmp_path):
    raw = tmp_path / "startup.txt"
    raw.write_text(RAW + "\n")
    lines = startup_tree(raw, rate=100).splitlines()
    assert lines[0] == "## thread (11): MainThread: 10.00 s sampled"
    body = [line for line in lines[1:] if line.strip()]
    assert body[:6] == [
        "- 10.00 s: run (core.py)",
        "  - 5.98 s: capture (graph.py)",  # lines 40 and 41 are one function
        "    - 5.00 s: _step (graph.py)",
        "    - 0.98 s: synchronize (cuda.py)",
        "  - 4.00 s: <module> (torch/__init__.py)",  # the imports' own frames gone
        "    - 3.00 s: <module> (torch/nn.py)",
    ]
    assert not any("tiny" in line for line in lines)  # 0.2 % of the thread
    # a chain of one callee each is one line; a thread under 2 % of the busiest is left out
    assert "## thread (12): lantau-load: 4.00 s sampled" in lines
    assert "- 4.00 s: load (loader.py) > pread (loader.py)" in lines
    assert not any("idle" in line for line in lines)
