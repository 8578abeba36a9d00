"""Rotary position embedding, rotate-half (HF / NeoX) convention, fused with the KV-cache write.

cos_sin_cache row p holds cos(p * inv_freq) then sin(p * inv_freq), head_dim values in all:

    cos_sin_cache[p] = | cos f_0 .. cos f_{h-1} | sin f_0 .. sin f_{h-1} |   h = head_dim // 2

and element d < h of a head pairs with element d + h:
    out[d]     = x[d]     * cos f_d - x[d + h] * sin f_d
    out[d + h] = x[d + h] * cos f_d + x[d]     * sin f_d

as lantau.kernels.reference.rotary_ref computes it. One program rotates every q and k head of a
token; q in place, while the rotated keys and the values go straight into their paged-cache
slots, quantized there if the cache is fp8 (lantau.kernels.reference.quantize_kv_ref). Attention
reads keys from the cache, but for a step's fresh prompts (fresh_attention), which read the
step's own k and v: with store_kv the rotated keys (and an unscaled product's scaled values)
are also stored back in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.attention_tiles import FP8_KV_DTYPE, check_kv_scales, quantize_kv
from lantau.kernels.fp8_quant import check_unscaled
from lantau.kernels.pdl import pdl_wait


@triton.jit
def _cos_sin(cos_sin_cache_ptr, position, HALF_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin of one position's angles: [BLOCK_HALF] fp32 each, 0 past HALF_DIM."""
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_cache_ptr + position * (2 * HALF_DIM)
    cos = tl.load(row + dims, mask=dims < HALF_DIM, other=0.0)
    sin = tl.load(row + HALF_DIM + dims, mask=dims < HALF_DIM, other=0.0)
    return cos, sin


@triton.jit
def _halves(
    row_ptr, offs, mask, scale, col_ptr, cols, HALF_DIM: tl.constexpr, SCALED: tl.constexpr
):
    """Both halves of the heads at `offs` (first-half offsets) from row_ptr (fp32); SCALED:
    times `scale` (the row's) and col_ptr's column scales at `cols` (first-half columns)."""
    x1 = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + offs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x1 *= scale * tl.load(col_ptr + cols, mask=mask, other=0.0)
        x2 *= scale * tl.load(col_ptr + cols + HALF_DIM, mask=mask, other=0.0)
    return x1, x2


