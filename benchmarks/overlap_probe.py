"""Would two half-batches on two streams beat one batch? A decode step's layers as lantau runs
them (fp8 projections through `_scaled_mm` with unit tensor-wise scales, decode attention over
an fp8 paged cache) for R rows, against the same work split into two batches of R / 2 rows on
two CUDA streams, each stream its half's layers in order (the dependency of a real step: a
half's layer i + 1 waits for its layer i, the halves never wait on each other), both captured as
one CUDA graph.

Where a step's projections are compute-bound and its attention memory-bound (W3-fp8-1000's
768-row decode: ~9 ms of fp8 GEMMs, ~19 ms of KV reads on an H200), one half's attention may
run beside the other's GEMMs; where both are memory-bound (W4-1000's 171 rows of 70B) each half
reads the weights again and the split should lose. The probe says which, per shape, before any
engine change; norms, rotary and SiLU are left out (a few percent of a step).

    PYTHONPATH=. python3 benchmarks/overlap_probe.py [--shapes W3-1000,W3-128,W4-1000]

Prints a table: serial ms, two-stream ms, their ratio, and what each part takes alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

from lantau.bench.offline import graph_ms
from lantau.kernels.decode_attention import paged_decode_attention
from lantau.model.fp8 import unscaled_mm

BLOCK = 16
MODELS = {  # hidden, (qkv N, o K, gate_up N, down K), heads, kv heads
    "8b": (4096, (6144, 4096, 28672, 14336), 32, 8),
    "70b": (8192, (10240, 8192, 57344, 28672), 64, 8),
}
SHAPES = {  # name -> (model, rows, keys a row, layers timed)
    "W3-1000": ("8b", 768, 1500, 8),
    "W3-128": ("8b", 768, 200, 8),
    "W3-2048": ("8b", 384, 2100, 8),
    "W4-1000": ("70b", 172, 1500, 4),
    "W4-128": ("70b", 512, 200, 4),
}


class Layer:
    """One decoder layer's fp8 weights (e4m3, random) and its paged fp8 KV cache."""

    def __init__(self, model: str, rows: int, keys: int, seed: int) -> None:
        hidden, (qkv_n, o_k, gate_up_n, down_k), _, kv_heads = MODELS[model]
        gen = torch.Generator("cuda").manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:
            w = torch.randn(n, k, generator=gen, device="cuda") * 0.05
            return w.to(torch.float8_e4m3fn)

        self.qkv, self.o = weight(qkv_n, hidden), weight(hidden, o_k)
        self.gate_up, self.down = weight(gate_up_n, hidden), weight(hidden, down_k)
        blocks_per = -(-keys // BLOCK)
        num_blocks = rows * blocks_per + 1
        self.kv = torch.randn(2, num_blocks, BLOCK, kv_heads, 128, generator=gen, device="cuda")
        self.kv = self.kv.to(torch.float8_e4m3fn)
        ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(ids)  # scattered, as a long-running batch's blocks are
        self.tables = torch.tensor(ids, dtype=torch.int32, device="cuda").view(rows, blocks_per)
        self.seq_lens = torch.full((rows,), keys, dtype=torch.int32, device="cuda")
        self.max_seq_len = blocks_per * BLOCK


def projections(x8: torch.Tensor, layer: Layer) -> torch.Tensor:
    """qkv, o, gate_up and down of a layer for x8's rows (e4m3), the products cast back to
    e4m3 as the next one's input (the quantizing writers' place)."""
    qkv = unscaled_mm(x8, layer.qkv)
    o_in = qkv[:, : layer.o.shape[1]].to(torch.float8_e4m3fn)
    h = unscaled_mm(o_in, layer.o).to(torch.float8_e4m3fn)
    gate_up = unscaled_mm(h, layer.gate_up)
    down_in = gate_up[:, : layer.down.shape[1]].to(torch.float8_e4m3fn)
    return unscaled_mm(down_in, layer.down).to(torch.float8_e4m3fn)


def attention(q: torch.Tensor, out: torch.Tensor, layer: Layer, rows: slice) -> None:
    # one split (what the heuristic picks at these batch sizes anyway): a split launch's merge
    # counters are one buffer a device, which two streams at once would share
    paged_decode_attention(
        q, layer.kv, out, layer.seq_lens[rows], layer.tables[rows], layer.max_seq_len,
        128**-0.5, num_splits=1,
    )  # fmt: skip


def run_half(x8, q, out, layers: list[Layer], rows: slice) -> None:
    """A batch's layers in order: each layer's projections, then its attention."""
    for layer in layers:
        x8 = projections(x8, layer)
        attention(q, out, layer, rows)


def probe(name: str, model: str, rows: int, keys: int, num_layers: int) -> dict:
    layers = [Layer(model, rows, keys, seed) for seed in range(num_layers)]
    hidden, heads = MODELS[model][0], MODELS[model][2]
    x8 = torch.randn(rows, hidden, device="cuda").to(torch.float8_e4m3fn)
    q = torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    half = rows // 2
    a, b = slice(0, half), slice(half, rows)
    side = torch.cuda.Stream()

    def two_streams() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        run_half(x8[a], q[a], out[a], layers, a)
        with torch.cuda.stream(side):
            run_half(x8[b], q[b], out[b], layers, b)
        main.wait_stream(side)

    res = {
        "serial": graph_ms(lambda: run_half(x8, q, out, layers, slice(0, rows))),
        "two streams": graph_ms(two_streams),
        "gemms": graph_ms(lambda: [projections(x8, layer) for layer in layers]),
        "attention": graph_ms(
            lambda: [attention(q, out, layer, slice(0, rows)) for layer in layers]
        ),
        "half serial": graph_ms(lambda: run_half(x8[a], q[a], out[a], layers, a)),
    }
    res["ratio"] = res["two streams"] / res["serial"]
    print(name, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="W3-1000,W3-128,W3-2048,W4-1000,W4-128")
    args = p.parse_args()
    results, table = {}, []
    for name in args.shapes.split(","):
        model, rows, keys, num_layers = SHAPES[name]
        label = f"{name} decode: {model}, {rows} rows x {keys} keys, {num_layers} layers"
        try:
            r = results[name] = probe(name, model, rows, keys, num_layers)
        except Exception as e:  # the next shape still runs
            table.append(f"| {label} | FAILED | {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        finally:
            torch.cuda.empty_cache()  # the shape's layers and caches
        table.append(
            f"| {label} | {r['serial']:.3f} | {r['two streams']:.3f} ({r['ratio']:.3f}) | "
            f"{r['gemms']:.3f} + {r['attention']:.3f} | {r['half serial']:.3f} |"
        )
    with open(os.path.join(os.environ.get("OUT", "."), "overlap_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(
        "\n| shape | serial ms | two streams ms (ratio) | GEMMs + attention alone ms "
        "| one half ms |\n| --- | --- | --- | --- | --- |"
    )
    print("\n".join(table))


if __name__ == "__main__":
    main()
