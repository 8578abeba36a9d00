"""cuBLAS (F.linear) on llama3-8b's projections at a decode step's row counts against large M.

W3-1000's decode steps run the projections at M = 376 (375 rows padded to the CUDA-graph
bucket, a multiple of 8). At such M the tile grid is small against 132 SMs (qkv at 128 x 256
tiles: 72 tiles), so the rate may sit below the large-M rate: this measures by how much, per
projection, as the lead for a persistent / stream-K GEMM (H200, runs/2026-12-03h-gemm_rows.log:
80-95 % of the large-M rate at 376). Each shape runs 8 weight copies in a row inside a
CUDA graph (no L2 reuse of weights, no launch gaps); a check against fp32 guards the shapes.

    PYTHONPATH=. python3 benchmarks/gpu_gemm_rows.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from lantau.bench.offline import graph_ms

SHAPES = {  # name -> (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ROWS = (128, 256, 376, 384, 512, 768, 1024, 8192)
COPIES = 8


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results: dict = {}
    table = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        row = {}
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = xs[0][:4].float() @ ws[0].float().T
            out = F.linear(xs[0], ws[0])[:4].float()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, m, err)

            def run(xs=xs, ws=ws):
                for x, w in zip(xs, ws, strict=True):
                    F.linear(x, w)

            ms = graph_ms(run) / COPIES
            row[m] = round(2 * m * n * k / ms / 1e9, 1)  # TFLOP/s
            del xs
        results[name] = row
        table.append(f"| {name} {n}x{k} | " + " | ".join(f"{row[m]}" for m in ROWS) + " |")
        print(table[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_gemm_rows.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| cuBLAS TFLOP/s at M = | " + " | ".join(str(m) for m in ROWS) + " |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
