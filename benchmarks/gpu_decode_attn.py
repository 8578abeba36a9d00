"""Decode attention on the lent GPU at the W3 and W2 shapes: split counts and tilings of the
split decode kernel, each checked against the torch reference and timed as a CUDA graph, in
TB/s of KV read (llama3-8b heads, bf16, a paged cache with shuffled blocks).

W3-1000's decode steps spend ~55 us a row in attention where a uniform-length batch would take
~44 (4.5 TB/s): mixed context lengths (1000 to 2000) leave a tail of long programs. More splits
per request even the programs out, at the cost of a merge.

    PYTHONPATH=. python3 benchmarks/gpu_decode_attn.py
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch

from lantau.bench.offline import graph_ms
from lantau.kernels import paged_attention as pa

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run (TRITON_INTERPRET=1)
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # interpreter: no bf16 dot
CONFIGS = [  # (BLOCK_N, num_warps, num_stages); the first is today's default
    (64, 4, 3),
    (64, 4, 2),
    (64, 4, 4),
    (32, 4, 3),
    (32, 2, 4),
    (128, 4, 2),
    (128, 8, 2),
    (64, 8, 3),
]
SPLITS = (1, 2, 4, 8)
HEADS_FIRST = False  # --heads-first: grid (kv heads, requests, splits)


def shapes(small: bool) -> dict[str, list[int]]:
    rng = random.Random(0)
    n = 2 if small else 384
    lo, hi = (100, 200) if small else (1000, 2000)
    mixed = [rng.randrange(lo, hi) for _ in range(n)]
    return {
        f"W3-1000 decode {n} rows, 1000-2000 keys": mixed,
        "same, longest first": sorted(mixed, reverse=True),
        f"{n} rows x 1500 keys": [150 if small else 1500] * n,
        "W2 1 row x 640 keys": [64 if small else 640],
    }


def make(seq_lens: list[int], seed: int = 0, shuffle: bool = True):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    blocks_per = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per) + 1
    ids = list(range(1, num_blocks))
    if shuffle:  # scattered, as blocks come to long-running requests; else in order per row
        random.Random(seed).shuffle(ids)
    table = torch.zeros(len(seq_lens), 4096 // BLOCK, dtype=torch.int32)  # max_seq_len 4096
    pos = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = torch.tensor(ids[pos : pos + nb])
        pos += nb
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen, device=DEVICE).to(DTYPE)
    q = torch.randn(len(seq_lens), HEADS, DIM, generator=gen, device=DEVICE).to(DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, kv, lens, table.to(DEVICE)


def grid_order() -> None:
    """--grid-order: the W3-1000 decode shape (longest first, default tiling, 1 split) with the
    cache blocks scattered or in order per request, and the grid request-major or heads first."""
    small = DEVICE == "cpu"
    lens = shapes(small)["same, longest first"]
    nbytes = sum(lens) * KV_HEADS * DIM * 2 * DTYPE.itemsize
    rows = []
    for shuffle in (True, False):
        q, kv, lens_t, blocks = make(lens, shuffle=shuffle)
        out = torch.empty_like(q)
        ref = pa.paged_decode_attention_ref(q, kv, lens_t, blocks, DIM**-0.5)
        for heads_first in (False, True, False):

            def run(args=(q, kv, out, lens_t, blocks), heads_first=heads_first):
                pa.paged_decode_attention(*args, 4096, DIM**-0.5, 1, heads_first=heads_first)

            run()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = graph_ms(run) if not small else float("nan")
            rows.append(
                f"| blocks {'scattered' if shuffle else 'in order'}, "
                f"{'heads first' if heads_first else 'request-major'} | {ms * 1e3:.1f} us | "
                f"{nbytes / ms / 1e9:.2f} TB/s, err {err:.1e} |"
            )
            print(rows[-1], flush=True)
    print("\n| W3-1000 decode, 384 rows | time | KV read |")
    print("\n".join(rows))


def main() -> None:
    small = DEVICE == "cpu"
    print(torch.__version__, torch.cuda.get_device_name() if not small else "cpu", flush=True)
    results, table = {}, []
    for name, seq_lens in shapes(small).items():
        q, kv, lens, blocks = make(seq_lens)
        nbytes = sum(seq_lens) * KV_HEADS * DIM * 2 * kv.element_size()
        out = torch.empty_like(q)
        ref = pa.paged_decode_attention_ref(q, kv, lens, blocks, DIM**-0.5)
        default = pa.default_num_splits(len(seq_lens), KV_HEADS, 4096, q.device)
        splits = sorted({default, *(SPLITS if len(seq_lens) > 1 else (4, 8, 16, 32))})
        row = {}
        for num_splits in splits:
            for cfg in CONFIGS:
                key = f"splits {num_splits} {cfg}"

                def run(args=(q, kv, out, lens, blocks), num_splits=num_splits, cfg=cfg):
                    pa.paged_decode_attention(
                        *args, 4096, DIM**-0.5, num_splits, cfg, heads_first=HEADS_FIRST
                    )

                try:
                    run()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = graph_ms(run) if not small else float("nan")
                except Exception as e:  # a tiling that does not compile is skipped
                    print(name, key, type(e).__name__, str(e)[:100], flush=True)
                    continue
                row[key] = {"ms": ms, "tb_s": nbytes / ms / 1e9, "rel_err": err}
                print(f"{name} | {key} | {ms:.4f} ms | {nbytes / ms / 1e9:.2f} TB/s | "
                      f"err {err:.1e}", flush=True)  # fmt: skip
        results[name] = row
        base = row.get(f"splits {default} {CONFIGS[0]}")
        best = min(row, key=lambda k: row[k]["ms"])
        table.append(
            f"| {name} | default (splits {default}, {CONFIGS[0]}): "
            f"{base['tb_s'] if base else float('nan'):.2f} TB/s | best {best}: "
            f"{row[best]['tb_s']:.2f} TB/s, {row[best]['ms'] * 1e3:.1f} us, err "
            f"{row[best]['rel_err']:.1e} |"
        )
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_decode_attn.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| shape | default | best |")
    print("\n".join(table))


if __name__ == "__main__":
    if "--grid-order" in sys.argv:
        grid_order()
    else:
        main()
