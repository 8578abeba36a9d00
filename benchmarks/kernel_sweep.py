"""Tile sweeps of one kernel at llama3-8b's shapes on the lent GPU, each tiling checked against
its torch reference; the best per shape is printed against the default in a closing table.

    --kernel gemv          each batch-1 projection (32 weight copies rotated through a CUDA
                           graph, so L2 holds none): cuBLAS, the K-loop tilings (default, or all
                           with --all), with and without PDL, and the preloading tilings; TB/s
    --kernel decode-attn   split decode attention: split counts x tiles at W3-1000's decode
                           (384 rows of 1000-2000 keys) and W2's (1 row, 640 keys); TB/s of KV
    --kernel prefill-attn  unified attention tiles at the W3 / W5 prefill shapes; TFLOP/s; with
                           --kv-dtype fp8 over an e4m3 cache; where every request is a whole
                           prompt, fresh_attention's tiles over the step's own bf16 k / v, and
                           (one length) torch's SDPA (flash and cuDNN, contiguous bf16 K/V) as
                           the same-run ceilings; where a step begins with decodes, the engine's
                           op with them apart (decode kernel) against one unified launch

    PYTHONPATH=. python3 benchmarks/kernel_sweep.py --kernel gemv [--all]

Results go to $OUT/kernel_sweep-<kernel>.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random

import torch

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16  # llama3-8b attention; 16-token cache blocks
GEMV_SHAPES = {  # name -> (N, K, copies)
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}
GEMV_TILES = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8), (3, 4)))
PRELOAD_TILES = [(2, 0, 4, 1), (4, 0, 4, 1), (4, 0, 8, 1), (8, 0, 8, 1), (2, 0, 2, 1)]
DECODE_TILES = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 1), (32, 4, 3), (128, 8, 2)]
PREFILL_TILES = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the default
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 4, 2),
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
    (16, 64, 4, 2), (16, 128, 4, 2), (32, 64, 4, 2), (32, 128, 4, 2), (16, 64, 2, 2),
    (16, 128, 2, 2), (16, 256, 4, 2), (32, 128, 8, 2), (256, 64, 8, 2), (128, 32, 4, 2),
]  # fmt: skip
# fresh_attention's (BLOCK_M, BLOCK_N, num_warps, num_stages, HEADS); the first is its default
FRESH_TILES = [
    (64, 64, 4, 3, 1), (128, 64, 8, 2, 1), (128, 64, 4, 2, 1), (128, 64, 8, 3, 1),
    (128, 128, 8, 2, 1), (128, 128, 8, 3, 1), (64, 64, 4, 2, 1), (64, 128, 4, 2, 1),
    (128, 32, 4, 3, 1), (128, 64, 8, 2, 4), (128, 64, 4, 2, 4), (128, 128, 8, 2, 4),
    (256, 64, 8, 2, 4), (128, 64, 8, 2, 2), (256, 64, 8, 2, 1),
]  # fmt: skip
PREFILL_SHAPES = {  # name -> [(context before, new tokens)] per request
    "W3-2048 prefill step 32x2048": [(0, 2048)] * 32,
    "W3-2048 prefill 4x2048": [(0, 2048)] * 4,
    "W3-1000 prefill 8x1000": [(0, 1000)] * 8,
    "W3-128 prefill 64x128": [(0, 128)] * 64,
    "W5 chunk 16x512 after 512": [(512, 512)] * 16,
    "W3 mixed 8x1000 + 256 decodes at 1500": [(0, 1000)] * 8 + [(1499, 1)] * 256,
    # as the scheduler orders a step (running decodes first): also timed with the decodes
    # through the decode kernel (TritonOps.attention's num_decodes) against one launch
    "W3 mixed 256 decodes at 1500 + 8x1000": [(1499, 1)] * 256 + [(0, 1000)] * 8,
    "W3-2048 mixed 230 decodes at 2100 + 4x2048": [(2099, 1)] * 230 + [(0, 2048)] * 4,
    # W1 at 16 req/s: a 467-token prompt in two chunks (or one) beside ~20 decodes
    "W1 chunk 1: 236 + 20 decodes at 600": [(0, 236)] + [(599, 1)] * 20,
    "W1 chunk 2: 231 after 236 + 20 decodes at 600": [(236, 231)] + [(599, 1)] * 20,
    "W1 whole: 467 + 20 decodes at 600": [(0, 467)] + [(599, 1)] * 20,
    "W1 chunk 2 alone: 231 after 236": [(236, 231)],
    "W1 20 decodes at 600 alone": [(599, 1)] * 20,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged_batch(requests: list[tuple[int, int]], seed: int = 0):
    """q [num_tokens, HEADS, DIM], a KV cache with shuffled blocks, query_start_loc, seq_lens
    and block tables for requests of (context before, new tokens)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    blocks_per = [-(-(c + n) // BLOCK) for c, n in requests]
    num_blocks = sum(blocks_per) + 1
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)  # scattered, as blocks come to long-running requests
    table = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = torch.tensor(ids[pos : pos + nb])
        pos += nb
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda")
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    qsl = [0, *itertools.accumulate(n for _, n in requests)]
    seq = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    return (
        q, kv.bfloat16(), torch.tensor(qsl, dtype=torch.int32, device="cuda"), seq.cuda(),
        table.cuda(),
    )  # fmt: skip


def sweep_gemv(all_tiles: bool) -> tuple[dict, list[str]]:
    import torch.nn.functional as F

    from lantau.bench.offline import graph_ms
    from lantau.kernels.gemv import PRELOAD_MAX_K, default_config, gemv
    from lantau.kernels.reference import gemv_ref

    results, table = {}, []
    for name, (n, k, copies) in GEMV_SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in ws]
        tb_s = sum(w.numel() * 2 for w in ws) / 1e9  # / ms: TB/s
        ref = gemv_ref(xs[0], ws[0])

        def chain(fn, xs=xs, ws=ws):
            return graph_ms(lambda: [fn(x, w) for x, w in zip(xs, ws, strict=True)])

        row = {"cublas": tb_s / chain(F.linear)}
        for tile in GEMV_TILES if all_tiles else [default_config(n, k)]:
            for pdl_on in (True, False):
                if not pdl_on and tile != default_config(n, k):
                    continue
                key = f"{tile}{'' if pdl_on else ' no PDL'}"
                try:
                    if rel_err(gemv(xs[0], ws[0], config=tile), ref) > 1e-2:
                        continue
                    row[key] = tb_s / chain(
                        lambda x, w, t=tile, p=pdl_on: gemv(x, w, config=t, use_pdl=p)
                    )  # noqa: E501
                except Exception as e:  # a tiling that does not build: skipped
                    print(name, key, type(e).__name__, str(e)[:80], flush=True)
        for tile in PRELOAD_TILES if k <= PRELOAD_MAX_K else []:
            if rel_err(gemv(xs[0], ws[0], config=tile, preload=True), ref) > 1e-2:
                continue
            row[f"preload {tile}"] = tb_s / chain(
                lambda x, w, t=tile: gemv(x, w, config=t, preload=True)
            )
        results[name] = row
        best = max(row, key=row.get)
        table.append(
            f"| gemv {name} | cuBLAS {row['cublas']:.2f} TB/s | {best} {row[best]:.2f} TB/s |"
        )
        print(table[-1], json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    return results, table


def sweep_decode_attn() -> tuple[dict, list[str]]:
    from lantau.bench.offline import graph_ms
    from lantau.kernels import decode_attention as da
    from lantau.kernels.reference import paged_decode_attention_ref

    rng = random.Random(0)
    mixed = [rng.randrange(1000, 2000) for _ in range(384)]
    shapes = {
        "W3-1000 decode 384 rows, 1000-2000 keys": mixed,
        "same, longest first": sorted(mixed, reverse=True),
        "W2 1 row x 640 keys": [640],
    }
    results, table = {}, []
    for name, seq_lens in shapes.items():
        q, kv, _, lens, blocks = paged_batch([(s - 1, 1) for s in seq_lens])
        max_seq_len = blocks.shape[1] * BLOCK
        nbytes = sum(seq_lens) * KV_HEADS * DIM * 2 * kv.element_size()
        out = torch.empty_like(q)
        ref = paged_decode_attention_ref(q, kv, lens, blocks, DIM**-0.5)
        default = da.default_num_splits(len(seq_lens), KV_HEADS, max_seq_len, q.device)
        splits = sorted({default, *((1, 2, 4, 8) if len(seq_lens) > 1 else (4, 8, 16, 32))})
        row = {}
        for num_splits, tile in itertools.product(splits, DECODE_TILES):

            def run(num_splits=num_splits, tile=tile, args=(q, kv, out, lens, blocks, max_seq_len)):
                da.paged_decode_attention(*args, DIM**-0.5, num_splits, tile)

            try:
                run()
                if rel_err(out, ref) > 1e-2:
                    continue
                row[f"splits {num_splits} {tile}"] = nbytes / graph_ms(run) / 1e9
            except Exception as e:  # a tiling that does not build: skipped
                print(name, num_splits, tile, type(e).__name__, str(e)[:80], flush=True)
        results[name] = row
        best = max(row, key=row.get)
        base = row.get(f"splits {default} {DECODE_TILES[0]}", float("nan"))
        table.append(f"| decode {name} | default {base:.2f} TB/s | {best} {row[best]:.2f} TB/s |")
        print(table[-1], flush=True)
    return results, table


def sdpa_ceiling_ms(
    q: torch.Tensor, requests: list[tuple[int, int]], backend: str = "FLASH_ATTENTION"
) -> float | None:
    """torch's SDPA (flash, or `backend`: CUDNN_ATTENTION, Hopper's TMA / warpgroup kernels)
    over the same prompts as contiguous bf16 [B, H, L, D] tensors, GQA by expanded K/V views:
    what a dense causal kernel reaches here. None unless every request is a whole prompt of one
    length."""
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if any(c for c, _ in requests) or len({n for _, n in requests}) != 1:
        return None
    b, n = len(requests), requests[0][1]
    qd = q.view(b, n, HEADS, DIM).transpose(1, 2)
    k = torch.randn(b, KV_HEADS, n, DIM, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    g = HEADS // KV_HEADS
    k = k[:, :, None].expand(b, KV_HEADS, g, n, DIM).reshape(b, HEADS, n, DIM)
    v = v[:, :, None].expand(b, KV_HEADS, g, n, DIM).reshape(b, HEADS, n, DIM)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True),
            warmup=25, rep=100, return_mode="median",
        )  # fmt: skip


