"""The fp8 KV cache on one H200, in about 5 minutes: the attention kernels and the KV writes on an
fp8 cache against the torch reference at llama3-8b's shapes (32 query heads, 8 kv heads, head
128); decode attention's time on an fp8 cache against a bf16 one at several batch / context
sizes (half the KV bytes read; three other tiles tried on fp8); W2 and W3-1000 on
random:llama3-8b with kv_cache_dtype fp8 against auto (ms/token, tok/s, the KV cache's token
capacity, greedy tokens against auto's).
Prints a short table last and writes everything as JSON to $OUT/gpu_fp8_kv.json.

    PYTHONPATH=. python3 benchmarks/gpu_fp8_kv.py [--w3-prompts 256] [--skip engines]
        [--decode-sizes 384x192,256x2048] [--fp8-tiles '128,4,1;64,4,1'] [--num-splits 1,2,4]

Each stage runs on its own: a failure is reported and the next stage still runs. The engines
take token-id prompts and detokenize nothing: no tokenizer (or `.gl`) needed.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from _stages import Stages, rel_err

stage = Stages()
RESULTS, TABLE = stage.results, stage.table
FP8 = torch.float8_e4m3fn
# llama3-8b's attention: query heads, kv heads, head_dim; the engine's block size
HQ, HK, D, BS = 32, 8, 128, 16
# module constants, so a CPU dry run (TRITON_INTERPRET=1) can shrink them
DEV, MODEL, VOCAB = "cuda", "random:llama3-8b", 128256
MIXED_NUM_Q = [512, 300, 64, 1, 1, 1, 1, 1]  # a mixed batch: prefills, a continuation, decodes
MIXED_SEQ = [512, 1324, 2112, 4000, 37, 1, 900, 2048]
DECODE_CHECKS = ((128, 2048), (8, 32768))  # (requests, context) of the decode checks


def to_fp8(kv: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """A [2, ...] cache quantized as the kernels store it (reference.quantize_kv_ref)."""
    from lantau.kernels.reference import quantize_kv_ref

    return torch.stack((quantize_kv_ref(kv[0], k_scale, FP8), quantize_kv_ref(kv[1], v_scale, FP8)))


def dequant(kv8: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    return torch.stack((kv8[0].float() * k_scale, kv8[1].float() * v_scale))


def random_tables(num_reqs: int, blocks_per: int, dev) -> torch.Tensor:
    perm = torch.randperm(num_reqs * blocks_per, device=dev, dtype=torch.int32)
    return perm.view(num_reqs, blocks_per)


@stage("kernels")
def check_kernels() -> None:
    """fp8-cache kernels at llama3-8b's shapes: against the reference on the dequantized cache
    (tight: bf16 rounding only) and on the bf16 cache quantized (the fp8 error itself)."""
    from lantau.kernels import decode_attention as da
    from lantau.kernels import unified_attention as ua
    from lantau.kernels.reference import paged_attention_ref, paged_decode_attention_ref

    dev, bf16, scale = DEV, torch.bfloat16, D**-0.5
    res = {}
    # the mixed batch with non-unit scales
    k_scale, v_scale = 0.02, 0.015
    num_q, seq = MIXED_NUM_Q, MIXED_SEQ
    blocks_per = -(-max(seq) // BS)
    kv = torch.randn(2, len(seq) * blocks_per, BS, HK, D, device=dev, dtype=bf16)
    kv8 = to_fp8(kv, k_scale, v_scale)
    tables = random_tables(len(seq), blocks_per, dev)
    qsl = torch.tensor([0, *torch.tensor(num_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(seq, dtype=torch.int32, device=dev)
    q = torch.randn(sum(num_q), HQ, D, device=dev, dtype=bf16)
    out = torch.full_like(q, float("nan"))
    ua.unified_attention(
        q, kv8, out, qsl, seq_lens, tables, max(num_q), max(seq), scale, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    meta = (qsl, seq_lens, tables, max(num_q), max(seq), scale)
    res["unified_vs_dequantized"] = rel_err(
        out, paged_attention_ref(q.float(), dequant(kv8, k_scale, v_scale), *meta)
    )
    res["unified_vs_bf16_cache"] = rel_err(out, paged_attention_ref(q.float(), kv.float(), *meta))
    del kv, kv8
    # decode-only, the engine's scales (1.0)
    for num_reqs, ctx in DECODE_CHECKS:
        kvd = torch.randn(2, num_reqs * ctx // BS, BS, HK, D, device=dev, dtype=bf16)
        kvd8 = to_fp8(kvd)
        tables = random_tables(num_reqs, ctx // BS, dev)
        lens = torch.randint(ctx // 2, ctx + 1, (num_reqs,), device=dev, dtype=torch.int32)
        q = torch.randn(num_reqs, HQ, D, device=dev, dtype=bf16)
        out = torch.full_like(q, float("nan"))
        da.paged_decode_attention(q, kvd8, out, lens, tables, ctx, scale)
        key = f"decode_{num_reqs}x{ctx}"
        ref8 = paged_decode_attention_ref(q.float(), dequant(kvd8), lens, tables, scale)
        res[f"{key}_vs_dequantized"] = rel_err(out, ref8)
        ref = paged_decode_attention_ref(q.float(), kvd.float(), lens, tables, scale)
        res[f"{key}_vs_bf16_cache"] = rel_err(out, ref)
        del kvd, kvd8
    res.update(check_kv_writes(dev, bf16, scale))
    RESULTS["kernels"] = res
    tight = max(v for k, v in res.items() if k.endswith("_vs_dequantized"))
    loose = max(v for k, v in res.items() if k.endswith("_vs_bf16_cache"))
    TABLE.append(("fp8 attention vs ref, dequantized cache", f"{tight:.2e}", "tol 1e-2 (bf16)"))
    TABLE.append(
        ("fp8 attention vs ref, bf16 cache", f"{loose:.2e}", "CPU: 3.2-3.9e-2 (N(0,1) KV)")
    )
    TABLE.append(
        (
            "fp8 KV writes",
            f"rotary: {res['rotary_keys_differ']:.1e} keys, {res['rotary_values_differ']:.1e}"
            " values differ",
            f"rope-in-decode: {res['decode_rope_bytes_differ']} of {4 * 2 * HK * D} bytes "
            f"differ, out {res['decode_rope_out']:.1e}",
        )
    )
    print(json.dumps(res, indent=1), flush=True)


def check_kv_writes(dev, dtype, scale) -> dict:
    """The rotary kernel's fp8 write against write_kv_cache_ref (the reference rounds the
    rotated key to bf16 first: ~2 % of keys one e4m3 step apart, values equal), and decode
    attention's in-launch rotary + write (small batches) against the rotary kernel then
    attention: equal."""
    from lantau.kernels import decode_attention as da
    from lantau.kernels import reference as ref
    from lantau.kernels import rotary
    from lantau.model.llama import rope_inv_freq
    from lantau.model.ops import build_cos_sin_cache
    from lantau.model.random_weights import RANDOM_SHAPES

    res = {}
    cfg = RANDOM_SHAPES["llama3-8b"]
    cos_sin = build_cos_sin_cache(rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling).to(dev), 8192)
    t, num_blocks = (8192, 4096) if DEV == "cuda" else (64, 32)
    qkv = torch.randn(t, (HQ + 2 * HK) * D, device=dev, dtype=dtype)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=1)
    q, k, v = q.view(t, HQ, D), k.view(t, HK, D), v.view(t, HK, D)
    pos = torch.randint(0, 8192, (t,), device=dev)
    slots = torch.randperm(num_blocks * BS, device=dev)[:t]
    cache = torch.zeros(2, num_blocks, BS, HK, D, device=dev, dtype=FP8)
    cache_ref = cache.clone()
    q_ref, k_ref = ref.rotary_ref(q, k, pos, cos_sin)
    ref.write_kv_cache_ref(k_ref, v, cache_ref, slots, 0.02, 0.015)
    rotary.apply_rotary_and_write_kv(
        q, k, v, pos, cos_sin, cache, slots, k_scale=0.02, v_scale=0.015
    )
    differ = cache.view(torch.uint8) != cache_ref.view(torch.uint8)
    # [2, tokens, HK, D]: the written slots' keys and values
    written = differ.flatten(1, 2)[:, slots]
    res["rotary_keys_differ"] = written[0].float().mean().item()  # CPU: 1.9 %
    res["rotary_values_differ"] = written[1].float().mean().item()  # 0: no double rounding
    res["rotary_untouched_differ"] = int(differ.sum() - written.sum())  # 0
    res["rotary_q"] = rel_err(q, q_ref)
    # 4 decode rows over an fp8 cache: rotary + write inside attention, or before it
    num_reqs, ctx = 4, 3000 if DEV == "cuda" else 300
    kv8 = to_fp8(torch.randn(2, num_reqs * 256, BS, HK, D, device=dev, dtype=dtype))
    tables = random_tables(num_reqs, 256, dev)
    lens = torch.tensor([ctx, 17, ctx // 3, ctx * 5 // 6], dtype=torch.int32, device=dev)
    pos = (lens - 1).long()
    slots = tables.long().gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS
    qkv = torch.randn(num_reqs, (HQ + 2 * HK) * D, device=dev, dtype=dtype)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=1)
    q, k, v = q.view(num_reqs, HQ, D), k.view(num_reqs, HK, D), v.view(num_reqs, HK, D)
    unfused_cache, q_rot = kv8.clone(), q.clone()
    rotary.apply_rotary_and_write_kv(q_rot, k, v, pos, cos_sin, unfused_cache, slots)
    out_ref = torch.empty_like(q)
    da.paged_decode_attention(q_rot, unfused_cache, out_ref, lens, tables, ctx, scale)
    fused_cache, out = kv8.clone(), torch.empty_like(q)
    rope = da.DecodeRope(k, v, pos, cos_sin, slots)
    da.paged_decode_attention(q, fused_cache, out, lens, tables, ctx, scale, rope=rope)
    res["decode_rope_out"] = rel_err(out, out_ref)  # CPU: 0
    # the bytes of the 4 slots written (CPU: none differ; an FMA contracted otherwise than in
    # the rotary kernel could move a rare key one e4m3 step)
    differ = fused_cache.view(torch.uint8) != unfused_cache.view(torch.uint8)
    res["decode_rope_bytes_differ"] = int(differ.sum())
    return res


# decode attention tiles (BLOCK_N, num_warps, num_stages) tried on the fp8 cache besides the
# default (decode_attention.default_tile: 128 keys over 2 warps): the old default over 4 warps,
# and 64-key tiles (half the bytes of a bf16 tile, faster at short contexts on an H100)
FP8_TILES = ((128, 4, 2), (64, 4, 2), (64, 2, 2))
SPLITS: tuple[int, ...] = ()  # --num-splits: the fp8 cache's default tile at these split counts


def time_decode(da, args, config=None, num_splits=None) -> float:
    """Median microseconds of one paged_decode_attention launch."""
    import triton.testing

    def launch():
        return da.paged_decode_attention(*args, config=config, num_splits=num_splits)

    return round(1000 * triton.testing.do_bench(launch, return_mode="median"), 1)


@stage("decode-timing")
def decode_timing(sizes: list[tuple[int, int]]) -> None:
    """paged_decode_attention (default splits and tile) on a bf16 cache and on its fp8 copy:
    time, KV bytes read a second, the speed-up; and the fp8 cache's best of FP8_TILES."""
    from lantau.kernels import decode_attention as da

    dev, scale, out = DEV, D**-0.5, {}
    for num_reqs, ctx in sizes:
        blocks_per = -(-ctx // BS)  # a last block partly filled where BS does not divide ctx
        kv = torch.randn(2, num_reqs * blocks_per, BS, HK, D, device=dev, dtype=torch.bfloat16)
        caches = {"bf16": kv, "fp8": to_fp8(kv)}
        tables = random_tables(num_reqs, blocks_per, dev)
        lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(num_reqs, HQ, D, device=dev, dtype=torch.bfloat16)
        o = torch.empty_like(q)
        row = {}
        for name, cache in caches.items():
            us = time_decode(da, (q, cache, o, lens, tables, ctx, scale))
            kv_bytes = num_reqs * ctx * HK * D * 2 * cache.element_size()
            row[f"{name}_us"] = us
            row[f"{name}_tb_s"] = round(kv_bytes / us / 1e6, 2)
        row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 2)
        tiles = {
            t: time_decode(da, (q, caches["fp8"], o, lens, tables, ctx, scale), t)
            for t in FP8_TILES
        }
        best = min(tiles, key=tiles.get)
        row["fp8_tiles_us"] = {str(t): us for t, us in tiles.items()}
        args = (q, caches["fp8"], o, lens, tables, ctx, scale)
        row["fp8_default_splits"] = da.default_num_splits(num_reqs, HK, ctx, q.device)
        row["fp8_splits_us"] = {n: time_decode(da, args, num_splits=n) for n in SPLITS}
        row["fp8_best_tile"], row["fp8_best_tile_us"] = list(best), tiles[best]
        out[f"{num_reqs}x{ctx}"] = row
        print(num_reqs, ctx, row, flush=True)
        TABLE.append(
            (
                f"decode attn {num_reqs}x{ctx}",
                f"fp8 {row['fp8_us']} us, bf16 {row['bf16_us']} us ({row['speedup']}x)",
                f"KV read {row['fp8_tb_s']} / {row['bf16_tb_s']} TB/s; fp8 tile {best}: "
                f"{tiles[best]} us; splits (default {row['fp8_default_splits']}) "
                + ", ".join(f"{n}: {us}" for n, us in row["fp8_splits_us"].items()),
            )
        )
        del kv, caches
        torch.cuda.empty_cache()
    RESULTS["decode_timing"] = out


