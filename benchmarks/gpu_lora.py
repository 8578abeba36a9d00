"""What LoRA adapters cost on the served path (one device call): `lantau serve` without
adapters, then the same model with `--lora-modules` (rank --rank on all seven projections,
--max-loras slots), each driven by `lantau bench serve` with the same runs; on the adapter
server the runs go once to the base model and once to an adapter.

    python3 benchmarks/gpu_lora.py [--model random:llama3-8b] [--rank 16] [--max-loras 4]
        [--runs W1:16:300,W1:inf:300] [--kernels-only] --out $OUT

The adapter server serves --max-loras adapters (one a slot), its adapter runs spread over
all of them at random (`lantau bench serve --lora-modules`: a platform's brands at once).

First, per projection of llama3-8b (--max-loras slots of rank --rank, the fused parts side by
side): the adapter delta's device time inside a CUDA graph, lantau/kernels/lora.py's two
launches (at several K splits, and with no adapter row in the step) against the torch
reference's three (lantau.model.lora.add_lora), and their agreement. Then the served runs.

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

SHAPES_8B = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2),
             "down": (14336, 4096, 1)}  # (K, N, fused parts)  # fmt: skip


def graph_us(fn, reps: int = 20) -> float:
    """fn's device time in microseconds, `reps` calls captured in one CUDA graph (the launch
    gaps a replayed step has), the graph replayed 10 times after a warm-up."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compiles and warms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * reps)


def kernel_row(name, k, n, parts, tokens, rank, slots, device="cuda", timer=None):
    """One projection shape at one batch: (what, figure, detail); `timer`: graph_us (a dry
    run on CPU passes its own)."""
    import torch

    from lantau.kernels import lora as kernels
    from lantau.model.lora import LoRABatch, LoRAWeights, add_lora

    dev, width, r = torch.device(device), slots * parts * rank, parts * rank
    timer = timer or graph_us
    a = torch.randn(width, k, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, width, device=dev, dtype=torch.bfloat16) * 0.05
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    y0 = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
    index = torch.arange(tokens, device=dev) % slots  # every row an adapter's
    none = torch.full_like(index, -1)
    batch, weights = LoRABatch(index), LoRAWeights(a, b, r)
    ref, y = y0.clone(), y0.clone()
    add_lora(ref, x, weights, batch)
    kernels.add_lora(y, x, a, b, index, r)
    err = (y.float() - ref.float()).abs().max().item()
    times = {"torch": timer(lambda: add_lora(y, x, weights, batch))}
    default = kernels.default_splits(tokens, k)
    for splits in sorted({1, 2, 4, 8, default}):
        times[f"s{splits}"] = timer(
            lambda s=splits: kernels.add_lora(y, x, a, b, index, r, splits=s)
        )
    times["base rows"] = timer(lambda: kernels.add_lora(y, x, a, b, none, r))
    return (
        f"lora {name} x{tokens} (W {width})",
        f"triton {times[f's{default}']:.1f} vs torch {times['torch']:.1f} us",
        ", ".join(f"{key} {us:.1f}" for key, us in times.items()) + f"; err {err:.1e}",
    )


def kernel_rows(rank: int, slots: int) -> list[tuple[str, str, str]]:
    rows = []
    for name, (k, n, parts) in SHAPES_8B.items():
        for tokens in (1, 20, 64, 256, 1024):  # decode batches, mixed steps
            rows.append(kernel_row(name, k, n, parts, tokens, rank, slots))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--runs", default="W1:16:300,W1:inf:300")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--kernels-only", action="store_true", help="no servers")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels = kernel_rows(args.rank, args.max_loras)
    (out / "gpu_lora_kernels.json").write_text(json.dumps(kernels, indent=1))
    if args.kernels_only:
        print("\n".join(" | ".join(r) for r in kernels))
        return

    from lantau.engine.args import build_engine_config

    config = build_engine_config(args.model)[0].model_config
    folder = tempfile.mkdtemp()
    names = [f"brand{i}" for i in range(args.max_loras)]  # an adapter a slot
    for i, name in enumerate(names):
        write_adapter(f"{folder}/{name}", config, 1 + i, rank=args.rank)
    specs = args.runs.split(",")
    servers = {
        "no adapters": [],
        f"{args.max_loras} adapters": [
            "--lora-modules",
            *(f"{n}={folder}/{n}" for n in names),
            "--max-loras",
            str(args.max_loras),
        ],  # fmt: skip
    }
    rows = []
    for name, extra in servers.items():
        port = free_port()
        proc, ready_s = start_server(args.model, port, extra, out / f"server-{len(rows)}.log")
        print(f"{name}: ready in {ready_s:.1f} s", flush=True)
        try:
            for adapters in [()] + ([tuple(names)] if extra else []):
                base = f"http://127.0.0.1:{port}"
                for run in serve_runs(base, specs, lora_modules=adapters):
                    rows.append({"server": name, "model": "adapters" if adapters else "base",
                                 "ready_s": ready_s, **run})  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    (out / "gpu_lora.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(" | ".join(r) for r in kernels))
    print(f"\n{args.model}, adapter rank {args.rank}")
    print(f"{'server':<14} {'model':<8} {'run':<12} {'tok/s':>7} {'TTFT mean/p95':>15} "
          f"{'ITL mean/p95':>13} {'errors':>6}")  # fmt: skip
    for r in rows:
        s = r["summary"]
        print(f"{r['server']:<14} {r['model']:<8} {r['spec']:<12} {s['output_throughput']:>7.0f} "
              f"{s['ttft']['mean']:>7.1f}/{s['ttft']['p95']:<7.1f} "
              f"{s['itl']['mean']:>6.2f}/{s['itl']['p95']:<6.2f} {s['num_errors']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