def fresh_qkv(q: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor, requests):
    """The step's q, k, v as views of one fused qkv buffer [num_tokens, (HEADS + 2 *
    KV_HEADS) * DIM], k and v each whole prompt's keys and values read from the (bf16) cache:
    what fresh_attention reads in the engine."""
    pos = torch.cat([torch.arange(n) for _, n in requests]).cuda()
    req = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(requests)]).cuda()
    slot_block = blocks.long()[req, pos // BLOCK]
    qkv = torch.empty(q.shape[0], (HEADS + 2 * KV_HEADS) * DIM, dtype=q.dtype, device="cuda")
    qv, kv_k, kv_v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    qv = qv.view(-1, HEADS, DIM)
    qv.copy_(q)
    kv_k.view(-1, KV_HEADS, DIM).copy_(kv[0][slot_block, pos % BLOCK])
    kv_v.view(-1, KV_HEADS, DIM).copy_(kv[1][slot_block, pos % BLOCK])
    return qv, kv_k.view(-1, KV_HEADS, DIM), kv_v.view(-1, KV_HEADS, DIM)


def sweep_prefill_attn(
    only: str = "", kv_dtype: str = "bf16", fresh_only: bool = False
) -> tuple[dict, list[str]]:
    import triton.testing

    from lantau.kernels import fresh_attention as fa
    from lantau.kernels import unified_attention as ua
    from lantau.kernels.attention_tiles import FP8_KV_DTYPE
    from lantau.kernels.reference import unified_attention_ref
    from lantau.model.forward_context import AttentionMetadata
    from lantau.model.ops import TritonOps

    results, table = {}, []
    ops = TritonOps()
    for name, requests in PREFILL_SHAPES.items():
        if only not in name:
            continue
        q, kv, qsl, seq, blocks = paged_batch(requests)
        fresh = not any(c for c, _ in requests)
        if fresh:  # whole prompts: fresh_attention over the step's own bf16 k, v
            fresh_ref = unified_attention_ref(q, kv, qsl, seq, blocks, DIM**-0.5)
            fq, fk, fv = fresh_qkv(q, kv, blocks, requests)
        if kv_dtype == "fp8":
            kv = kv.to(FP8_KV_DTYPE)  # unit scales: randn values lie well inside e4m3's range
        max_q, max_s = max(n for _, n in requests), max(c + n for c, n in requests)
        flop = 4.0 * HEADS * DIM * sum(c + i + 1 for c, n in requests for i in range(n))
        ref = unified_attention_ref(q, kv, qsl, seq, blocks, DIM**-0.5)
        out, row = torch.empty_like(q), {}
        try:
            sdpa_ms = sdpa_ceiling_ms(q, requests)
        except Exception as e:  # no flash kernel for this GPU / dtype: no ceiling
            print(name, "sdpa", type(e).__name__, str(e)[:80], flush=True)
            sdpa_ms = None
        for tile in PREFILL_TILES[:1] if fresh_only else PREFILL_TILES:

            def run(tile=tile, args=(q, kv, out, qsl, seq, blocks, max_q, max_s)):
                ua.unified_attention(*args, DIM**-0.5, tile=tile)

            try:
                run()
                if rel_err(out, ref) > 1e-2:
                    continue
                ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                row[str(tile)] = flop / ms / 1e9
                row[f"{tile} us"] = ms * 1e3
            except Exception as e:  # a tiling that does not build (shared memory): skipped
                print(name, tile, type(e).__name__, str(e)[:80], flush=True)
        fresh_row = {}
        for tile in FRESH_TILES if fresh else ():

            def run(tile=tile, args=(fq, fk, fv, out, qsl, seq)):
                fa.fresh_attention(*args, DIM**-0.5, tile=tile)

            try:
                run()
                if rel_err(out, fresh_ref) > 1e-2:
                    print(name, "fresh", tile, "wrong", rel_err(out, fresh_ref), flush=True)
                    continue
                ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                fresh_row[f"fresh {tile}"] = flop / ms / 1e9
                fresh_row[f"fresh {tile} us"] = ms * 1e3
            except Exception as e:
                print(name, "fresh", tile, type(e).__name__, str(e)[:80], flush=True)
        if fresh:
            try:
                cudnn_ms = sdpa_ceiling_ms(q, requests, "CUDNN_ATTENTION")
                row["sdpa cudnn"], row["sdpa cudnn us"] = flop / cudnn_ms / 1e9, cudnn_ms * 1e3
            except Exception as e:
                print(name, "cudnn", type(e).__name__, str(e)[:80], flush=True)
        best = max((k for k in row if not k.endswith("us") and k[0] == "("), key=row.get)
        base = str(PREFILL_TILES[0])
        ceiling = "-"
        num_decodes = next((i for i, (_, n) in enumerate(requests) if n != 1), len(requests))
        if num_decodes:  # leading decodes: one launch (default tiles) against them apart
            for arm, n in (("one launch", 0), ("decodes apart", num_decodes)):
                meta = AttentionMetadata(None, qsl, seq, blocks, max_q, max_s, n)
                attend = functools.partial(ops.attention, q, kv, meta, DIM**-0.5)
                if rel_err(attend(), ref) > 1e-2:
                    print(name, arm, "wrong", flush=True)
                    continue
                ms = triton.testing.do_bench(attend, warmup=25, rep=100, return_mode="median")
                row[arm], row[f"{arm} us"] = flop / ms / 1e9, ms * 1e3
            ceiling = (
                f"one launch {row.get('one launch us', float('nan')):.1f} us, decodes apart "
                f"{row.get('decodes apart us', float('nan')):.1f} us"
            )
        if sdpa_ms:
            row["sdpa flash"], row["sdpa flash us"] = flop / sdpa_ms / 1e9, sdpa_ms * 1e3
            ceiling = f"{row['sdpa flash']:.1f} TFLOP/s"
        if fresh_row:
            fbest = max((k for k in fresh_row if not k.endswith("us")), key=fresh_row.get)
            fbase = f"fresh {FRESH_TILES[0]}"
            ceiling += (
                f"; fresh default {fresh_row.get(fbase, float('nan')):.1f}, best {fbest} "
                f"{fresh_row[fbest]:.1f} TFLOP/s ({fresh_row[fbest + ' us']:.1f} us); cudnn "
                f"{row.get('sdpa cudnn', float('nan')):.1f}"
            )
            row.update(fresh_row)
        results[name] = row
        table.append(
            f"| prefill {kv_dtype} {name} | default {row.get(base, float('nan')):.1f} TFLOP/s, "
            f"{row.get(base + ' us', float('nan')):.1f} us | {best} {row[best]:.1f} TFLOP/s, "
            f"{row[best + ' us']:.1f} us | {ceiling} |"
        )
        print(table[-1], flush=True)
    return results, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", required=True, choices=["gemv", "decode-attn", "prefill-attn"])
    p.add_argument("--all", action="store_true", help="gemv: every K-loop tiling, not the default")
    p.add_argument("--shapes", default="", help="prefill-attn: only shapes whose name has this")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"], help="prefill-attn")
    p.add_argument(
        "--fresh-only", action="store_true",
        help="prefill-attn: of the unified tiles only the first, beside fresh_attention's",
    )  # fmt: skip
    args = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if args.kernel == "gemv":
        results, table = sweep_gemv(args.all)
    elif args.kernel == "decode-attn":
        results, table = sweep_decode_attn()
    else:
        results, table = sweep_prefill_attn(args.shapes, args.kv_dtype, args.fresh_only)
    suffix = f"-{args.kv_dtype}" if args.kernel == "prefill-attn" else ""
    path = os.path.join(os.environ.get("OUT", "."), f"kernel_sweep-{args.kernel}{suffix}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("\n| shape | default | best | ceiling |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
