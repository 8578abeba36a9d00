"""What LoRA adapters cost on the served path (one device call): `lantau serve` without
adapters, then the same model with `--lora-modules` (rank --rank on all seven projections,
--max-loras slots), each driven by `lantau bench serve` with the same runs; on the adapter
server the runs go once to the base model and once to an adapter.

    python3 benchmarks/gpu_lora.py [--model random:llama3-8b] [--rank 16] [--max-loras 4]
        [--runs W1:16:300,W1:inf:300] --out $OUT

Prints a table last: output tok/s, TTFT and ITL mean / P95 for each (server, model, run),
and writes gpu_lora.json. The adapters are random (written by gpu_features.write_adapter), so
only their cost is measured here; their tokens are checked against HF + PEFT in
tests/test_lora.py and on the device by gpu_features.py.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from gpu_features import write_adapter
from gpu_serve import free_port, serve_runs, start_server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--runs", default="W1:16:300,W1:inf:300")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from lantau.engine.args import build_engine_config

    config = build_engine_config(args.model)[0].model_config
    folder = tempfile.mkdtemp()
    write_adapter(f"{folder}/brand", config, 1, rank=args.rank)
    specs = args.runs.split(",")
    servers = {
        "no adapters": [],
        f"{args.max_loras} slots": ["--lora-modules", f"brand={folder}/brand",
                                     "--max-loras", str(args.max_loras)],  # fmt: skip
    }  # fmt: skip
    rows = []
    for name, extra in servers.items():
        port = free_port()
        proc, ready_s = start_server(args.model, port, extra, out / f"server-{len(rows)}.log")
        print(f"{name}: ready in {ready_s:.1f} s", flush=True)
        try:
            for model in [None] + (["brand"] if extra else []):
                for run in serve_runs(f"http://127.0.0.1:{port}", specs, model=model):
                    rows.append({"server": name, "model": model or "base", "ready_s": ready_s,
                                 **run})  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    (out / "gpu_lora.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.model}, adapter rank {args.rank}")
    print(f"{'server':<14} {'model':<6} {'run':<12} {'tok/s':>7} {'TTFT mean/p95':>15} "
          f"{'ITL mean/p95':>13} {'errors':>6}")  # fmt: skip
    for r in rows:
        s = r["summary"]
        print(f"{r['server']:<14} {r['model']:<6} {r['spec']:<12} {s['output_throughput']:>7.0f} "
              f"{s['ttft']['mean']:>7.1f}/{s['ttft']['p95']:<7.1f} "
              f"{s['itl']['mean']:>6.2f}/{s['itl']['p95']:<6.2f} {s['num_errors']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
