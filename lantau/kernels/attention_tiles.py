"""What unified and decode attention share: one online-softmax step over a tile of a paged
context, and the launchers' input checks.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values), as
lantau.kernels.reference.paged_attention_ref reads it. Keys are gathered one token at a time
through the block table (`block_tables[req, t // block_size]`, slot `t % block_size`), so a KV
tile (BLOCK_N tokens) need not match the cache block size.

An fp8 cache (float8_e4m3fn) holds keys / k_scale and values / v_scale (one scale each a
layer: reference.quantize_kv_ref). A tile is loaded as fp8 and converted to the query's dtype
for the dots (exact: every e4m3 value is a bf16 or fp16 one), a bf16 query first going to fp16
(`dot_operand`: e4m3 -> fp16 is one instruction a pair, e4m3 -> bf16 several, which held the
fp8 decode under the copy rate); the scales cost nothing in the loop: k_scale is folded into
the scores' scale, v_scale applied to the normalised output.

Both kernels run the step (fp32, exp2 domain, scores scaled by scale * log2(e)) twice over a
context: first the whole tiles every row sees, without a score mask, then the tiles at the
causal edge / end of context, masked (faster prefill on an H200 than masking every tile).
max_query_len and max_seq_len only pick tile shapes and split counts; every bound the kernels
obey is read from the device tensors, so a CUDA graph captured with upper bounds stays correct.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # the cache dtype of kv_cache_dtype="fp8"
MIN_BLOCK_M = 16  # smallest M of a tensor-core tile


@triton.jit
def tile_weights(
    l_i, m_i, q, q_pos, k_base, table, start_n, key_end, scale_log2, stride_kv_block,
    stride_kv_slot, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_SCORES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The score half of an online-softmax step over keys start_n .. start_n + BLOCK_N of a
    paged context: the tile's weights p [R, BLOCK_N], alpha, the new l_i and m_i, and the
    keys' cache offsets and validity (for the values)."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos, k_valid, slot = tile_slots(
        table, start_n, key_end, stride_kv_block, stride_kv_slot, BLOCK_SIZE, BLOCK_N
    )
    # [HEAD_DIM, BLOCK_N]; slots past key_end may hold garbage, even NaN: never loaded. An fp8
    # cache's tile is converted to q's dtype (exactly); any other's .to is a no-op
    k = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=k_valid[None, :], other=0.0)
    k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [R, BLOCK_N]
    if MASK_SCORES:
        # -inf, never a multiply by 0: 0 * NaN = NaN. NOTE: callers guarantee every row sees
        # a key in its first tile, so m_new is finite and m_i - m_new is never -inf - -inf
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    p, alpha, l_i, m_new = softmax_step(s, l_i, m_i)
    return p, alpha, l_i, m_new, slot, k_valid


@triton.jit
def attend_tile(
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
    p, alpha, l_i, m_new, slot, k_valid = tile_weights(
        l_i, m_i, q, q_pos, k_base, table, start_n, key_end, scale_log2, stride_kv_block,
        stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_SCORES, DOT_PRECISION,
    )  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attend_tile_pairs(
    acc_even, acc_odd, l_i, m_i, q, q_pos, k_base, v_base, table, start_n, key_end,
    scale_log2, stride_kv_block, stride_kv_slot, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_SCORES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """attend_tile over an fp8 cache, its output in two halves: acc_even [R, HEAD_DIM / 2] the
    even dims, acc_odd the odd ones (join_pairs puts them back together).

    The values are read as 16-bit pairs of adjacent dims and converted to two fp16 tiles. A
    tile of e4m3 values has no transposing shared-memory load (ldmatrix's is 16-bit), and the
    P @ V dot needs its values paired along the keys: read as fp8, the compiler loads them one
    byte an instruction (LDS.U8); as 16-bit pairs they take the transposing ldmatrix, and the
    conversion regroups the bytes (pairs_to_f16)."""
    p, alpha, l_i, m_new, slot, k_valid = tile_weights(
        l_i, m_i, q, q_pos, k_base, table, start_n, key_end, scale_log2, stride_kv_block,
        stride_kv_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_SCORES, DOT_PRECISION,
    )  # fmt: skip
    offs_pair = tl.arange(0, HEAD_DIM // 2)
    pairs = tl.load(
        v_base.to(tl.pointer_type(tl.uint16)) + (slot // 2)[:, None] + offs_pair[None, :],
        mask=k_valid[:, None], other=0,
    )  # fmt: skip
    v_even, v_odd = pairs_to_f16(pairs, USE_ASM)  # [BLOCK_N, HEAD_DIM / 2] each
    # as attend_tile: the dots in q's dtype (fp16 for a bf16 q: dot_operand), exact
    v_even, v_odd = v_even.to(q.dtype), v_odd.to(q.dtype)
    p = p.to(q.dtype)
    acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=DOT_PRECISION)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PRECISION)
    return acc_even, acc_odd, l_i, m_new


@triton.jit
def pairs_to_f16(x, USE_ASM: tl.constexpr):
    """uint16 x holding two e4m3 values (low byte: an even dim, high byte: the odd dim after
    it) -> (even, odd) as fp16, exactly. USE_ASM (CUDA): cvt.rn.f16x2.e4m3x2 on two x at a time
    after a byte permute that pairs their even and their odd bytes, so each conversion yields
    the two elements a dot register holds; otherwise (the interpreter) the same values from
    bit operations: e4m3 s.eeee.mmm is fp16 s.0eeee.mmm0000000 times 2^8 (exponent biases 7
    and 15), subnormals included."""
    if USE_ASM:
        even, odd = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
        )  # fmt: skip
    else:
        x = x.to(tl.int32)
        even = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.uint16)
        odd = ((x & 0x8000) | ((x >> 1) & 0x3F80)).to(tl.uint16)
        even = even.to(tl.float16, bitcast=True) * 256.0
        odd = odd.to(tl.float16, bitcast=True) * 256.0
    return even, odd


@triton.jit
def join_pairs(acc_even, acc_odd):
    """[R, HEAD_DIM / 2] even and odd dims -> [R, HEAD_DIM]."""
    return tl.reshape(tl.join(acc_even, acc_odd), [acc_even.shape[0], 2 * acc_even.shape[1]])


@triton.jit
def split_pairs(acc):
    """join_pairs' inverse: [R, HEAD_DIM] -> even dims, odd dims."""
    return tl.split(tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))


