"""Split-KV decode attention: one query per request, over its whole paged context.

The context splits into num_splits partitions processed in parallel (each writes its normalised
partial output and log-sum-exp); the last split of each (request, kv head) to finish merges
them all in the same launch. The long-context decode path, where one program per (request, kv
head) would leave most SMs idle. The grid runs a request's kv heads side by side: a cache block
holds all its heads' keys, so they read the same DRAM pages together.

Small decode batches (`rope`, the CUDA-graph decode steps of up to KernelConfig.attn_small_rows
rows) also read each split's first KV tile before the PDL wait, and do the step's rotary and
KV-cache write inside the launch (one launch a layer fewer).

Reference: lantau.kernels.reference.paged_decode_attention_ref.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lantau.config import AttnMerge
from lantau.kernels import pdl
from lantau.kernels.attention_tiles import (
    FP8_KV_DTYPE,
    LOG2E,
    MIN_BLOCK_M,
    attend_tile,
    attend_tile_pairs,
    check_kv_scales,
    check_paged_inputs,
    dot_operand,
    dot_precision,
    join_pairs,
    kv_strides,
    load_kv,
    quantize_kv,
    softmax_step,
    split_pairs,
    tile_slots,
)
from lantau.kernels.device import num_sms
from lantau.kernels.pdl import pdl_wait

_DECODE_BLOCK_N = 64  # keys per iteration (a module constant so tests can shrink it)
# 2 stages, not 3: faster at 384 rows of 1000-2000 keys on an H200, more so with the longest
# first (the scheduler's order: oldest first)
_DECODE_STAGES = 2
# split heuristic: about 4 decode programs per SM (each holds one KV tile in flight, so it takes
# several to cover memory latency; measured best on an H200 from 1 to 64 requests), but no split
# under 256 keys, where the merge would cost more than it saves
_PROGRAMS_PER_SM = 4
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of one request: seq_len / num_splits rounded up to whole KV tiles.

    From the request's own seq_len (not max_seq_len), so short and long requests in a batch both
    spread over the splits, and a graph captured with an upper-bound max_seq_len stays exact.
    """
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _rotate_row(ptrs, offs_d, mask, cos, sin, HEAD_DIM: tl.constexpr):
    """Rotate-half rotary of the head vector(s) at ptrs (their last axis runs over the HEAD_DIM
    dims offs_d), in fp32, 0 where not mask: x * cos + partner * sin, the partner of dim d being
    d + h (d < h) or d - h, h = HEAD_DIM / 2, and sin carrying rotate-half's sign (-sin, d < h)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    partner_offs = (offs_d + HEAD_DIM // 2) % HEAD_DIM - offs_d
    partner = tl.load(ptrs + partner_offs, mask=mask, other=0.0).to(tl.float32)
    return x * cos + partner * sin


@triton.jit
def _early_tile(
    table, key_start, key_end, seq_len, k_base, v_base, offs_d, stride_kv_block, stride_kv_slot,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The split's first tile of keys and values, all but the step's own key (seq_len - 1),
    which the kernel before writes: keys [HEAD_DIM, BLOCK_N], values [BLOCK_N, HEAD_DIM] (the
    cache's dtype), which keys lie in the split, and which are older than the step's own."""
    k_pos, k_valid, slot = tile_slots(
        table, key_start, key_end, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N
    )
    old = k_pos < seq_len - 1  # [BLOCK_N]: keys of earlier steps, within the split
    k, v = load_kv(k_base, v_base, slot, offs_d, old & k_valid)
    return k, v, k_valid, old


