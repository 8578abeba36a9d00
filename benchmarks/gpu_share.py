"""Two `lantau serve` engines sharing one GPU by `--gpu-memory-utilization` (runner/memory.py),
checked on the device (one call):

1. server A with --gpu-memory-utilization S, then server B beside it with the same share: both
   ready, both answer, their KV caches (/status num_kv_blocks) within 5 % of each other, and
   the card's memory in use (nvidia-smi) under 2 x S of it plus a context each;
2. a third server asking for S again, which is not free: it exits at once with the "out of
   memory ... asks for" message, before any weight loads (seconds to the exit printed).

    python3 benchmarks/gpu_share.py [--model random:llama3.2-1b] [--share 0.4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpu_serve import free_port, start_server


def card_memory_mib() -> tuple[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout.split(",")  # fmt: skip
    return int(out[0]), int(out[1])


def get_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:llama3.2-1b")
    p.add_argument("--share", type=float, default=0.4)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    flags = ["--gpu-memory-utilization", str(args.share), "--max-model-len", "4096"]
    rows, procs, failures = [], [], []
    try:
        for name in ("A", "B"):
            port = free_port()
            proc, ready_s = start_server(args.model, port, flags, out / f"share-{name}.log")
            procs.append(proc)
            base = f"http://127.0.0.1:{port}"
            status = get_json(f"{base}/status")
            reply = get_json(f"{base}/v1/completions", {
                "model": args.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0,
            })  # fmt: skip
            used, total = card_memory_mib()
            rows.append((name, status["num_kv_blocks"], ready_s, used, total))
            print(f"server {name}: ready in {ready_s:.1f} s, {status['num_kv_blocks']} KV "
                  f"blocks, answered {reply['usage']['completion_tokens']} tokens; card "
                  f"{used} / {total} MiB in use")  # fmt: skip
        blocks = [r[1] for r in rows]
        if abs(blocks[0] - blocks[1]) > 0.05 * max(blocks):
            failures.append(f"KV caches differ: {blocks}")
        used, total = rows[-1][3], rows[-1][4]
        if used > 2 * args.share * total + 2 * 1024:
            failures.append(f"{used} MiB in use, over 2 x {args.share} of {total} + 2 GiB")
        port = free_port()
        cmd = [sys.executable, "-m", "lantau.cli", "serve", args.model, "--port", str(port),
               "--grpc-port", "0", *flags]  # fmt: skip
        start = time.perf_counter()
        third = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - start
        said = [line for line in third.stdout.splitlines() + third.stderr.splitlines()
                if "out of memory" in line]  # fmt: skip
        print(f"server C: exit {third.returncode} after {took:.1f} s: {said[:1]}")
        if third.returncode == 0 or not said or "asks for" not in said[0]:
            failures.append(f"server C did not refuse its share: {third.stderr[-2000:]}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    print("\n| check | result |\n| --- | --- |")
    for name, num_blocks, ready_s, used, total in rows:
        card = f"card {used}/{total} MiB"
        print(f"| server {name} | {num_blocks} blocks, ready {ready_s:.1f} s, {card} |")
    print(f"| third server | refused in {took:.1f} s |")
    print(f"| verdict | {'; '.join(failures) or 'ok'} |")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
