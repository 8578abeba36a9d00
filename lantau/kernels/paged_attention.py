"""Attention over the paged KV cache: one varlen launch for any batch, and split-KV decode.

Same function and cache layout as lantau.kernels.reference.paged_attention_ref. Keys are gathered
one token at a time through the block table (`block_tables[req, t // block_size]`, slot
`t % block_size`), so a KV tile (BLOCK_N tokens) need not match the cache block size.

unified_attention: one launch for prefills, chunked prefills and decodes. A program owns a tile of
BLOCK_Q query rows of one request times the G = num_heads // num_kv_heads query heads sharing one
kv head, packed into the BLOCK_M = BLOCK_Q * G rows of a tensor-core tile, so that decode rows
with GQA still fill an MMA. Row m of the tile is query row BLOCK_Q * tile + m // G, head
kv_head * G + m % G:

    m:      0   1   2   3   4   5  ...      (G = 3)
    query:  0   0   0   1   1   1  ...
    head:   0   1   2   0   1   2  ...

paged_decode_attention: one query per request. The context splits into num_splits partitions
processed in parallel (each writes its normalised partial output and log-sum-exp), then a small
kernel merges them: the long-context decode path, where one program per (request, kv head)
leaves most SMs idle.

Both kernels share one online-softmax step (_attend_tile: fp32, exp2 domain, scores scaled by
scale * log2(e)) and run it twice over a context: first the whole tiles every row sees, without
a score mask, then the tiles at the causal edge / end of context, masked (30% faster prefill on an
H200 than masking every tile).
max_query_len and max_seq_len only pick tile shapes and split counts; every bound the kernels
obey is read from the device tensors, so a CUDA graph captured with upper bounds stays correct.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

_LOG2E = math.log2(math.e)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# tile shapes (module constants so tests can shrink them to stress tile boundaries); 64 x 64 with
# 4 warps, 2 stages beat 128-row / 128-key / 3-stage tiles for bf16 prefill on an H200
_MIN_BLOCK_M = 16  # smallest M of a tensor-core tile
_PREFILL_BLOCK_M = 64  # one Hopper warpgroup MMA of query rows
_BLOCK_N = 64  # keys per iteration, unified kernel
_DECODE_BLOCK_N = 64  # keys per iteration, split decode kernel
# 2 stages, not 3: 4.22 vs 4.07 TB/s at 384 rows of 1000-2000 keys, 4.30 vs 3.74 with the
# longest first (the scheduler's order: oldest first), on an H200 (runs/2026-12-03-...attn.log)
_DECODE_STAGES = 2
# split heuristic: about 4 decode programs per SM (each holds one KV tile in flight, so it takes
# several to cover memory latency; measured best on an H200 from 1 to 64 requests), but no split
# under 256 keys, where the merge would cost more than it saves
_PROGRAMS_PER_SM = 4
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
_DEFAULT_NUM_SMS = 132  # H100/H200; used when the device is not CUDA (interpreter)


@triton.jit
def _find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Request owning global query tile `tile_id`: binary search, no host sync.

    Request i's tiles are numbered from query_start_loc[i] // BLOCK_Q + i, strictly increasing in
    i; it owns at least ceil(num_q / BLOCK_Q) of them (some past its last row, which exit).
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc,  # [R, HEAD_DIM] fp32: unnormalised output so far
    l_i,  # [R] fp32: sum of exp2(score - m_i) so far
    m_i,  # [R] fp32: max score so far (log2 domain)
    q,  # [R, HEAD_DIM]
    q_pos,  # [R]: each row sees keys <= q_pos (used when MASK_SCORES)
    k_base,  # this kv head's keys
    v_base,  # this kv head's values
    table,  # this request's block table row
    start_n,  # first key of the tile
    key_end,  # keys >= key_end are not read (masked loads give 0)
    scale_log2,
    stride_kv_block,
    stride_kv_slot,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_SCORES: tl.constexpr,  # False when every row sees every key of the tile
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N of a paged context."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos, k_valid, slot = _tile_slots(
        table, start_n, key_end, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N
    )
    # [HEAD_DIM, BLOCK_N]; slots past key_end may hold garbage, even NaN: never loaded
    k = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [R, BLOCK_N]
    if MASK_SCORES:
        # -inf, never a multiply by 0: 0 * NaN = NaN. NOTE: callers guarantee every row sees
        # a key in its first tile, so m_new is finite and m_i - m_new is never -inf - -inf
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    p, alpha, l_i, m_new = _softmax_step(s, l_i, m_i)
    v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tile_slots(
    table, start_n, key_end, stride_kv_block, stride_kv_slot,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys start_n .. start_n + BLOCK_N of a paged context: their positions, which lie before
    key_end, and their cache offsets (block table lookups; 0 past key_end)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k_valid = k_pos < key_end
    block_ids = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
    # int64: block * stride_kv_block overflows int32 on large caches
    slot = block_ids.to(tl.int64) * stride_kv_block + (k_pos % BLOCK_SIZE) * stride_kv_slot
    return k_pos, k_valid, slot


@triton.jit
def _load_kv(k_base, v_base, slot, offs_d, mask):
    """A tile's keys [HEAD_DIM, BLOCK_N] and values [BLOCK_N, HEAD_DIM] at `slot` where mask,
    else 0."""
    k = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=mask[None, :], other=0.0)
    v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    return k, v


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
def _softmax_step(s, l_i, m_i):
    """Online softmax over one tile's scores s [R, BLOCK_N] (log2 domain): the tile's weights,
    the factor that rescales what came before, and the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_req,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q query rows x GROUP heads, plus padding
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact, not TF32
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    num_q = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= num_q:
        return  # the grid is an upper bound on the number of tiles
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - num_q  # keys before this step's first query row

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query row within the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    # rows past BLOCK_Q * GROUP belong to the next tile: computed, never stored
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < num_q)
    q_pos = context_len + q_idx  # [BLOCK_M] position in the sequence: sees keys <= q_pos
    token = (q_start + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_base = kv_ptr + kv_head * stride_kv_head
    v_base = k_base + stride_kv_kv
    table = block_tables_ptr + req * stride_bt_req
    # keys [0, full_end) are seen by every row: whole tiles, no score mask; the tiles from there
    # to the causal limit of the tile's last row (num_keys) are masked per row
    full_end = (context_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    num_keys = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table, start_n, full_end, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # NOTE: key 0 is visible to every row (q_pos >= 0), so every row's first tile has a key
    for start_n in range(full_end, num_keys, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table, start_n, num_keys, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    # a request with no keys (seq_len 0: padding) writes zeros rather than 0 / 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of one request: seq_len / num_splits rounded up to whole KV tiles.

    From the request's own seq_len (not max_seq_len), so short and long requests in a batch both
    spread over the splits, and a graph captured with an upper-bound max_seq_len stays exact.
    """
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,  # [num_reqs, num_heads, HEAD_DIM]
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [num_reqs, num_heads, HEAD_DIM], written when not USE_SCRATCH
    part_out_ptr,  # [num_reqs, num_heads, num_splits, HEAD_DIM] fp32, when USE_SCRATCH
    part_lse_ptr,  # [num_reqs, num_heads, num_splits] fp32 (log2 domain), when USE_SCRATCH
    counters_ptr,  # [>= num_reqs * num_kv_heads] int32, zero between launches, when MERGE
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    num_heads,
    num_kv_heads,
    num_splits,
    scale_log2,  # softmax scale * log2(e)
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
    MERGE: tl.constexpr,  # USE_SCRATCH: the last split of a (request, kv head) merges them
    GROUP_P: tl.constexpr,  # GROUP padded to a power of 2 (the merge's rows)
    MERGE_CHUNK: tl.constexpr,  # splits the merge loads at once (0: unrolled, MERGE_SPLITS)
    MERGE_SPLITS: tl.constexpr,  # num_splits, for the unrolled merge (else 1)
    HEADS_FIRST: tl.constexpr,  # grid (kv heads, requests, splits) instead of (requests, ...)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact, not TF32
    USE_PDL: tl.constexpr,
    # the split's first tile of keys and values read before pdl_wait, all but the step's own
    # key (seq_len - 1), which the kernel before writes (see paged_decode_attention)
    EARLY_KV: tl.constexpr = False,
    # ROPE (with EARLY_KV): q, and the step's own key and value, come unrotated from the qkv
    # projection (k_ptr, v_ptr: [num_reqs, num_kv_heads, HEAD_DIM] views); the kernel rotates q
    # and the key at the request's position, and the split holding key seq_len - 1 stores it
    # and the value to the request's cache slot (slot_ptr; -1: none)
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
):
    if not EARLY_KV:
        pdl_wait(USE_PDL)
    if HEADS_FIRST:  # a request's kv heads launch together and read its cache blocks together
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
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
        if EARLY_KV:
            pdl_wait(USE_PDL)
        # empty split: the merge skips it, knowing split_len too; with no key at all
        # (seq_len 0, padding) split 0 writes the zeros
        if MERGE and seq_len == 0 and split == 0:
            zeros = tl.zeros([BLOCK_H, HEAD_DIM], out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_offs, zeros, mask=head_mask[:, None])
        return
    k_base = kv_ptr + kv_head * stride_kv_head
    v_base = k_base + stride_kv_kv
    table = block_tables_ptr + req * stride_bt_req
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    first = key_start  # the first key the loops below attend to
    q_offs = req.to(tl.int64) * stride_q_req + head[:, None] * stride_q_head + offs_d[None, :]
    if EARLY_KV:
        k_pos, k_valid, slot = _tile_slots(
            table, key_start, key_end, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N
        )
        old = k_pos < seq_len - 1  # [BLOCK_N]: keys of earlier steps, within the split
        k, v = _load_kv(k_base, v_base, slot, offs_d, old & k_valid)
        # the step's own key: its slot now (a step input), its key and value after the wait,
        # as [HEAD_DIM] rows (not a second masked tile: half the registers)
        holds_new = (key_start <= seq_len - 1) & (seq_len - 1 < key_end)
        if ROPE:  # the position's angles and the slot: step inputs (pdl.py's contract)
            half_d = offs_d % (HEAD_DIM // 2)
            angles = cos_sin_ptr + tl.load(pos_ptr + req) * HEAD_DIM
            cos = tl.load(angles + half_d)  # [HEAD_DIM]: cos f_(d mod h)
            sin = tl.load(angles + HEAD_DIM // 2 + half_d)
            sin = tl.where(offs_d < HEAD_DIM // 2, -sin, sin)  # rotate-half's signs
            new_slot = tl.load(slot_ptr + req)
        else:  # the step's own key is in the cache already: its offset there
            new_block = tl.load(table + (seq_len - 1) // BLOCK_SIZE, mask=holds_new, other=0)
            new_off = (
                new_block.to(tl.int64) * stride_kv_block
                + ((seq_len - 1) % BLOCK_SIZE) * stride_kv_slot
            )
        pdl_wait(USE_PDL)
        new = k_valid & ~old  # the step's own key, if this split holds it
        if ROPE:
            # the step's key and value from the projection, the key rotated and both rounded
            # to the cache's dtype (as the rotary kernel stores them); stored by the one split
            # that holds key seq_len - 1 before any tile of it is read back
            kv_ty = kv_ptr.dtype.element_ty
            k_row = k_ptr + req.to(tl.int64) * stride_k_req + kv_head * stride_k_head
            v_row = v_ptr + req.to(tl.int64) * stride_v_req + kv_head * stride_v_head
            k_new = _rotate_row(k_row + offs_d, offs_d, offs_d >= 0, cos, sin, HEAD_DIM)
            k_new = k_new.to(kv_ty)  # [HEAD_DIM]
            v_new = tl.load(v_row + offs_d)
            to_cache = holds_new & (new_slot >= 0)
            dst = new_slot * stride_kv_slot + kv_head * stride_kv_head + offs_d
            tl.store(kv_ptr + dst, k_new, mask=to_cache & (offs_d >= 0))
            tl.store(kv_ptr + stride_kv_kv + dst, v_new, mask=to_cache & (offs_d >= 0))
            tl.debug_barrier()  # stored before a later tile of this program reads it
            k = tl.where(new[None, :], k_new[:, None], k)
            v = tl.where(new[:, None], v_new[None, :], v)
        else:
            row_mask = holds_new & (offs_d >= 0)
            k_new = tl.load(k_base + new_off + offs_d, mask=row_mask, other=0.0)  # [HEAD_DIM]
            v_new = tl.load(v_base + new_off + offs_d, mask=row_mask, other=0.0)
            k = tl.where(new[None, :], k_new[:, None], k)
            v = tl.where(new[:, None], v_new[None, :], v)
    if ROPE:  # q rotated in fp32, rounded to its dtype (as the rotary kernel stores it)
        q = _rotate_row(
            q_ptr + q_offs, offs_d[None, :], head_mask[:, None], cos[None, :], sin[None, :],
            HEAD_DIM,
        ).to(q_ptr.dtype.element_ty)  # fmt: skip
    else:
        q = tl.load(q_ptr + q_offs, mask=head_mask[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]
    if EARLY_KV and key_start < key_end:  # the first tile, scores past key_end masked
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(k_valid[None, :], s, float("-inf"))
        p, alpha, l_i, m_i = _softmax_step(s, l_i, m_i)
        acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        first = key_start + BLOCK_N
    # whole tiles unmasked, then the split's last, partial tile (if any) masked to key_end;
    # a non-empty split's first tile has a valid key, as _attend_tile requires
    full_end = key_start + (key_end - key_start) // BLOCK_N * BLOCK_N
    last_pos = tl.full([BLOCK_H], key_end - 1, tl.int32)  # decode rows see the whole context
    for start_n in range(first, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, full_end, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(tl.maximum(full_end, first), key_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, last_pos, k_base, v_base, table, start_n, key_end, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0 (padding): zeros
    if USE_SCRATCH:
        row = (req * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, head_mask[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)
        if MERGE:
            # every thread's partial is stored before the count (release); the program that
            # counts last sees all of them (acquire), merges, and zeroes the counter again
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


@triton.jit
def _paged_decode_merge_kernel(
    part_out_ptr,  # [num_reqs, num_heads, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [num_reqs, num_heads, num_splits] fp32 (log2 domain)
    out_ptr,  # [num_reqs, num_heads, HEAD_DIM]
    seq_lens_ptr,  # [num_reqs] int32
    num_heads,
    num_splits,
    stride_out_req,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of 2
    BLOCK_N: tl.constexpr,  # the split kernel's, to recompute split_len
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    # splits past the last key were skipped by the split kernel: their scratch is garbage
    num_filled = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_filled
    row = (req * num_heads + head).to(tl.int64) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # seq_len 0: no split filled
    weight = tl.exp2(lse - lse_max)  # [BLOCK_S], 0 for skipped splits
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], split_mask[:, None])
    total = tl.sum(weight, 0)
    out = tl.sum(tl.where(split_mask[:, None], part, 0.0) * weight[:, None], 0)  # [HEAD_DIM]
    out = out / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + req.to(tl.int64) * stride_out_req + head * stride_out_head + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_paged_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
) -> None:
    """Shapes, dtypes, strides and devices shared by both launchers."""
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(kv_cache.shape)}"
    )
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    assert kv_cache.shape[4] == head_dim, f"kv_cache head_dim {kv_cache.shape[4]} != {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} kv heads"
    assert _is_power_of_2(head_dim) and head_dim >= 16, f"head_dim {head_dim}: power of 2, >= 16"
    assert block_size > 0, f"block_size {block_size}"
    assert out.shape == q.shape, f"out {tuple(out.shape)} != q {tuple(q.shape)}"
    assert q.dtype in _SUPPORTED_DTYPES, f"q dtype {q.dtype}"
    assert kv_cache.dtype == q.dtype and out.dtype == q.dtype, (
        f"q {q.dtype}, kv_cache {kv_cache.dtype}, out {out.dtype} must match"
    )
    for name, t in (("q", q), ("out", out), ("kv_cache", kv_cache)):
        assert t.stride(-1) == 1, f"{name} head_dim must be contiguous, strides {t.stride()}"
    num_reqs = seq_lens.shape[0]
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32, (
        f"seq_lens must be [num_reqs] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs, (
        f"block_tables must be [{num_reqs}, max_blocks], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype == torch.int32, f"block_tables dtype {block_tables.dtype}"
    assert block_tables.stride(1) == 1, f"block_tables strides {block_tables.stride()}"
    assert max_seq_len <= block_tables.shape[1] * block_size, (
        f"max_seq_len {max_seq_len} exceeds the block table ({block_tables.shape[1]} blocks)"
    )
    for name, t in (("kv_cache", kv_cache), ("out", out), ("seq_lens", seq_lens)):
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    assert block_tables.device == q.device, f"block_tables on {block_tables.device}"


def _kv_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    # kv, block, slot, head; head_dim is contiguous (checked)
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 is the test/debug dtype: keep it exact; tf32 would only matter for fp32 anyway
    return "ieee" if dtype == torch.float32 else "tf32"


def _unified_block_m(max_query_len: int, group: int) -> int:
    """Tile rows: enough for the longest request's rows x heads, capped at a prefill tile.

    Decode-only batches get 16 rows (G heads of one token), prefill batches _PREFILL_BLOCK_M.
    Only a performance choice: the grid covers every request whatever BLOCK_M is.
    """
    rows = triton.next_power_of_2(max(max_query_len, 1) * group)
    return max(triton.next_power_of_2(group), min(_PREFILL_BLOCK_M, max(_MIN_BLOCK_M, rows)))


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    tile: tuple[int, int, int, int] | None = None,
) -> None:
    """Causal attention of each request's query rows over its cached context, into out.

    One launch for a batch mixing prefills, chunked prefills and decodes. Rows of out past
    query_start_loc[-1] (padding) are not written. query_start_loc[0] must be 0.
    max_query_len / max_seq_len may be upper bounds: they only choose the tile shape.
    `tile` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the default (for tuning).
    """
    # q, out: [num_tokens, num_heads, head_dim]
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32
    # block_tables: [num_reqs, max_blocks] int32
    _check_paged_inputs(q, kv_cache, out, seq_lens, block_tables, max_seq_len)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32, (
        f"query_start_loc must be [{num_reqs + 1}] int32, "
        f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
    )
    assert query_start_loc.is_contiguous(), "query_start_loc must be contiguous"
    assert query_start_loc.device == q.device, f"query_start_loc on {query_start_loc.device}"
    assert max_query_len <= num_tokens, f"max_query_len {max_query_len} > {num_tokens} rows"
    if num_tokens == 0 or num_reqs == 0:
        return
    block_size, num_kv_heads = kv_cache.shape[2:4]
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tile or (
        _unified_block_m(max_query_len, group),
        _BLOCK_N,
        4,
        2,
    )
    assert block_m >= group, f"BLOCK_M {block_m} holds less than one group of {group} heads"
    block_q = block_m // group
    # request i's tiles start at query_start_loc[i] // block_q + i (see _find_request), so this
    # many tiles cover every request without reading query_start_loc on the host
    num_tiles = num_tokens // block_q + num_reqs
    _unified_attention_kernel[(num_tiles, num_kv_heads)](
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        num_reqs,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *_kv_strides(kv_cache),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


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
        _PROGRAMS_PER_SM * _num_sms(device) // max(programs, 1),
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
    config: tuple[int, int, int] | None = None,
    merge_kernel: bool = False,
    heads_first: bool = False,
    early_kv: bool = False,
    merge_chunk: int | None = None,
    rope: DecodeRope | None = None,
    maxnreg: int | None = None,
) -> None:
    """Attention of one query per request over its whole cached context, into out.

    Splits each context into num_splits parts (default_num_splits when None) computed in
    parallel, then merges them: in the same launch, the last split of each (request, kv head)
    to finish merging them all (a second launch when merge_kernel, for comparisons).
    CUDA-graph capturable: scratch size depends on shapes and num_splits only, and no value is
    read back to the host. max_seq_len may be an upper bound
    (it only chooses num_splits). A request with seq_len 0 (padding) gets zeros. config:
    (BLOCK_N, num_warps, num_stages) of the split kernel instead of the default (tuning).
    heads_first: launch a request's kv heads next to each other (a block of the cache holds
    all its heads' keys, so they read the same DRAM pages); under measurement.
    early_kv: with PDL, each split's first tile of keys and values is loaded before the wait on
    the previous kernel, all but each request's last key (seq_len - 1). Only for a decode step
    whose kernels write no cache slot but each request's last key, on a stream where the step
    began with a host-to-device copy (which waits for all earlier kernels), as the runner's
    steps do: then the older slots, seq_lens and block_tables are final before the launch.
    merge_chunk: splits of partials the in-launch merge loads at once (default_merge_chunk; 1
    folds them one by one, a round trip to L2 each, for comparisons; 0: one load per split,
    unrolled, each thread folding its own elements).
    rope (with early_kv): q is the projection's, not yet rotated; the kernel does what
    lantau.kernels.rotary.apply_rotary_and_write_kv would have done before it (q and the
    step's key rotated, key and value stored to each request's slot) and attends with them: one
    launch fewer. q itself is left as it was.
    maxnreg: the split kernel's register cap a thread (ptxas), to leave an SM's registers to the
    next kernel's early programs: 64 keys over 8 warps take 254 (the whole register file), 168
    with no spills (ptxas for sm_90, unrolled merge).
    """
    # q, out: [num_reqs, num_heads, head_dim]
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # seq_lens: [num_reqs] int32; block_tables: [num_reqs, max_blocks] int32
    _check_paged_inputs(q, kv_cache, out, seq_lens, block_tables, max_seq_len)
    num_reqs, num_heads, head_dim = q.shape
    assert seq_lens.shape[0] == num_reqs, f"{num_reqs} query rows, {seq_lens.shape[0]} seq_lens"
    block_size, num_kv_heads = kv_cache.shape[2:4]
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, max_seq_len, q.device)
    assert isinstance(num_splits, int) and num_splits >= 1, f"num_splits {num_splits}"
    assert merge_chunk in (None, 0) or _is_power_of_2(merge_chunk), f"merge_chunk {merge_chunk}"
    rope_args = {}
    if rope is not None:
        assert early_kv, "rope: only with early_kv (the key is read from the projection)"
        rope.check(q, kv_cache)
        rope_args = dict(
            ROPE=True, k_ptr=rope.k, v_ptr=rope.v, pos_ptr=rope.positions,
            cos_sin_ptr=rope.cos_sin_cache, slot_ptr=rope.slot_mapping,
            stride_k_req=rope.k.stride(0), stride_k_head=rope.k.stride(1),
            stride_v_req=rope.v.stride(0), stride_v_head=rope.v.stride(1),
        )  # fmt: skip
    if num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    block_n, num_warps, num_stages = config or (_DECODE_BLOCK_N, 4, _DECODE_STAGES)
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
    merge = use_scratch and not merge_kernel
    counters = _merge_counters(q.device, num_reqs * num_kv_heads) if merge else seq_lens
    grid = (num_kv_heads, num_reqs) if heads_first else (num_reqs, num_kv_heads)
    _paged_decode_split_kernel[(*grid, num_splits)](
        q,
        kv_cache,
        out,
        part_out,
        part_lse,
        counters,
        seq_lens,
        block_tables,
        num_heads,
        num_kv_heads,
        num_splits,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *_kv_strides(kv_cache),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(_MIN_BLOCK_M, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        USE_SCRATCH=use_scratch,
        MERGE=merge,
        GROUP_P=triton.next_power_of_2(group),
        MERGE_CHUNK=(
            default_merge_chunk(num_splits, group, head_dim) if merge_chunk is None else merge_chunk
        ),
        MERGE_SPLITS=num_splits if merge_chunk == 0 else 1,
        HEADS_FIRST=heads_first,
        DOT_PRECISION=_dot_precision(q.dtype),
        **pdl.launch_options(q.device),
        EARLY_KV=early_kv,
        **rope_args,
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if use_scratch and not merge:
        _paged_decode_merge_kernel[(num_reqs, num_heads)](
            part_out,
            part_lse,
            out,
            seq_lens,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_N=block_n,
            **pdl.launch_options(q.device),
            num_warps=4 if head_dim * num_splits >= 2048 else 1,
        )