@triton.jit
def dot_operand(q, kv_ptr):
    """q as the dots take it: unchanged, but for a bf16 q over an fp8 cache, fp16 (which the
    tiles then convert to, cheaply); bf16 -> fp16 is exact from fp16's smallest normal (2^-14)
    up, and saturated at its largest, +-65504."""
    if kv_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def tile_slots(
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
def load_kv(k_base, v_base, slot, offs_d, mask):
    """A tile's keys [HEAD_DIM, BLOCK_N] and values [BLOCK_N, HEAD_DIM] at `slot` where mask,
    else 0."""
    k = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=mask[None, :], other=0.0)
    v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def quantize_kv(x, inv_scale, cache_ptr):
    """x as the cache at cache_ptr stores it: in an fp8 cache x * inv_scale (1 / the layer's
    scale), in fp32, saturated to e4m3's +-448; in any other, x rounded to its dtype."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def softmax_step(s, l_i, m_i):
    """Online softmax over one tile's scores s [R, BLOCK_N] (log2 domain): the tile's weights,
    the factor that rescales what came before, and the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_paged_inputs(
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
    assert kv_cache.dtype in (q.dtype, FP8_KV_DTYPE) and out.dtype == q.dtype, (
        f"q {q.dtype}, kv_cache {kv_cache.dtype} (or fp8), out {out.dtype} must match"
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


def check_kv_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales only mean something to an fp8 cache; positive and finite there."""
    if kv_cache.dtype != FP8_KV_DTYPE:
        assert k_scale == v_scale == 1.0, f"scales {k_scale}, {v_scale}: {kv_cache.dtype} cache"
    assert 0.0 < k_scale < math.inf and 0.0 < v_scale < math.inf, f"scales {k_scale}, {v_scale}"


def kv_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    # kv, block, slot, head; head_dim is contiguous (checked)
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 is the test/debug dtype: keep it exact; tf32 would only matter for fp32 anyway
    return "ieee" if dtype == torch.float32 else "tf32"
