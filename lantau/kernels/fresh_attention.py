"""Causal attention of a step's fresh prompts over their own keys, read from the step's q, k, v.

A fresh prompt is a request whose every key is computed in this step (seq_len == its query
rows: no cached context). Its keys need not come from the paged cache: they are the step's own
k and v rows, contiguous by token, in the model's dtype (bf16 even over an fp8 cache), so the
kernel reads them with no block table and no e4m3 conversion. Requests with a context before
the step are skipped here: the unified kernel takes them (`skip_fresh`).

A program owns BLOCK_Q query rows of one request times HEADS query heads (HEADS divides the
GQA group), packed into the BLOCK_M = BLOCK_Q * HEADS rows of the tile; axis 0 of the grid is
the head group, so the programs of one tile (sharing its keys) run side by side, and axis 1
runs the tiles last first (a request's last tiles see the most keys).

Reference: lantau.kernels.reference.unified_attention_ref over a cache holding the same keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels.attention_tiles import LOG2E, dot_precision, softmax_step
from lantau.kernels.unified_attention import find_tile

# (BLOCK_M, BLOCK_N, num_warps, num_stages, HEADS): the best of 15 tilings on an H100 at 32 x
# 2,048, 4 x 2,048 and 8 x 1,000 prompt tokens (2,885, 358.9 and 217.9 us a layer, llama3-8b
# heads) against the earlier (128, 32, 4, 3, 1)'s 2,980, 369.8 and 227.8 (-3 to -4 %; -5 % in
# a second run), level at 64 x 128 (114.8 against 114.0; benchmarks/kernel_sweep.py --kernel
# prefill-attn --fresh-only, RESULTS.md 2026-12-07)
DEFAULT_TILE = (64, 64, 4, 3, 1)


@triton.jit
def _fresh_step(acc, l_i, m_i, q, q_idx, k_base, v_base, start_n, num_q, stride_k, stride_v,
                scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step over the request's keys start_n .. start_n + BLOCK_N."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # only a masked tile reaches past the request's keys
    valid = (offs_n < num_q)[:, None] if MASKED else None
    k = tl.load(k_base + offs_n[:, None] * stride_k + offs_d[None, :], mask=valid)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(offs_n[None, :] <= q_idx[:, None], s, float("-inf"))
    p, alpha, l_i, m_new = softmax_step(s, l_i, m_i)
    v = tl.load(v_base + offs_n[:, None] * stride_v + offs_d[None, :], mask=valid)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# as the unified kernel: what changes from step to step is not specialized
@triton.jit(
    do_not_specialize=["num_reqs"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr"],
)
def _fresh_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    v_ptr,
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,  # query heads per kv head
    HEADS: tl.constexpr,  # query heads a tile (divides GROUP)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q query rows x HEADS heads
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_group = tl.program_id(0)
    tile_id = tl.num_programs(1) - 1 - tl.program_id(1)
    req, q_start, num_q, q_tile = find_tile(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q)
    if q_tile * BLOCK_Q >= num_q:
        return
    if tl.load(seq_lens_ptr + req) != num_q:
        return  # keys before the step: the unified kernel's

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile * BLOCK_Q + offs_m // HEADS  # [BLOCK_M] query row within the request
    head = head_group * HEADS + offs_m % HEADS
    kv_head = head_group * HEADS // GROUP
    row_mask = q_idx < num_q
    token = (q_start + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = k_ptr + q_start.to(tl.int64) * stride_k_token + kv_head * stride_k_head
    v_base = v_ptr + q_start.to(tl.int64) * stride_v_token + kv_head * stride_v_head
    # keys before the tile's first row: seen by every row, whole tiles unmasked
    full_end = q_tile * BLOCK_Q // BLOCK_N * BLOCK_N
    num_keys = tl.minimum((q_tile + 1) * BLOCK_Q, num_q)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _fresh_step(
            acc, l_i, m_i, q, q_idx, k_base, v_base, start_n, num_q, stride_k_token,
            stride_v_token, scale_log2, HEAD_DIM, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, num_keys, BLOCK_N):
        acc, l_i, m_i = _fresh_step(
            acc, l_i, m_i, q, q_idx, k_base, v_base, start_n, num_q, stride_k_token,
            stride_v_token, scale_log2, HEAD_DIM, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]  # key 0 is every row's: l_i > 0
    o_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def fresh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tile: tuple[int, int, int, int, int] | None = None,
) -> None:
    """Causal attention of each fresh prompt (seq_lens[i] == its query rows) over its own k, v
    rows, into out; other requests' rows of out are not written.

    q, out: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], the
    step's rotated keys and its values, in q's dtype (any token and head strides, last dim
    contiguous). query_start_loc, seq_lens: as unified_attention's (a batch's tail allowed).
    `tile` = (BLOCK_M, BLOCK_N, num_warps, num_stages, HEADS) overrides DEFAULT_TILE.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (
        f"k {tuple(k.shape)}, v {tuple(v.shape)} against q {tuple(q.shape)}"
    )
    assert out.shape == q.shape, f"out {tuple(out.shape)} != q {tuple(q.shape)}"
    assert q.dtype == k.dtype == v.dtype == out.dtype, "q, k, v and out dtypes differ"
    assert all(t.stride(2) == 1 for t in (q, k, v, out)), "last dim not contiguous"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    if num_tokens == 0 or num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages, heads = tile or DEFAULT_TILE
    heads = min(heads, group)
    assert group % heads == 0 and block_m % heads == 0, f"{heads} heads a tile of {block_m}"
    block_q = block_m // heads
    num_tiles = num_tokens // block_q + num_reqs  # as unified_attention: an upper bound
    assert num_tiles < 65536, f"{num_tiles} tiles: over the grid's second axis"
    _fresh_attention_kernel[(num_heads // heads, num_tiles)](
        q, k, v, out, query_start_loc, seq_lens, num_reqs, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEADS=heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