@triton.jit
def _angles(cos_sin_ptr, pos_ptr, req, offs_d, HEAD_DIM: tl.constexpr):
    """cos and sin [HEAD_DIM] of the request's position, for _rotate_row: cos f_(d mod h), and
    sin with rotate-half's signs (-sin for d < h). Step inputs (pdl.py's contract)."""
    half_d = offs_d % (HEAD_DIM // 2)
    angles = cos_sin_ptr + tl.load(pos_ptr + req) * HEAD_DIM
    cos = tl.load(angles + half_d)
    sin = tl.load(angles + HEAD_DIM // 2 + half_d)
    sin = tl.where(offs_d < HEAD_DIM // 2, -sin, sin)
    return cos, sin


@triton.jit
def _add_new_kv(
    k, v, new, to_cache, new_slot, req, kv_head, k_ptr, v_ptr, kv_ptr, cos, sin, offs_d,
    stride_k_req, stride_k_head, stride_v_req, stride_v_head, stride_kv_kv, stride_kv_slot,
    stride_kv_head, k_inv_scale, v_inv_scale, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The step's own key and value from the projection into the first tile (k, v, in q's
    dtype) where `new`: the key rotated and both as the cache stores them (rounded, or
    quantized into an fp8 cache, as the rotary kernel does), and stored to the request's slot
    when `to_cache` (the one split holding key seq_len - 1, a real row) before any tile of it
    is read back."""
    k_row = k_ptr + req.to(tl.int64) * stride_k_req + kv_head * stride_k_head
    v_row = v_ptr + req.to(tl.int64) * stride_v_req + kv_head * stride_v_head
    k_new = _rotate_row(k_row + offs_d, offs_d, offs_d >= 0, cos, sin, HEAD_DIM)
    k_new = quantize_kv(k_new, k_inv_scale, kv_ptr)  # [HEAD_DIM]
    v_new = quantize_kv(tl.load(v_row + offs_d), v_inv_scale, kv_ptr)
    dst = new_slot * stride_kv_slot + kv_head * stride_kv_head + offs_d
    tl.store(kv_ptr + dst, k_new, mask=to_cache & (offs_d >= 0))
    tl.store(kv_ptr + stride_kv_kv + dst, v_new, mask=to_cache & (offs_d >= 0))
    tl.debug_barrier()  # stored before a later tile of this program reads it
    k = tl.where(new[None, :], k_new.to(k.dtype)[:, None], k)
    v = tl.where(new[:, None], v_new.to(v.dtype)[None, :], v)
    return k, v


@triton.jit
def _attend(
    acc, acc_odd, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, key_end, scale_log2,
    stride_kv_block, stride_kv_slot, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    V_PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """One tile of the split: attend_tile, or over an fp8 cache attend_tile_pairs (acc then
    holds the even dims, acc_odd the odd ones; otherwise acc_odd is a placeholder)."""
    if V_PAIRS:
        acc, acc_odd, l_i, m_i = attend_tile_pairs(
            acc, acc_odd, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, key_end,
            scale_log2, stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            MASK_SCORES, DOT_PRECISION, USE_ASM,
        )  # fmt: skip
    else:
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, key_end, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_SCORES,
            DOT_PRECISION,
        )  # fmt: skip
    return acc, acc_odd, l_i, m_i


@triton.jit
def _store_split_and_merge(
    out, m_i, l_i, req, kv_head, head, head_mask, offs_d, split, seq_len, split_len,
    part_out_ptr, part_lse_ptr, counters_ptr, out_ptr, num_heads, num_kv_heads, num_splits,
    stride_out_req, stride_out_head, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_P: tl.constexpr, MERGE_CHUNK: tl.constexpr, MERGE_SPLITS: tl.constexpr,
):  # fmt: skip
    """Store the split's partial output and log-sum-exp; the (request, kv head)'s last split
    to finish merges all of them into out."""
    row = (req * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_H]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, head_mask[:, None])
    tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)
    # every thread's partial is stored before the count (release); the program that counts
    # last sees all of them (acquire), merges, and zeroes the counter again
    tl.debug_barrier()
    counter = counters_ptr + req * num_kv_heads + kv_head
    num_filled = tl.cdiv(seq_len, split_len)
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_filled - 1:
        tl.atomic_xchg(counter, 0)
        first_row = req * num_heads + kv_head * GROUP
        if MERGE_CHUNK == 0:
            merged = _merge_splits_unrolled(
                part_out_ptr, part_lse_ptr, first_row, num_splits, num_filled, GROUP,
                GROUP_P, HEAD_DIM, MERGE_SPLITS,
            )  # fmt: skip
        else:
            merged = _merge_splits(
                part_out_ptr, part_lse_ptr, first_row, num_splits, num_filled, GROUP,
                GROUP_P, HEAD_DIM, MERGE_CHUNK,
            )  # fmt: skip
        offs_g = tl.arange(0, GROUP_P)
        g_offs = (
            req.to(tl.int64) * stride_out_req
            + (kv_head * GROUP + offs_g)[:, None] * stride_out_head + offs_d[None, :]
        )  # fmt: skip
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + g_offs, merged.to(out_ty), (offs_g < GROUP)[:, None])


# NOTE: the block tables' width is not specialized: an eager step's tables are as wide as its
# longest context, a CUDA graph's as max_model_len; a serving step must never wait on a compile
@triton.jit(do_not_specialize=["stride_bt_req"])
def _paged_decode_split_kernel(
    q_ptr,  # [num_reqs, num_heads, HEAD_DIM]
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [num_reqs, num_heads, HEAD_DIM]
    part_out_ptr,  # [num_reqs, num_heads, num_splits, HEAD_DIM] fp32, when USE_SCRATCH
    part_lse_ptr,  # [num_reqs, num_heads, num_splits] fp32 (log2 domain), when USE_SCRATCH
    counters_ptr,  # [>= num_reqs * num_kv_heads] int32, zero between launches, when USE_SCRATCH
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    num_heads,
    num_kv_heads,
    num_splits,
    scale_log2,  # softmax scale * log2(e) * k_scale (1 but for an fp8 cache)
    v_scale,  # 1 but for an fp8 cache
    stride_q_req,
    stride_q_head,
    stride_out_req,
    stride_out_head,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_req,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # GROUP padded to a tensor-core tile
    BLOCK_N: tl.constexpr,  # keys per iteration
    USE_SCRATCH: tl.constexpr,  # False when num_splits == 1: normalise straight into out
    GROUP_P: tl.constexpr,  # GROUP padded to a power of 2 (the merge's rows)
    MERGE_CHUNK: tl.constexpr,  # splits the merge loads at once (0: unrolled, MERGE_SPLITS)
    MERGE_SPLITS: tl.constexpr,  # num_splits, for the unrolled merge (else 1)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact, not TF32
    USE_PDL: tl.constexpr,
    V_PAIRS: tl.constexpr,  # an fp8 cache: values read as dim pairs (attend_tile_pairs)
    USE_ASM: tl.constexpr,  # CUDA (not the interpreter): the pairs' conversion in PTX
    # a small batch: the split's first tile of keys and values read before pdl_wait, all but
    # the step's own key (seq_len - 1), which comes from the qkv projection (k_ptr, v_ptr:
    # [num_reqs, num_kv_heads, HEAD_DIM] views) with q, unrotated; the kernel rotates q and the
    # key at the request's position, and the split holding key seq_len - 1 stores it and the
    # value to the request's cache slot (slot_ptr; -1: none)
    ROPE: tl.constexpr = False,
    k_ptr=None,
    v_ptr=None,
    pos_ptr=None,  # [num_reqs] int64
    cos_sin_ptr=None,  # [max_position, HEAD_DIM] fp32
    slot_ptr=None,  # [num_reqs] int64
    stride_k_req=0,
    stride_k_head=0,
    stride_v_req=0,
    stride_v_head=0,
    k_inv_scale=1.0,  # 1 / k_scale, 1 / v_scale: the step's key and value into an fp8 cache
    v_inv_scale=1.0,
):
    if not ROPE:
        pdl_wait(USE_PDL)
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    key_start = split * split_len
    key_end = tl.minimum(key_start + split_len, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_h  # [BLOCK_H]
    head_mask = offs_h < GROUP
    o_offs = req.to(tl.int64) * stride_out_req + head[:, None] * stride_out_head + offs_d[None, :]
    if USE_SCRATCH and key_start >= key_end:
        if ROPE:
            pdl_wait(USE_PDL)
        # empty split: the merge skips it, knowing split_len too; with no key at all
        # (seq_len 0, padding) split 0 writes the zeros
        if seq_len == 0 and split == 0:
            zeros = tl.zeros([BLOCK_H, HEAD_DIM], out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_offs, zeros, mask=head_mask[:, None])
        return
    k_base = kv_ptr + kv_head * stride_kv_head
    v_base = k_base + stride_kv_kv
    table = block_tables_ptr + req * stride_bt_req
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if V_PAIRS:  # acc: the even dims, acc_odd: the odd ones
        acc = tl.zeros([BLOCK_H, HEAD_DIM // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, HEAD_DIM // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        acc_odd = tl.zeros([1, 1], tl.float32)  # unused
    first = key_start  # the first key the loops below attend to
    q_offs = req.to(tl.int64) * stride_q_req + head[:, None] * stride_q_head + offs_d[None, :]
    if ROPE:
        k, v, k_valid, old = _early_tile(
            table, key_start, key_end, seq_len, k_base, v_base, offs_d, stride_kv_block,
            stride_kv_slot, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        k, v = k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty)  # exact (fp8)
        holds_new = (key_start <= seq_len - 1) & (seq_len - 1 < key_end)
        cos, sin = _angles(cos_sin_ptr, pos_ptr, req, offs_d, HEAD_DIM)
        new_slot = tl.load(slot_ptr + req)
        pdl_wait(USE_PDL)
        k, v = _add_new_kv(
            k, v, k_valid & ~old, holds_new & (new_slot >= 0), new_slot, req, kv_head, k_ptr,
            v_ptr, kv_ptr, cos, sin, offs_d, stride_k_req, stride_k_head, stride_v_req,
            stride_v_head, stride_kv_kv, stride_kv_slot, stride_kv_head, k_inv_scale,
            v_inv_scale, HEAD_DIM,
        )  # fmt: skip
        # q rotated in fp32, rounded to its dtype (as the rotary kernel stores it)
        q = _rotate_row(
            q_ptr + q_offs, offs_d[None, :], head_mask[:, None], cos[None, :], sin[None, :],
            HEAD_DIM,
        ).to(q_ptr.dtype.element_ty)  # fmt: skip
        q = dot_operand(q, kv_ptr)
        k, v = k.to(q.dtype), v.to(q.dtype)  # exact (the cache's values)
        if key_start < key_end:  # the first tile, scores past key_end masked
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
            s = tl.where(k_valid[None, :], s, float("-inf"))
            p, alpha, l_i, m_i = softmax_step(s, l_i, m_i)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            if V_PAIRS:
                acc, acc_odd = split_pairs(pv)
            else:
                acc = pv
            first = key_start + BLOCK_N
    else:
        q = tl.load(q_ptr + q_offs, mask=head_mask[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]
        q = dot_operand(q, kv_ptr)
    # whole tiles unmasked, then the split's last, partial tile (if any) masked to key_end;
    # a non-empty split's first tile has a valid key, as attend_tile requires
    full_end = key_start + (key_end - key_start) // BLOCK_N * BLOCK_N
    last_pos = tl.full([BLOCK_H], key_end - 1, tl.int32)  # decode rows see the whole context
    for start_n in range(first, full_end, BLOCK_N):
        acc, acc_odd, l_i, m_i = _attend(
            acc, acc_odd, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, full_end,
            scale_log2, stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
            DOT_PRECISION, V_PAIRS, USE_ASM,
        )  # fmt: skip
    for start_n in range(tl.maximum(full_end, first), key_end, BLOCK_N):
        acc, acc_odd, l_i, m_i = _attend(
            acc, acc_odd, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, key_end,
            scale_log2, stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
            DOT_PRECISION, V_PAIRS, USE_ASM,
        )  # fmt: skip
    if V_PAIRS:
        acc = join_pairs(acc, acc_odd)

    # seq_len 0 (padding): zeros; an fp8 cache's v_scale applies to the partials alike
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    if USE_SCRATCH:
        _store_split_and_merge(
            out, m_i, l_i, req, kv_head, head, head_mask, offs_d, split, seq_len, split_len,
            part_out_ptr, part_lse_ptr, counters_ptr, out_ptr, num_heads, num_kv_heads,
            num_splits, stride_out_req, stride_out_head, GROUP, HEAD_DIM, GROUP_P, MERGE_CHUNK,
            MERGE_SPLITS,
        )  # fmt: skip
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


@triton.jit
def _merge_splits(
    part_out_ptr, part_lse_ptr, first_row, num_splits, num_filled,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Softmax-weighted sum of the first num_filled split partials of the GROUP query heads
    from row first_row on: [GROUP_P, HEAD_DIM] fp32 (rows past GROUP 0). CHUNK splits' partials
    are loaded at once (one round trip to L2 for a short context, not one a split), their
    chunks folded online. Loads skip L1, which other SMs' stores do not update."""
    offs_r = tl.arange(0, CHUNK * GROUP_P)  # (split, head) pairs of a chunk
    split_of = offs_r // GROUP_P
    head_of = offs_r % GROUP_P
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for s0 in range(0, num_filled, CHUNK):
        split = s0 + split_of
        mask = (split < num_filled) & (head_of < GROUP)
        row = (first_row + head_of).to(tl.int64) * num_splits + split  # [CHUNK * GROUP_P]
        lse = tl.load(part_lse_ptr + row, mask=mask, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask[:, None],
            other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        lse = tl.reshape(lse, (CHUNK, GROUP_P))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding head: no split
        weight = tl.exp2(lse - m_safe[None, :])  # [CHUNK, GROUP_P], 0 where masked
        alpha = tl.exp2(m - m_safe)
        part = tl.reshape(part, (CHUNK, GROUP_P, HEAD_DIM))
        acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_splits_unrolled(
    part_out_ptr, part_lse_ptr, first_row, num_splits, num_filled,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """_merge_splits with one load per split (SPLITS = num_splits, unrolled): every load's
    address is known up front, so all of them are in flight at once, and each thread folds its
    own elements of every split (no cross-thread sum, no [splits, heads, dims] tile)."""
    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    rows = (first_row + offs_g).to(tl.int64) * num_splits  # [GROUP_P]: split 0's rows
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(
            part_lse_ptr + rows + s, mask=g_mask & (s < num_filled), other=float("-inf"),
            cache_modifier=".cg",
        )  # fmt: skip
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding head: no split
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for s in tl.static_range(SPLITS):
        filled = g_mask & (s < num_filled)
        # NOTE: loaded again rather than kept from the first loop (a static loop builds no
        # list); the address is known up front, so this load flies with the first one (L2)
        lse = tl.load(
            part_lse_ptr + rows + s, mask=filled, other=float("-inf"), cache_modifier=".cg"
        )
        part = tl.load(
            part_out_ptr + (rows + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=filled[:, None],
            other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        weight = tl.exp2(lse - m)  # [GROUP_P], 0 where not filled
        acc += part * weight[:, None]
        total += weight
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


_MAX_COUNTERS = 1 << 20  # (request, kv head) pairs of one decode launch
_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """The split kernel's merge counters: one zeroed buffer per device, allocated once (CUDA
    graphs keep its address) and left zeroed by every launch."""
    assert n <= _MAX_COUNTERS, f"{n} (request, kv head) pairs in one launch"
    if device not in _counters:
        _counters[device] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def default_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits per request so that num_reqs x num_kv_heads x splits programs fill the SMs.

    A power of 2 (few merge-kernel variants), 1 when the batch alone fills the GPU, and no more
    than one split per _MIN_KEYS_PER_SPLIT keys of the longest context.
    """
    programs = num_reqs * num_kv_heads
    wanted = min(
        _PROGRAMS_PER_SM * num_sms(device) // max(programs, 1),
        max_seq_len // _MIN_KEYS_PER_SPLIT,
        _MAX_SPLITS,
    )
    return 1 << (max(wanted, 1).bit_length() - 1)


class DecodeRope(NamedTuple):
    """What paged_decode_attention's `rope` needs besides q: the step's keys and values as the
    projection left them, [num_reqs, num_kv_heads, head_dim] (views into qkv), each request's
    position and cache slot [num_reqs] (int64; slot -1: nothing stored) and the cos/sin cache
    [max_position, head_dim] (fp32, lantau.model.ops.build_cos_sin_cache)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        num_reqs, head_dim = q.shape[0], q.shape[2]
        kv_shape = (num_reqs, *kv_cache.shape[3:])
        assert self.k.shape == kv_shape and self.v.shape == kv_shape, (
            f"rope: k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, expected {kv_shape}"
        )
        assert self.k.dtype == self.v.dtype == q.dtype, "rope: k, v and q dtypes differ"
        assert self.k.stride(2) == 1 and self.v.stride(2) == 1, "rope: k, v dims not contiguous"
        for name in ("positions", "slot_mapping"):
            t = getattr(self, name)
            assert t.shape == (num_reqs,) and t.dtype == torch.int64, f"rope: {name}"
            assert t.is_contiguous(), f"rope: {name} not contiguous"
        cs = self.cos_sin_cache
        assert cs.dim() == 2 and cs.shape[1] == head_dim, f"rope: cos_sin {tuple(cs.shape)}"
        assert cs.dtype == torch.float32 and cs.is_contiguous(), "rope: cos_sin fp32, contiguous"
        assert kv_cache.is_contiguous(), "rope: the cache must be contiguous (slot addressing)"


def default_tile(kv_cache_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel for a cache dtype. An fp8 tile
    takes twice the keys, a bf16 tile's bytes (faster on an H200 from 32 to 256 requests:
    RESULTS.md, "fp8 KV decode attention"), over 2 warps, not 4: with its values read as pairs a
    warp-pair issues 2,420 instructions a tile against 2,756 for 4 warps (sass_loops.py), and on
    an H100 it was as fast or faster at every batch x context measured (RESULTS.md)."""
    if kv_cache_dtype == FP8_KV_DTYPE:
        return 2 * _DECODE_BLOCK_N, 2, _DECODE_STAGES
    return _DECODE_BLOCK_N, 4, _DECODE_STAGES


def default_merge_chunk(num_splits: int, group: int, head_dim: int) -> int:
    """Splits the in-launch merge loads at once: all of them, up to 8,192 fp32 values of
    partials (64 registers a thread over 4 warps)."""
    cap = max(1, 8192 // (triton.next_power_of_2(group) * head_dim))
    return min(triton.next_power_of_2(num_splits), 1 << (cap.bit_length() - 1))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    config: tuple[int, ...] | None = None,
    merge: AttnMerge = AttnMerge.CHUNKED,
    rope: DecodeRope | None = None,
    use_pdl: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of one query per request over its whole cached context, into out.

    Splits each context into num_splits parts (default_num_splits when None) computed in
    parallel, then merged in the same launch (`merge`: how). CUDA-graph capturable: scratch
    size depends on shapes and num_splits only, and no value is read back to the host.
    max_seq_len may be an upper bound (it only chooses num_splits). A request with seq_len 0
    (padding) gets zeros. config: (BLOCK_N, num_warps, num_stages) of the kernel instead of
    the default (tuning). An fp8 cache (float8_e4m3fn) holds keys / k_scale and values /
    v_scale.
    rope (small decode batches): q is the projection's, not yet rotated; the kernel does what
    lantau.kernels.rotary.apply_rotary_and_write_kv would have done before it (q and the
    step's key rotated, key and value stored to each request's slot) and attends with them;
    q itself is left as it was. Each split's first tile of keys and values is loaded before
    the PDL wait, all but each request's last key (seq_len - 1): only for a decode step whose
    kernels write no cache slot but each request's last key, on a stream where the step began
    with a host-to-device copy (which waits for all earlier kernels), as the runner's steps
    do: then the older slots, seq_lens and block_tables are final before the launch.
    """
    # q, out: [num_reqs, num_heads, head_dim]
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # seq_lens: [num_reqs] int32; block_tables: [num_reqs, max_blocks] int32
    check_paged_inputs(q, kv_cache, out, seq_lens, block_tables, max_seq_len)
    check_kv_scales(kv_cache, k_scale, v_scale)
    num_reqs, num_heads, head_dim = q.shape
    assert seq_lens.shape[0] == num_reqs, f"{num_reqs} query rows, {seq_lens.shape[0]} seq_lens"
    block_size, num_kv_heads = kv_cache.shape[2:4]
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, max_seq_len, q.device)
    assert isinstance(num_splits, int) and num_splits >= 1, f"num_splits {num_splits}"
    rope_args = {}
    if rope is not None:
        rope.check(q, kv_cache)
        rope_args = dict(
            ROPE=True, k_ptr=rope.k, v_ptr=rope.v, pos_ptr=rope.positions,
            cos_sin_ptr=rope.cos_sin_cache, slot_ptr=rope.slot_mapping,
            stride_k_req=rope.k.stride(0), stride_k_head=rope.k.stride(1),
            stride_v_req=rope.v.stride(0), stride_v_head=rope.v.stride(1),
            k_inv_scale=1.0 / k_scale, v_inv_scale=1.0 / v_scale,
        )  # fmt: skip
    if num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    block_n, num_warps, num_stages = config or default_tile(kv_cache.dtype)
    use_scratch = num_splits > 1
    if use_scratch:
        part_out = torch.empty(
            (num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_reqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:  # unused: the split kernel writes out directly
        part_out = part_lse = out
    counters = _merge_counters(q.device, num_reqs * num_kv_heads) if use_scratch else seq_lens
    unrolled = merge is AttnMerge.UNROLLED
    _paged_decode_split_kernel[(num_kv_heads, num_reqs, num_splits)](
        q, kv_cache, out, part_out, part_lse, counters, seq_lens, block_tables, num_heads,
        num_kv_heads, num_splits, scale * LOG2E * k_scale, v_scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), *kv_strides(kv_cache), block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(MIN_BLOCK_M, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        USE_SCRATCH=use_scratch,
        GROUP_P=triton.next_power_of_2(group),
        MERGE_CHUNK=0 if unrolled else default_merge_chunk(num_splits, group, head_dim),
        MERGE_SPLITS=num_splits if unrolled else 1,
        DOT_PRECISION=dot_precision(q.dtype),
        **pdl.launch_options(q.device, use_pdl),
        V_PAIRS=kv_cache.dtype == FP8_KV_DTYPE,
        USE_ASM=q.device.type == "cuda",
        **rope_args,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
