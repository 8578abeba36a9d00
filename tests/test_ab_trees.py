"""benchmarks/ab_trees.py: each arm imports its own tree's lantau (not this checkout's, whatever
the inherited PYTHONPATH holds), writes its files to its own OUT folder, runs in the
interleaved order, and a tree can be made from a git revision."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys
import lantau
print("lantau from", os.path.dirname(os.path.abspath(lantau.__file__)))
print("args", sys.argv[1:])
with open(os.path.join(os.environ["OUT"], "result.json"), "w") as f:
    f.write(getattr(lantau, "ARM", "checkout"))
"""


def test_each_arm_runs_its_own_tree(tmp_path):
    old = tmp_path / "old"
    (old / "lantau").mkdir(parents=True)
    (old / "lantau" / "__init__.py").write_text('ARM = "old"\n')
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # as the GPU machine's command prefix sets it
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "ab_trees.py"), "--tree", f"new={ROOT}",
            "--tree", f"old={old}", "--tree", "head=@HEAD", "--trees-dir", str(tmp_path / "trees"),
            "--rounds", "2", "--out", str(out), "--", str(script), "--flag", "x",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    arms = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert arms == ["new-1", "old-1", "head-1", "new-2", "old-2", "head-2"]
    expected = {"new": ROOT, "old": old, "head": tmp_path / "trees" / "HEAD"}
    for arm in arms:
        name = arm.split("-")[0]
        log = (out / f"{arm}.log").read_text()
        assert f"lantau from {expected[name] / 'lantau'}" in log, log
        assert "args ['--flag', 'x']" in log
        written = (out / arm / "result.json").read_text()
        assert written == ("old" if name == "old" else "checkout")
    # HEAD's tree is this checkout's committed lantau
    head_init = tmp_path / "trees" / "HEAD" / "lantau" / "__init__.py"
    assert (
        head_init.read_bytes()
        == subprocess.run(
            ["git", "show", "HEAD:lantau/__init__.py"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    )


def test_a_failing_arm_fails_the_run_and_a_bad_tree_is_refused(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    run = [sys.executable, str(ROOT / "benchmarks" / "ab_trees.py"), "--out", str(tmp_path)]
    done = subprocess.run(
        [*run, "--tree", f"a={ROOT}", "--", str(script)], capture_output=True, text=True
    )
    assert done.returncode == 1 and "a-1" in done.stdout and " 3 " in done.stdout.splitlines()[-1]
    done = subprocess.run(
        [*run, "--tree", f"a={tmp_path}", "--", str(script)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "holds no lantau package" in done.stderr
