"""Seconds from `lantau serve` to a healthy server, with the start-up stages the server reports
(/status `startup_s`), for one or more source trees in the same run (runs interleaved).

    .venv/bin/python benchmarks/serve_ready.py [--model M] [--runs 3] \\
        [--tree new=. --tree old=/path/to/an/older/checkout] [-- more serve flags]

Each tree runs as `python -m lantau.cli serve` with PYTHONPATH (and PYTHONSAFEPATH) set to it;
the default model on CPU is the workload `cpu-smollm2-ready` in benchmarks/RESULTS.md.
--cold evicts the model's weight files from the page cache before each run, and with
--cold-packages the interpreter's site-packages too (torch's libraries: a fresh machine)
(posix_fadvise DONTNEED: no root needed, only the files' own pages). --drop-caches empties the
whole page cache before each run instead (root: `/proc/sys/vm/drop_caches`, as gpu_load.py does).
The trees' servers keep the rest of PYTHONPATH after the tree (the H200's wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import urllib.request
from pathlib import Path

from gpu_load import drop_page_cache, tree_env
from gpu_serve import free_port, launch_until_ready


def evict(model: str | None, packages: bool = False) -> int:
    """Drop the model's weight files (and the site-packages) from the page cache; the bytes
    they hold."""
    from lantau.model.manifest import read_manifest
    from lantau.model.source import resolve_model_source

    os.sync()  # dirty pages are not dropped
    source = resolve_model_source(model)
    if source.kind == "engine":
        paths = [source.path / shard for shard in read_manifest(source.path).shards]
    elif source.kind == "hf":
        paths = sorted(source.path.glob("*.safetensors"))
    else:
        paths = [source.path] if source.kind == "gguf" else []
    if packages:
        for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
            paths += [p for p in Path(root).rglob("*") if p.is_file()]
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def time_to_ready(tree: Path, model: str | None, serve_args: list[str], timeout_s: float):
    """(seconds to /health 200, the server's startup_s) of one fresh server from `tree`."""
    port = free_port()
    cmd = [sys.executable, "-m", "lantau.cli", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), *serve_args]
    env = tree_env(str(tree))
    log = Path(tempfile.gettempdir()) / f"serve_ready-{os.getpid()}.log"
    try:
        proc, seconds = launch_until_ready(cmd, port, log, env, timeout_s)
    except SystemExit as e:  # with the log's last lines
        raise SystemExit("\n".join([str(e), *log.read_text().splitlines()[-20:]])) from None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            status = json.load(r)
        return seconds, status.get("startup_s", {})
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what `lantau serve` takes (default model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH",
        help="a lantau source tree to time (repeatable; default: this one)",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--cold", action="store_true", help="evict the weights before each run")
    parser.add_argument(
        "--cold-packages", action="store_true", help="with --cold: the site-packages too"
    )
    parser.add_argument(
        "--drop-caches", action="store_true", help="empty the page cache before each run (root)"
    )
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    here = Path(__file__).resolve().parent.parent
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(here)}
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    stages: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for run in range(args.runs):
        for name, path in trees.items():
            if name in failed:
                continue
            if args.drop_caches and not drop_page_cache():
                raise SystemExit("--drop-caches: /proc/sys/vm/drop_caches is not writable")
            if args.cold:
                evict(args.model, args.cold_packages)
            try:
                took, startup = time_to_ready(Path(path).resolve(), args.model, serve_args,
                                              args.timeout_s)  # fmt: skip
            except SystemExit as e:  # a tree that does not start is reported, the others run on
                failed[name] = str(e).splitlines()[0]
                print(f"run {run + 1} {name}: failed: {e}", flush=True)
                continue
            seconds[name].append(took)
            stages[name] = startup
            parts = ", ".join(f"{k} {v:.1f}" for k, v in startup.items())
            print(f"run {run + 1} {name}: {took:.2f} s ({parts})", flush=True)
    print(f"\n{'tree':<10} {'median s':>9} {'min s':>7}  last run's stages (s)")
    for name, values in seconds.items():
        if not values:
            print(f"{name:<10} {'failed':>9}  {failed[name]}")
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in stages[name].items())
        print(f"{name:<10} {statistics.median(values):>9.2f} {min(values):>7.2f}  {parts}")


if __name__ == "__main__":
    main()
