"""The served path on the H200: `lantau serve` started as a user starts it (its time to ready
reported), driven by `lantau bench serve` runs in one order, then the same shapes offline in
the same call for comparison (`lantau bench offline`, after the server has exited).

    python benchmarks/gpu_serve.py --runs W1:16:500,W1:inf:500,W1:16:500,W1:2:120,W5:inf:256 \
        --offline in:467/out:256:500,W5:256 --out $OUT

--profile-core SECONDS samples the engine core process with py-spy (on PATH; its wheel can ride
in .whl) through the start of the first run, every thread and idle time included, and writes
core_profile.txt (py-spy's raw stacks) and core_profile.md: where the core's main loop spends
its time, by the loop's own call and by the innermost frame.

--step-log has the server log its steps (`lantau serve --step-log OUT/steps.jsonl`) and gives
each run the summary of its engine steps (lantau/bench/step_log.py): how many of each kind
(decode, mixed, empty), their batches, and the device's and the host's time for each, so a
request's TTFT can be set against what its prefill steps cost on the device.

--hf-runs RUNS first sends the runs to HF transformers behind the same HTTP API
(benchmarks/hf_serve.py, static batches of --hf-max-batch; its own server, gone before lantau's
starts); each run both servers ran gets lantau's report with the before/after table, in
before_after.tar.gz.

A run is WORKLOAD:RATE:NUM_REQUESTS[:CONCURRENCY] (W2 through the server:
random:128/512:inf:3:1, three requests one at a time). On the H200 image the serving packages
come as wheels (.whl) and the default model's tokenizer as a metadata-only GGUF (.gl, made by
benchmarks/make_tokenizer_gguf.py), so streamed text is detokenized as it would be for users.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lantau.bench.serve import ServeConfig, run_serve
from lantau.bench.step_log import describe


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_until_ready(
    cmd: list[str], port: int, log_path: Path, env: dict | None = None, timeout_s: float = 0,
    on_spawn=None,
):  # fmt: skip
    """Start a server (output to log_path; `env`: its environment, default ours) and wait for
    its /health on port (at most timeout_s, 0: no limit): (the process, seconds from spawn to
    ready). `on_spawn(process)`: called as soon as it is spawned. Also gpu_load.py's and
    serve_ready.py's."""
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if on_spawn is not None:
        on_spawn(proc)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: see {log_path}")
        if timeout_s and time.perf_counter() - start > timeout_s:
            proc.kill()
            raise SystemExit(f"the server was not ready after {timeout_s} s: see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.1)


def start_server(model: str, port: int, extra: list[str], log_path: Path):
    cmd = [sys.executable, "-m", "lantau.cli", "serve", model, "--port", str(port),
           "--grpc-port", "0", *extra]  # fmt: skip
    return launch_until_ready(cmd, port, log_path)


def serve_runs(
    base: str,
    specs: list[str],
    full: dict | None = None,
    step_log: str | None = None,
    model: str | None = None,
    lora_modules: tuple[str, ...] = (),
) -> list[dict]:
    """Each run's result, its records left out (`full`: where they go, by spec); `step_log`:
    the server's step log, each run's engine steps read from it (its engine_steps); `model`:
    the requests' model field (None: the server's first); `lora_modules`: adapters the
    requests are spread over at random instead."""
    rows = []
    for spec in specs:
        parts, concurrency = spec.split(":"), []
        if len(parts) >= 4 and parts[-1].isdigit() and parts[-2].isdigit():
            concurrency = [parts.pop()]  # the workload may hold colons (random:IN/OUT)
        workload, rate, num = ":".join(parts).rsplit(":", 2)
        config = ServeConfig(
            base_url=base,
            model=model,
            lora_modules=lora_modules,
            workload=workload,
            num_requests=int(num),
            rate=math.inf if rate == "inf" else float(rate),
            concurrency=int(concurrency[0]) if concurrency else None,
            seed=len(rows),  # no prefix of an earlier run is in cache
            show_progress=False,
            step_log=step_log,
        )
        result = run_serve(config).to_dict()
        if full is not None:
            full[spec] = dict(result)
        result.pop("records")
        s = result["summary"]
        rows.append({"spec": spec, **result, "engine": engine_figures(result["server_metrics"])})
        print(f"{spec}: engine {rows[-1]['engine']}", flush=True)
        print(
            f"{spec}: {s['output_throughput']:.0f} tok/s, {s['request_throughput']:.2f} req/s, "
            f"TTFT mean/p95 {s['ttft']['mean']:.1f}/{s['ttft']['p95']:.1f} ms, "
            f"ITL mean/p95 {s['itl']['mean']:.1f}/{s['itl']['p95']:.1f} ms, "
            f"errors {s['num_errors']}, GPU util {result['gpu_util_mean']}",
            flush=True,
        )
        if result["engine_steps"]:
            print(f"{spec} steps: {describe(result['engine_steps'])}", flush=True)
    return rows


def engine_figures(server_metrics: dict) -> dict:
    """Where the run's time went in the engine, from the /metrics samples (when served)."""

    def series(prefix: str) -> dict:
        return next((v for k, v in server_metrics.get("series", {}).items()
                     if k.startswith(prefix)), {})  # fmt: skip

    steps = series("lantau:engine_steps_total").get("delta")
    busy = series("lantau:engine_step_time_seconds_total").get("delta")
    if not steps:
        return {}
    return {
        "steps": steps,
        "mean_step_ms": round(1e3 * busy / steps, 2),
        "step_time_s": round(busy, 2),
        "mean_batch": round(series("lantau:batch_size").get("mean", 0), 1),
        "mean_batched_tokens": round(series("lantau:num_batched_tokens").get("mean", 0), 1),
    }


def engine_core_pid(server: subprocess.Popen) -> str | None:
    """The server's engine core: its child running multiprocessing's spawn_main."""
    children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True)
    for pid in children.stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return pid
    return None


