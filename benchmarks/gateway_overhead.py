"""What `lantau route` costs: a streamed request's time and the gateway's CPU per chunk, through
the gateway against the same replica direct, in the same run.

    .venv/bin/python benchmarks/gateway_overhead.py [--concurrency 32] [--tokens 128]
        [--total-tokens 100000] [--repeats 3] [--record]

The replica is frontend_stream.py's bare stack (uvicorn + starlette streaming pre-encoded SSE
chunks, a loop turn a token): the cheapest server there is, so what the gateway adds stands out.
Replica and gateway are pinned to core 0, the load generator (frontend_stream.py's raw
httptools connections) to core 1. Each round runs, direct and through the gateway in turn, a
loaded phase (C streams) and an unloaded one (one stream at a time); the best round of each is
kept. Reported: the gateway's CPU time per streamed chunk (its one-core ceiling in chunks/s is
the inverse), against the replica's own; the unloaded first-chunk and whole-stream times, with
and without the gateway.

--record appends rows to benchmarks/RESULTS.md (gateway-cpu-per-chunk, gateway-latency).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import subprocess
import sys
from pathlib import Path

import uvloop
from frontend_stream import (
    CLIENT_CORE,
    SERVER_CORE,
    LoadResult,
    commit,
    machine,
    process_cpu_s,
    run_load,
    start_server,
    wait_healthy,
)


def start_gateway(backend_port: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lantau.cli", "route", "--backend",
           f"http://127.0.0.1:{backend_port}", "--port", str(port)]  # fmt: skip
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {SERVER_CORE}),
    )  # fmt: skip
    return wait_healthy(proc, port, "lantau route")


def measure(args: argparse.Namespace) -> dict[tuple[str, str], tuple[LoadResult, float]]:
    """(arm, phase) -> (the best round's result, the gateway's CPU seconds in it)."""
    replica = start_server("bare", args.port)
    gateway = start_gateway(args.port, args.port + 1)
    ports = {"direct": args.port, "gateway": args.port + 1}
    num_loaded = math.ceil(args.total_tokens / args.tokens)
    phases = (("loaded", args.concurrency, num_loaded), ("one", 1, args.latency_requests))
    best: dict[tuple[str, str], tuple[LoadResult, float]] = {}

    async def rounds() -> None:
        for port in ports.values():  # warm-up
            warm = LoadResult("warm-up", args.concurrency, args.tokens)
            await run_load(warm, port, 4 * args.concurrency, replica.pid)
        for _ in range(args.repeats):
            for arm, port in ports.items():
                for phase, concurrency, num_requests in phases:
                    result = LoadResult(arm, concurrency, args.tokens)
                    gateway_cpu0 = process_cpu_s(gateway.pid)
                    await run_load(result, port, num_requests, replica.pid)
                    gateway_cpu_s = process_cpu_s(gateway.pid) - gateway_cpu0
                    key = (arm, phase)
                    if key not in best or result.tok_s > best[key][0].tok_s:
                        best[key] = (result, gateway_cpu_s)

    try:
        uvloop.run(asyncio.wait_for(rounds(), timeout=args.timeout_s))
    finally:
        for proc in (gateway, replica):
            proc.terminate()
            proc.wait(timeout=30)
    return best


def us_per_chunk(cpu_s: float, r: LoadResult) -> float:
    return 1e6 * cpu_s / r.num_chunks


def table(best) -> list[tuple[str, str]]:
    (direct, _), (via, gateway_cpu_s) = best[("direct", "loaded")], best[("gateway", "loaded")]
    (direct_1, _), (via_1, _) = best[("direct", "one")], best[("gateway", "one")]
    gateway_us = us_per_chunk(gateway_cpu_s, via)
    return [
        ("gateway CPU per streamed chunk", f"{gateway_us:.1f} us ({1e6 / gateway_us:,.0f} "
         f"chunks/s a core); the replica's own {us_per_chunk(via.server_cpu_s, via):.1f} us"),
        (f"{direct.concurrency} streams, chunks/s", f"direct {direct.tok_s:,.0f}, through the "
         f"gateway {via.tok_s:,.0f} (replica and gateway share core {SERVER_CORE})"),
        ("first chunk P50, one stream", f"direct {direct_1.ms(direct_1.ttfc_s, 0.5):.2f} ms, "
         f"through the gateway {via_1.ms(via_1.ttfc_s, 0.5):.2f} ms"),
        (f"{direct_1.num_tokens}-token stream P50, one at a time",
         f"direct {direct_1.ms(direct_1.e2e_s, 0.5):.2f} ms, through the gateway "
         f"{via_1.ms(via_1.e2e_s, 0.5):.2f} ms"),
    ]  # fmt: skip


def result_rows(best, command: str) -> list[str]:
    (direct, _), (via, gateway_cpu_s) = best[("direct", "loaded")], best[("gateway", "loaded")]
    (direct_1, _), (via_1, _) = best[("direct", "one")], best[("gateway", "one")]
    head = f"| {datetime.date.today().isoformat()} | {commit()} |"
    gateway_us = us_per_chunk(gateway_cpu_s, via)
    cpu = (
        f"{head} gateway-cpu-per-chunk | {gateway_us:.1f} | us of gateway CPU per streamed "
        f"chunk | same run: the replica's own {us_per_chunk(via.server_cpu_s, via):.1f} us "
        f"(the bare uvicorn + starlette stack of frontend_stream.py), so one gateway core "
        f"relays ~{1e6 / gateway_us:,.0f} chunks/s; {via.concurrency} streams x "
        f"{via.num_tokens} tokens: {via.tok_s:,.0f} chunks/s through the gateway against "
        f"{direct.tok_s:,.0f} direct (gateway and replica share one core); {machine()} | "
        f"`{command}` |"
    )
    latency = (
        f"{head} gateway-latency | {via_1.ms(via_1.ttfc_s, 0.5):.2f} | ms to the first chunk "
        f"through the gateway, P50, one stream at a time | direct, same run: "
        f"{direct_1.ms(direct_1.ttfc_s, 0.5):.2f} ms; a whole {via_1.num_tokens}-token stream "
        f"P50 {via_1.ms(via_1.e2e_s, 0.5):.2f} ms against {direct_1.ms(direct_1.e2e_s, 0.5):.2f}; "
        f"{machine()} | `{command}` |"
    )
    return [cpu, latency]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=32, help="streams in the loaded phase")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--total-tokens", type=int, default=100_000, help="loaded phase, each")
    parser.add_argument("--latency-requests", type=int, default=200, help="unloaded phase")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best is reported")
    parser.add_argument("--port", type=int, default=18133, help="and the next one")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if not {SERVER_CORE, CLIENT_CORE} <= os.sched_getaffinity(0):
        sys.exit(f"needs cores {SERVER_CORE} and {CLIENT_CORE}")
    os.sched_setaffinity(0, {CLIENT_CORE})  # NOTE: before the servers start; they re-pin
    best = measure(args)
    print()
    for what, figure in table(best):
        print(f"| {what} | {figure} |")
    if args.record:
        command = " ".join(["python benchmarks/gateway_overhead.py", *sys.argv[1:]])
        with open(Path(__file__).parent / "RESULTS.md", "a") as f:
            f.write("\n".join(result_rows(best, command.replace(" --record", ""))) + "\n")


if __name__ == "__main__":
    main()
