"""Unified paged attention: one varlen launch for prefills, chunked prefills and decodes.

A program owns a tile of BLOCK_Q query rows of one request times the G = num_heads //
num_kv_heads query heads sharing one kv head, packed into the BLOCK_M = BLOCK_Q * G rows of a
tensor-core tile, so that decode rows with GQA still fill an MMA. Row m of the tile is query
row BLOCK_Q * tile + m // G, head kv_head * G + m % G:

    m:      0   1   2   3   4   5  ...      (G = 3)
    query:  0   0   0   1   1   1  ...
    head:   0   1   2   0   1   2  ...

Reference: lantau.kernels.reference.unified_attention_ref (and paged_attention_ref).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels.attention_tiles import (
    FP8_KV_DTYPE,
    LOG2E,
    MIN_BLOCK_M,
    attend_tile,
    check_kv_scales,
    check_paged_inputs,
    dot_operand,
    dot_precision,
    kv_strides,
)

# tile shapes (module constants so tests can shrink them to stress tile boundaries); 64 x 64 with
# 4 warps, 2 stages beat 128-row / 128-key / 3-stage tiles for bf16 prefill on an H200
_PREFILL_BLOCK_M = 64  # one Hopper warpgroup MMA of query rows
# an fp8 cache's K / V tiles go e4m3 -> fp16 through registers and back to shared memory before
# the dots: 128 query rows share each conversion (H100: 275 against 249 TFLOP/s at 4 x 2,048
# prompt tokens, 227 against 211 at 8 x 1,000; bf16 tiles stay best at 64). A decode row fills
# 1 query of the tile's rows, so decodes cost more in it (8 x 1,000 prompt tokens beside 256
# decodes of 1,500 keys: 953 against 773 us): the 128-row tile is for batches of at least
# _FP8_PREFILL_MIN_AVG query rows a request
_FP8_PREFILL_BLOCK_M = 128
_FP8_PREFILL_MIN_AVG = 128
_BLOCK_N = 64  # keys per iteration


@triton.jit
def _find_request(query_start_loc_ptr, base, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Request owning global query tile `tile_id`: binary search, no host sync.

    Request i's tiles are numbered from (query_start_loc[i] - base) // BLOCK_Q + i, strictly
    increasing in i; it owns at least ceil(num_q / BLOCK_Q) of them (some past its last row,
    which exit).
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def find_tile(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Global query tile `tile_id`: its request, the request's first row of q and its number
    of query rows, and the tile's index within the request (past its rows: nothing to do).
    Row 0 of q is query_start_loc[0]'s (a batch's tail: its leading rows another launch's)."""
    base = tl.load(query_start_loc_ptr)
    req = _find_request(query_start_loc_ptr, base, tile_id, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req) - base
    num_q = tl.load(query_start_loc_ptr + req + 1) - base - q_start
    return req, q_start, num_q, tile_id - (q_start // BLOCK_Q + req)


# NOTE: what changes from step to step is not specialized (Triton compiles a variant for 1 and
# for multiples of 16 of each int argument, and for 16-byte aligned pointers): the ints, and the
# per-request arrays, which start mid-allocation in a batch's tail (ops.py: a step's leading
# decodes go to the decode kernel). A serving step must never wait on a compile.
@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt_req"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    num_reqs,
    scale_log2,  # softmax scale * log2(e) * k_scale (1 but for an fp8 cache)
    v_scale,  # 1 but for an fp8 cache
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
    SKIP_FRESH: tl.constexpr,  # requests with no keys before the step: fresh_attention's
):
    tile_id, kv_head = tl.program_id(0), tl.program_id(1)
    req, q_start, num_q, q_tile = find_tile(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q)
    if q_tile * BLOCK_Q >= num_q:
        return  # the grid is an upper bound on the number of tiles
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - num_q  # keys before this step's first query row
    # NOTE: nested: Triton's `and` of a constexpr and a tensor does not compile for sm90
    if SKIP_FRESH:  # noqa: SIM102
        if context_len == 0:
            return

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
    q = dot_operand(q, kv_ptr)

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
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table, start_n, full_end, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # NOTE: key 0 is visible to every row (q_pos >= 0), so every row's first tile has a key
    for start_n in range(full_end, num_keys, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table, start_n, num_keys, scale_log2,
            stride_kv_block, stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    # a request with no keys (seq_len 0: padding) writes zeros rather than 0 / 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    o_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _unified_block_m(
    max_query_len: int, group: int, num_tokens: int, num_reqs: int, fp8_cache: bool
) -> int:
    """Tile rows: enough for the longest request's rows x heads, capped at a prefill tile.

    Decode-only batches get 16 rows (G heads of one token), prefill batches _PREFILL_BLOCK_M,
    or _FP8_PREFILL_BLOCK_M over an fp8 cache with at least _FP8_PREFILL_MIN_AVG query rows a
    request (few decode rows). Only a performance choice: the grid covers every request
    whatever BLOCK_M is.
    """
    fp8_prefill = fp8_cache and num_tokens >= _FP8_PREFILL_MIN_AVG * num_reqs
    cap = _FP8_PREFILL_BLOCK_M if fp8_prefill else _PREFILL_BLOCK_M
    rows = triton.next_power_of_2(max(max_query_len, 1) * group)
    return max(triton.next_power_of_2(group), min(cap, max(MIN_BLOCK_M, rows)))


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    skip_fresh: bool = False,
) -> None:
    """Causal attention of each request's query rows over its cached context, into out.

    One launch for a batch mixing prefills, chunked prefills and decodes. Request i's rows of q
    start at query_start_loc[i] - query_start_loc[0] (so a batch's tail runs as q[r:] with
    query_start_loc[k:], r = query_start_loc[k]); rows of out past the last request's are not
    written.
    max_query_len / max_seq_len may be upper bounds: they only choose the tile shape.
    `tile` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the default (for tuning).
    An fp8 cache (float8_e4m3fn) holds keys / k_scale and values / v_scale.
    skip_fresh: requests whose every key is this step's (seq_len == query rows) are left to
    fresh_attention (their rows of out not written).
    """
    # q, out: [num_tokens, num_heads, head_dim]
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32
    # block_tables: [num_reqs, max_blocks] int32
    check_paged_inputs(q, kv_cache, out, seq_lens, block_tables, max_seq_len)
    check_kv_scales(kv_cache, k_scale, v_scale)
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
        _unified_block_m(
            max_query_len, group, num_tokens, num_reqs, kv_cache.dtype == FP8_KV_DTYPE
        ),
        _BLOCK_N,
        4,
        2,
    )
    assert block_m >= group, f"BLOCK_M {block_m} holds less than one group of {group} heads"
    block_q = block_m // group
    # request i's tiles start at (query_start_loc[i] - query_start_loc[0]) // block_q + i (see
    # _find_request), so this many tiles cover every request without reading query_start_loc
    # on the host
    num_tiles = num_tokens // block_q + num_reqs
    _unified_attention_kernel[(num_tiles, num_kv_heads)](
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        num_reqs,
        scale * LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_strides(kv_cache),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        SKIP_FRESH=skip_fresh,
        num_warps=num_warps,
        num_stages=num_stages,
    )