def py_spy(pid: str, seconds: float, out: Path, rate: int = 500, threads: bool = False):
    """py-spy recording process pid for `seconds`, idle time included, raw stacks to out."""
    cmd = ["py-spy", "record", "-p", pid, "-d", str(int(seconds)), "-r", str(rate), "--idle",
           "--nonblocking", "-f", "raw", "-o", str(out)]  # fmt: skip
    if threads:
        cmd.append("--threads")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def start_core_profile(server: subprocess.Popen, seconds: float, out: Path):
    """py-spy on the server's engine core."""
    if (pid := engine_core_pid(server)) is None:
        raise SystemExit("no engine core among the server's children")
    return py_spy(pid, seconds, out / "core_profile.txt")


def py_spy_stacks(raw: Path):
    """py-spy's raw output as (frames, outermost first; samples) pairs (with --threads, the
    first frame names the thread)."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        yield stack.split(";"), int(count)


def summarize_core_profile(raw: Path) -> str:
    """Shares of the main loop's samples: by the loop's call (the frame under _busy_loop)
    and by innermost frame."""
    by_call, by_leaf, total = {}, {}, 0
    for frames, count in py_spy_stacks(raw):
        loop = [i for i, f in enumerate(frames) if f.startswith("_busy_loop ")]
        if not loop:
            continue
        total += count
        call = frames[loop[0] + 1] if loop[0] + 1 < len(frames) else frames[loop[0]]
        by_call[call] = by_call.get(call, 0) + count
        by_leaf[frames[-1]] = by_leaf.get(frames[-1], 0) + count
    lines = [f"{total} samples of the core's main loop", "", "| share | the loop's call |",
             "| --- | --- |"]  # fmt: skip
    for name, table in (("call", by_call), ("leaf", by_leaf)):
        if name == "leaf":
            lines += ["", "| share | innermost frame |", "| --- | --- |"]
        for frame, n in sorted(table.items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"| {100 * n / max(total, 1):.1f} % | {frame} |")
    return "\n".join(lines)


def hf_runs(model: str, specs: list[str], max_batch: int, out: Path, full: dict) -> list[dict]:
    """The same runs against HF transformers behind the same HTTP API (hf_serve.py, static
    batches of max_batch): the before/after table's "before"."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).with_name("hf_serve.py")), "--model", model,
           "--port", str(port), "--max-batch", str(max_batch)]  # fmt: skip
    proc, ready_s = launch_until_ready(cmd, port, out / "hf_server.log")
    print(f"HF server ready in {ready_s:.1f} s", flush=True)
    try:
        return serve_runs(f"http://127.0.0.1:{port}", specs, full)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def before_after_reports(before: dict, after: dict, out: Path) -> None:
    """For each spec run against both servers, lantau's report with the before/after table,
    all in OUT/before_after.tar.gz (report.md and .html, results.json, plots, a folder a spec)."""
    import tarfile
    import tempfile

    from lantau.bench import report

    with tarfile.open(out / "before_after.tar.gz", "w:gz") as tar, tempfile.TemporaryDirectory(
    ) as tmp:  # fmt: skip
        for i, spec in enumerate(s for s in after if s in before):
            folder = Path(tmp) / f"{i}-{spec.replace('/', '_').replace(':', '_')}"
            report.write_report(after[spec], folder, before[spec])
            tar.add(folder, arcname=folder.name)
            table = (folder / "report.md").read_text().split("## Before / after")[-1]
            print(f"{spec}: before (HF) / after (lantau)\n{table.split('## ')[0]}", flush=True)