@triton.jit
def _rotated(row_ptr, offs, mask, cos, sin, HALF_DIM: tl.constexpr, scale, col_ptr, cols,
             SCALED: tl.constexpr):  # fmt: skip
    """Both halves of the heads at `offs` (first-half offsets) from row_ptr, rotated (fp32)."""
    x1, x2 = _halves(row_ptr, offs, mask, scale, col_ptr, cols, HALF_DIM, SCALED)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rotate_heads(
    row_ptr,
    head_stride,
    num_heads,
    cos,
    sin,
    HALF_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    scale,
    col_ptr,
    SCALED: tl.constexpr,
):
    # row_ptr: one token's first head; cos, sin: [BLOCK_HALF] fp32, 0 past HALF_DIM
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    offs = heads[:, None] * head_stride + dims[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF_DIM)
    cols = heads[:, None] * (2 * HALF_DIM) + dims[None, :]  # the heads' columns, contiguous
    out1, out2 = _rotated(row_ptr, offs, mask, cos, sin, HALF_DIM, scale, col_ptr, cols, SCALED)
    tl.store(row_ptr + offs, out1.to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(row_ptr + offs + HALF_DIM, out2.to(row_ptr.dtype.element_ty), mask=mask)


def _launch_options(q: torch.Tensor, k: torch.Tensor, use_pdl: bool) -> dict:
    """Tile sizes and launch options, from q's and k's shapes."""
    num_heads, head_dim = q.shape[1:]
    block_half = triton.next_power_of_2(head_dim // 2)
    block_q_heads = triton.next_power_of_2(num_heads)
    return dict(
        HALF_DIM=head_dim // 2,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_K_HEADS=triton.next_power_of_2(k.shape[1]),
        # the q tile (the larger) at about 8 elements per thread, each half a 16-byte fp16 load
        num_warps=min(max(block_q_heads * block_half // 256, 1), 16),
        **pdl.launch_options(q.device, use_pdl),
    )


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    key_cache_ptr,  # [num_slots, num_kv_heads, 2 * HALF_DIM] contiguous
    value_cache_ptr,
    slot_mapping_ptr,
    q_row_stride,
    q_head_stride,
    k_row_stride,
    k_head_stride,
    v_row_stride,
    v_head_stride,
    num_heads,
    num_kv_heads,
    k_inv_scale,  # 1 / k_scale, 1 / v_scale (1 but for an fp8 cache)
    v_inv_scale,
    row_scale_ptr,  # [num_tokens] fp32, when SCALED
    q_col_ptr,  # q's, k's and v's column scales (num_heads or num_kv_heads x head_dim), when
    k_col_ptr,  # SCALED: q, k and v are an unscaled fp8 product's, each value still to be
    v_col_ptr,  # multiplied by its row's and its column's scale
    HALF_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    USE_PDL: tl.constexpr,
    SCALED: tl.constexpr,
    STORE_KV: tl.constexpr,  # rotated k (and scaled v) also stored back in place
):
    # the token's position, its cos / sin row and its slot before the PDL wait: step inputs no
    # kernel of the step writes, and a constant (pdl.py's contract)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_cache_ptr, tl.load(positions_ptr + token), HALF_DIM, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token)
    pdl_wait(USE_PDL)
    scale = tl.load(row_scale_ptr + token) if SCALED else 1.0
    _rotate_heads(
        q_ptr + token * q_row_stride, q_head_stride, num_heads, cos, sin,
        HALF_DIM, BLOCK_Q_HEADS, BLOCK_HALF, scale, q_col_ptr, SCALED,
    )  # fmt: skip
    # keys: rotated in registers, stored to the cache slot only; values copied alongside.
    # slot < 0 marks a padding row (CUDA-graph batches): the masks turn the stores off
    heads = tl.arange(0, BLOCK_K_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    in_heads = (heads[:, None] < num_kv_heads) & (dims[None, :] < HALF_DIM)
    mask = in_heads & (slot >= 0)
    src = heads[:, None] * k_head_stride + dims[None, :]
    cols = heads[:, None] * (2 * HALF_DIM) + dims[None, :]
    k_row = k_ptr + token * k_row_stride
    out1, out2 = _rotated(k_row, src, in_heads, cos, sin, HALF_DIM, scale, k_col_ptr, cols, SCALED)
    if STORE_KV:
        tl.store(k_row + src, out1.to(k_ptr.dtype.element_ty), mask=in_heads)
        tl.store(k_row + src + HALF_DIM, out2.to(k_ptr.dtype.element_ty), mask=in_heads)
    dst = slot * (num_kv_heads * 2 * HALF_DIM) + heads[:, None] * (2 * HALF_DIM) + dims[None, :]
    # each as the cache stores it: rounded, or quantized into an fp8 cache
    out1 = quantize_kv(out1, k_inv_scale, key_cache_ptr)
    tl.store(key_cache_ptr + dst, out1, mask=mask)
    out2 = quantize_kv(out2, k_inv_scale, key_cache_ptr)
    tl.store(key_cache_ptr + dst + HALF_DIM, out2, mask=mask)
    vsrc = heads[:, None] * v_head_stride + dims[None, :]
    v_row = v_ptr + token * v_row_stride
    v1, v2 = _halves(v_row, vsrc, in_heads, scale, v_col_ptr, cols, HALF_DIM, SCALED)
    if STORE_KV and SCALED:
        tl.store(v_row + vsrc, v1.to(v_ptr.dtype.element_ty), mask=in_heads)
        tl.store(v_row + vsrc + HALF_DIM, v2.to(v_ptr.dtype.element_ty), mask=in_heads)
    v1 = quantize_kv(v1, v_inv_scale, value_cache_ptr)
    tl.store(value_cache_ptr + dst, v1, mask=mask)
    v2 = quantize_kv(v2, v_inv_scale, value_cache_ptr)
    tl.store(value_cache_ptr + dst + HALF_DIM, v2, mask=mask)


def apply_rotary_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    use_pdl: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    store_kv: bool = False,
) -> None:
    """Rotate q in place by the angles of each token's position; store rotated k and v into
    cache slot slot_mapping[t] (slot < 0: skipped). k itself is left as it was, unless
    store_kv: then k is rotated in place too and v scaled in place (where an unscaled
    product's), every row, for fresh_attention to read.
    row_scale [num_tokens] and col_scale [(num_heads + 2 * num_kv_heads) * head_dim] (fp32,
    together): q, k and v are views of an unscaled fp8 product (a tensor-wise GEMM's, in q,
    k, v column order), each value multiplied by its row's and its column's scale first (q
    stored back scaled and rotated).

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; all may be
    strided views of a fused qkv output (any row and head stride, last dim contiguous).
    positions, slot_mapping: [num_tokens] int64. cos_sin_cache: [max_position, head_dim] fp32
    contiguous (lantau.model.ops.build_cos_sin_cache). kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim] contiguous, q's dtype or fp8 (float8_e4m3fn: keys / k_scale and
    values / v_scale stored). Positions and slots are not range-checked (that would need a
    device sync).
    """
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
    )
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.dtype == torch.float32, f"cos_sin_cache dtype {cos_sin_cache.dtype}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == k.shape[1:], (
        f"kv_cache heads {tuple(kv_cache.shape[3:])} != k heads {tuple(k.shape[1:])}"
    )
    assert q.dtype == k.dtype == v.dtype, "q, k and v dtypes differ"
    assert kv_cache.dtype in (q.dtype, FP8_KV_DTYPE), f"cache {kv_cache.dtype}, q {q.dtype}"
    check_kv_scales(kv_cache, k_scale, v_scale)
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype}"
    devices = {t.device for t in (q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping)}
    assert len(devices) == 1, f"tensors on {devices}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "last dim not contiguous"
    assert kv_cache.is_contiguous() and cos_sin_cache.is_contiguous()
    assert positions.is_contiguous() and slot_mapping.is_contiguous()
    q_cols, kv_cols = num_heads * head_dim, k.shape[1] * head_dim
    scaled = check_unscaled(row_scale, col_scale, num_tokens, q_cols + 2 * kv_cols, q.device)
    if scaled:
        col_q, col_k, col_v = col_scale.split([q_cols, kv_cols, kv_cols])
    else:  # unused
        row_scale = col_q = col_k = col_v = positions
    if num_tokens == 0:
        return
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, kv_cache[0], kv_cache[1], slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, k.shape[1], 1.0 / k_scale, 1.0 / v_scale, row_scale, col_q, col_k, col_v,
        SCALED=scaled, STORE_KV=store_kv, **_launch_options(q, k, use_pdl),
    )  # fmt: skip