@stage("engines")
def engines(w3_prompts: int) -> None:
    """MODEL with kv_cache_dtype auto, then fp8 (one engine each, W3's sizes):
    start-up, the cache's token capacity, greedy tokens against auto's, W2 and W3-1000."""
    from lantau import LLM
    from lantau.bench.offline import engine_sizes, greedy_agreement, run_lantau
    from lantau.bench.workloads import make_workload

    max_num_seqs, max_tokens = engine_sizes("W3-1000", None, None)
    prompts = make_workload("in:100/out:64", VOCAB, 4).prompts
    reference: list[list[int]] = []
    for kv in ("auto", "fp8"):
        arm = {}
        t = time.perf_counter()
        llm = LLM(
            MODEL, kv_cache_dtype=kv, max_model_len=4096, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_tokens,
        )  # fmt: skip
        arm["start_s"] = round(time.perf_counter() - t, 1)
        cache = llm.config.cache
        arm["kv_blocks"], arm["kv_tokens"] = cache.num_blocks, cache.num_blocks * cache.block_size
        same = 0
        for i, p in enumerate(prompts):
            tokens, n = greedy_agreement(llm, p, reference[i] if kv == "fp8" else None, 64)
            if kv == "auto":
                reference.append(tokens)
            same += n
        arm["greedy_leading_equal"] = f"{same}/{64 * len(prompts)}"
        for spec, n in (("W2", None), ("W3-1000", w3_prompts)):
            arm[spec] = run_lantau(llm, make_workload(spec, VOCAB, n)).summary()
            print(kv, spec, json.dumps(arm[spec]), flush=True)
        RESULTS[f"engine_{kv}"] = arm
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    auto, fp8 = RESULTS["engine_auto"], RESULTS["engine_fp8"]
    TABLE.append(
        (
            "KV cache tokens",
            f"fp8 {fp8['kv_tokens']:,}, auto {auto['kv_tokens']:,}",
            f"{fp8['kv_tokens'] / auto['kv_tokens']:.2f}x; greedy {fp8['greedy_leading_equal']}",
        )
    )
    for spec, figure in (("W2", "ms_per_token"), ("W3-1000", "output_tok_s")):
        a, f = auto[spec], fp8[spec]
        TABLE.append(
            (
                f"{spec} x{f['num_prompts']} fp8 vs auto",
                f"{f['ms_per_token']:.2f} vs {a['ms_per_token']:.2f} ms/tok",
                f"{f['output_tok_s']:.0f} vs {a['output_tok_s']:.0f} tok/s "
                f"({f[figure] / a[figure]:.2f}x {figure})",
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--w3-prompts", type=int, default=256, help="W3-1000's prompts an arm")
    parser.add_argument(
        "--decode-sizes",
        default="1x32768,8x8192,32x4096,64x16384,128x2048,256x2048",
        help="decode-timing batch x context sizes",
    )
    parser.add_argument(
        "--fp8-tiles",
        default="",
        help="the fp8 tiles tried, BLOCK_N,num_warps,num_stages each, ';'-separated "
        "(default: FP8_TILES)",
    )
    parser.add_argument(
        "--num-splits", default="", help="split counts timed on the fp8 cache, e.g. 1,2,4"
    )
    parser.add_argument("--skip", default="", help="comma-separated: kernels, decode, engines")
    args = parser.parse_args()
    global FP8_TILES, SPLITS
    SPLITS = tuple(int(n) for n in args.num_splits.split(",") if n)
    if args.fp8_tiles:
        FP8_TILES = tuple(tuple(int(x) for x in t.split(",")) for t in args.fp8_tiles.split(";"))
    skip = set(args.skip.split(","))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if "kernels" not in skip:
        check_kernels()
    if "decode" not in skip:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.decode_sizes.split(",")]
        decode_timing(sizes)
    if "engines" not in skip:
        engines(args.w3_prompts)
    stage.report("gpu_fp8_kv.json")


if __name__ == "__main__":
    main()