def offline_runs(model: str, specs: list[str], out: Path) -> list[dict]:
    rows = []
    for spec in specs:
        workload, num = spec.rsplit(":", 1)
        path = out / f"offline-{len(rows)}.json"
        cmd = [sys.executable, "-m", "lantau.cli", "bench", "offline", "--model", model,
               "--workload", workload, "--num-prompts", num, "--output", str(path)]  # fmt: skip
        subprocess.run(cmd, check=True)
        rows.append({"spec": spec, **json.loads(path.read_text())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--server-args", default="--max-num-seqs 384")
    p.add_argument("--runs", default="W1:16:500,W1:inf:500,W1:16:500,W1:2:120,W5:inf:256")
    p.add_argument("--offline", default="in:467/out:256:500,W5:256")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile-core", type=float, default=0, help="seconds of py-spy on the core")
    p.add_argument("--hf-runs", default="", help="runs against hf_serve.py first (the before)")
    p.add_argument(
        "--step-log", action="store_true",
        help="the server logs its steps (OUT/steps.jsonl); each run's summary by step kind",
    )  # fmt: skip
    p.add_argument("--hf-max-batch", type=int, default=16, help="hf_serve.py's static batches")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before_full, after_full = {}, {}
    hf = []
    if args.hf_runs:
        hf = hf_runs(args.model, args.hf_runs.split(","), args.hf_max_batch, out, before_full)
    port = free_port()
    server_args = args.server_args.split()
    step_log = str(out / "steps.jsonl") if args.step_log else None
    if step_log:
        Path(step_log).unlink(missing_ok=True)
        server_args += ["--step-log", step_log]
    proc, ready_s = start_server(args.model, port, server_args, out / "server.log")
    print(f"server ready in {ready_s:.1f} s", flush=True)
    profiler = start_core_profile(proc, args.profile_core, out) if args.profile_core else None
    try:
        served = serve_runs(f"http://127.0.0.1:{port}", args.runs.split(","), after_full, step_log)
        if profiler is not None:
            profiler.wait(timeout=args.profile_core + 60)
            summary = summarize_core_profile(out / "core_profile.txt")
            (out / "core_profile.md").write_text(summary + "\n")
            print(summary, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    offline = offline_runs(args.model, args.offline.split(","), out) if args.offline else []
    result = {"ready_s": ready_s, "served": served, "offline": offline, "hf": hf}
    (out / "gpu_serve.json").write_text(json.dumps(result, indent=1))
    if hf:
        before_after_reports(before_full, after_full, out)
    print("\n| run | output tok/s | req/s | TTFT mean / p95 ms | ITL mean / p95 / p99 ms | util |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in [*({**r, "spec": f"HF {r['spec']}"} for r in hf), *served]:
        s = r["summary"]
        print(
            f"| {r['spec']} | {s['output_throughput']:.0f} | {s['request_throughput']:.2f} | "
            f"{s['ttft']['mean']:.1f} / {s['ttft']['p95']:.1f} | "
            f"{s['itl']['mean']:.1f} / {s['itl']['p95']:.1f} / "
            f"{s['itl']['p99']:.1f} | {r['gpu_util_mean']} |"
        )
    for r in offline:
        o = r["lantau"]
        print(f"| offline {r['spec']} | {o['output_tok_s']:.0f} | | | | {o['gpu_util_pct']} |")
    print(f"server ready in {ready_s:.1f} s")


if __name__ == "__main__":
    main()
