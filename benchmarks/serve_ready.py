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
--profile SECONDS samples each tree's first start with py-spy (on PATH; its wheel can ride in
.whl): its engine core from as soon as the process exists, every thread, idle time included,
for SECONDS (the server stays up until it is done), to OUT/startup-NAME.txt (py-spy's raw
stacks) and OUT/startup-NAME.md: each thread's seconds as a call tree (imports collapsed into
the module that ran them, branches under 2 % of the thread left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gpu_load import drop_page_cache, tree_env
from gpu_serve import engine_core_pid, free_port, launch_until_ready, py_spy, py_spy_stacks

PROFILE_RATE = 200  # py-spy samples a second (each 5 ms of a thread's time)


def evict(model: str | None, packages: bool = False) -> int:
    """Drop the model's weight files (and the site-packages) from the page cache; the bytes
    they hold."""
    from lantau.engine.import_ahead import advise, package_folders
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
        for root in package_folders():
            paths += [p for p in Path(root).rglob("*") if p.is_file()]
    return advise(paths, os.POSIX_FADV_DONTNEED)


class CoreProfile:
    """py-spy on a server's engine core, attached as soon as the core process exists."""

    def __init__(self, seconds: float, out: Path) -> None:
        self.seconds, self.out, self.profiler = seconds, out, None

    def __call__(self, server) -> None:  # launch_until_ready's on_spawn
        threading.Thread(target=self._attach, args=(server,), daemon=True).start()

    def _attach(self, server) -> None:
        deadline = time.monotonic() + 30
        while server.poll() is None and time.monotonic() < deadline:
            if (pid := engine_core_pid(server)) is not None:
                self.profiler = py_spy(pid, self.seconds, self.out, PROFILE_RATE, threads=True)
                return
            time.sleep(0.005)

    def wait(self) -> None:
        if self.profiler is not None:
            self.profiler.wait(self.seconds + 60)


def frame_key(frame: str) -> str:
    """py-spy's `function (file:line)` without the line: one node a function."""
    name, _, where = frame.rpartition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if name else frame


def startup_tree(raw: Path, rate: int = PROFILE_RATE, min_share: float = 0.02) -> str:
    """Each thread's samples as a call tree in seconds: importlib's own frames dropped (an
    import shows as the `<module>` it ran), a chain of one child holding nearly all of its
    parent's samples on one line, branches under min_share of the thread left out."""
    threads: dict[str, dict] = {}
    for (thread, *frames), count in py_spy_stacks(raw):
        node = threads.setdefault(thread, {"n": 0, "kids": {}})
        node["n"] += count
        for frame in frames:
            if "<frozen importlib" in frame or frame.startswith("_call_with_frames_removed"):
                continue
            node = node["kids"].setdefault(frame_key(frame), {"n": 0, "kids": {}})
            node["n"] += count
    lines = []

    def walk(kids: dict, total: int, indent: int) -> None:
        for name, node in sorted(kids.items(), key=lambda kv: -kv[1]["n"]):
            if node["n"] < min_share * total:
                continue
            names = [name]
            while len(node["kids"]) == 1:  # one callee: on the same line while it holds ~all
                ((kid_name, kid),) = node["kids"].items()
                if kid["n"] < 0.95 * node["n"]:
                    break
                names.append(kid_name)
                node = kid
            lines.append(f"{'  ' * indent}- {node['n'] / rate:.2f} s: {' > '.join(names)}")
            walk(node["kids"], total, indent + 1)

    busiest = max((node["n"] for node in threads.values()), default=0)
    for thread, node in sorted(threads.items(), key=lambda kv: -kv[1]["n"]):
        if node["n"] >= min_share * busiest:
            lines.append(f"\n## {thread}: {node['n'] / rate:.2f} s sampled\n")
            walk(node["kids"], node["n"], 0)
    return "\n".join(lines).lstrip("\n") + "\n"


def time_to_ready(
    tree: Path, model: str | None, serve_args: list[str], timeout_s: float,
    profile: CoreProfile | None = None,
):  # fmt: skip
    """(seconds to /health 200, the server's startup_s) of one fresh server from `tree`;
    `profile`: py-spy on its engine core (the server stays up until it is done)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lantau.cli", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), *serve_args]
    env = tree_env(str(tree))
    log = Path(tempfile.gettempdir()) / f"serve_ready-{os.getpid()}.log"
    try:
        proc, seconds = launch_until_ready(cmd, port, log, env, timeout_s, profile)
    except SystemExit as e:  # with the log's last lines
        raise SystemExit("\n".join([str(e), *log.read_text().splitlines()[-20:]])) from None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            status = json.load(r)
        if profile is not None:
            profile.wait()
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
    parser.add_argument("--profile", type=float, default=0, metavar="SECONDS",
                        help="py-spy on each tree's first start (its engine core)")  # fmt: skip
    parser.add_argument("--out", default=".", help="where --profile writes")
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
            profile = None
            if args.profile and run == 0:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                profile = CoreProfile(args.profile, Path(args.out) / f"startup-{name}.txt")
            try:
                took, startup = time_to_ready(Path(path).resolve(), args.model, serve_args,
                                              args.timeout_s, profile)  # fmt: skip
            except SystemExit as e:  # a tree that does not start is reported, the others run on
                failed[name] = str(e).splitlines()[0]
                print(f"run {run + 1} {name}: failed: {e}", flush=True)
                continue
            seconds[name].append(took)
            stages[name] = startup
            if profile is not None and profile.out.exists():
                tree = startup_tree(profile.out)
                profile.out.with_suffix(".md").write_text(tree)
                print(f"{name}'s engine core, first start (py-spy):\n{tree}", flush=True)
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
