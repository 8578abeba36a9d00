"""One benchmark under several versions of lantau in the same call, interleaved: the same-run
A/B that every GPU comparison in RESULTS.md needs.

    python benchmarks/ab_trees.py --tree new=. --tree old=.old [--rounds 2] [--out DIR] \\
        -- benchmarks/gpu_fp8.py --skip ceilings,kernels,w2-bf16,sweep,w4 --counts W3-128=2304

A tree is a folder holding a `lantau/` package (a checkout, or `git archive REV lantau` unpacked:
`--tree old=@eddeec4` does that here, into --trees-dir, when git is at hand; the GPU machine gets
no .git, so make such trees before a call and carry them). The script and its arguments come
from this checkout; each arm runs it with the tree first on the path and the working directory
off it (PYTHONSAFEPATH=1: `python -m` and a script's own folder would otherwise put this
checkout's lantau ahead of the tree's), benchmarks/ after it, and OUT set to its own folder.
Rounds go tree by tree, in the order given (new, old, new, old, ...).

Each arm's output goes to OUT/NAME-ROUND.log and its files to OUT/NAME-ROUND/; the last lines of
each log (the benchmark's table) are printed as it ends, and a summary table last.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree_from_rev(rev: str, trees_dir: Path) -> Path:
    """`git archive REV lantau` unpacked into trees_dir/REV (once)."""
    dest = trees_dir / rev
    if not (dest / "lantau").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", rev, "lantau"],
            capture_output=True, check=True,
        )  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")
    return dest


def parse_trees(specs: list[str], trees_dir: Path) -> dict[str, Path]:
    trees: dict[str, Path] = {}
    for spec in specs:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            raise SystemExit(f"--tree {spec!r}: NAME=PATH or NAME=@REV")
        if name in trees:
            raise SystemExit(f"--tree {name!r} given twice")
        path = tree_from_rev(where[1:], trees_dir) if where.startswith("@") else Path(where)
        path = path.resolve()
        if not (path / "lantau" / "__init__.py").is_file():
            raise SystemExit(f"--tree {name}: {path} holds no lantau package")
        trees[name] = path
    return trees


def arm_env(tree: Path, out: Path) -> dict[str, str]:
    """The arm's environment: the tree first on the path, then the inherited PYTHONPATH without
    this checkout (on the GPU machine the command's prefix puts it there), then benchmarks/."""
    inherited = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO
    ]  # fmt: skip
    path = os.pathsep.join([str(tree), *inherited, str(REPO / "benchmarks")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1", "OUT": str(out)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s --tree NAME=PATH ... -- SCRIPT ..."
    )
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH or NAME=@REV")
    parser.add_argument("--rounds", type=int, default=1, help="runs a tree, interleaved")
    parser.add_argument("--out", default=os.environ.get("OUT", "ab-out"), help="logs and files")
    parser.add_argument("--trees-dir", default=str(REPO / ".old"), help="where @REV trees go")
    parser.add_argument("--tail", type=int, default=15, help="log lines printed an arm")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS ...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if len(args.tree) < 1 or not command:
        parser.error("give at least one --tree and, after --, the script to run")
    trees = parse_trees(args.tree, Path(args.trees_dir))
    script = Path(command[0]).resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for name, tree in trees.items():
            arm = f"{name}-{round_}"
            arm_out = out / arm
            arm_out.mkdir(exist_ok=True)
            start = time.perf_counter()
            with open(out / f"{arm}.log", "w") as log:
                done = subprocess.run(
                    [sys.executable, str(script), *command[1:]], cwd=arm_out,
                    env=arm_env(tree, arm_out), stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            seconds = time.perf_counter() - start
            rows.append((arm, str(tree), done.returncode, seconds))
            lines = (out / f"{arm}.log").read_text(errors="replace").splitlines()
            print(f"== {arm} ({tree}): rc {done.returncode}, {seconds:.1f} s", flush=True)
            print("\n".join(lines[-args.tail :]), flush=True)
    print(f"\n{'arm':16} {'rc':>3} {'seconds':>8}  tree")
    for arm, tree, rc, seconds in rows:
        print(f"{arm:16} {rc:3d} {seconds:8.1f}  {tree}")
    return 1 if any(rc != 0 for _, _, rc, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
