"""The torch reference of every kernel in lantau/kernels: what TorchOps runs, and what the kernel
tests compare the kernels with. Plain torch, no Triton, so the torch backend runs where Triton
is not installed.

Paged KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values).
Token t of a request lives in slot `block_table[t // block_size] * block_size + t % block_size`.

An fp8 cache (float8_e4m3fn) holds x / scale, saturated to e4m3's +-448, one scale for a
layer's keys and one for its values (k_scale, v_scale): quantized where keys and values are
written, dequantized (times the scale) where attention reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lantau.kv_cache.manager import cdiv


def embedding_ref(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    pick_src: torch.Tensor | None = None,
    prev_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight[ids]: [num_tokens, hidden]; with pick_src, row i's id is prev_ids[pick_src[i]]
    where pick_src[i] >= 0 (a token the previous step sampled on the device)."""
    if pick_src is not None:
        input_ids = torch.where(pick_src >= 0, prev_ids[pick_src.clamp(min=0)], input_ids)
    return F.embedding(input_ids, weight)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32, rounded to x's dtype, then times the weight (HF's LlamaRMSNorm)."""
    # x: [num_tokens, hidden_size]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the fused kernel's two outputs."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (HF's convention) in fp32: rotated copies of q and k.
    cos_sin_cache[p] holds cos(p * inv_freq), then sin(p * inv_freq)."""
    # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
    cos, sin = cos_sin_cache[positions][:, None, :].chunk(2, dim=-1)  # [num_tokens, 1, h] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


def quantize_kv_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: fp8 holds x / scale (in fp32, saturated), any other
    dtype x itself, rounded."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    # times the fp32 reciprocal, as the kernels do: one rounding, the same on every device
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents x as `dtype` values: fp8 times its scale (in fp32), else x."""
    if x.dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's keys and values into their cache slots, skipping slots < 0
    (padding rows); quantized with k_scale and v_scale into an fp8 cache."""
    # key, value: [num_tokens, num_kv_heads, head_dim]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    # [2, num_blocks * block_size, num_kv_heads, head_dim]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    is_valid = slot_mapping >= 0
    flat[0][slot_mapping[is_valid]] = quantize_kv_ref(key[is_valid], k_scale, kv_cache.dtype)
    flat[1][slot_mapping[is_valid]] = quantize_kv_ref(value[is_valid], v_scale, kv_cache.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up], in fp32, rounded once to x's dtype."""
    # x: [num_tokens, 2 * d] -> [num_tokens, d]
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) in fp32; `gated`: weight is [gate; up] and the result
    silu(x gate^T) * (x up^T); `weight_scale` [N]: an e4m3 weight's row scales (x unscaled)."""
    # x: [M, K]; weight: [N, K] -> [M, N] ([M, N / 2] when gated), fp32
    w = weight.float()
    if weight_scale is not None:
        w = w * weight_scale.float()[:, None]
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum: [num_rows] int64."""
    return logits.float().argmax(dim=-1)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context, the batch
    flat ("varlen"): request i owns query rows query_start_loc[i]:query_start_loc[i + 1], at
    positions seq_lens[i] - num_q[i] .. seq_lens[i] - 1 of its sequence. An fp8 cache is
    dequantized (k_scale, v_scale) to the query's dtype as it is gathered.
    fresh: the step's (k, v) [num_tokens, num_kv_heads, head_dim]; a request with no keys
    before the step (seq_len == num_q) attends over its rows of them instead of the cache's
    (fresh_attention's semantics).

    Pads the batch to [num_reqs, max_query_len] queries and [num_reqs, max_seq_len] keys so one
    SDPA call serves prefill, chunked prefill and decode rows alike, with no host sync.
    """
    # query: [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_blocks = cdiv(max_seq_len, block_size)
    tables = block_tables[:, :max_blocks].long()
    # [2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim]
    kv = kv_cache[:, tables].reshape(2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    keys = dequantize_kv_ref(kv[0], k_scale, query.dtype)
    values = dequantize_kv_ref(kv[1], v_scale, query.dtype)
    key_len = max_blocks * block_size

    starts = (query_start_loc[:-1] - query_start_loc[0]).long()
    num_q = (query_start_loc[1:] - query_start_loc[:-1]).long()
    k_pos = torch.arange(key_len, device=query.device)
    if fresh is not None:
        rows = (starts[:, None] + k_pos[None, :]).clamp(max=num_tokens - 1)  # [num_reqs, keys]
        own = (seq_lens.long() == num_q)[:, None] & (k_pos[None, :] < num_q[:, None])
        own = own[..., None, None]  # [num_reqs, keys, 1, 1]
        keys = torch.where(own, fresh[0][rows].to(keys.dtype), keys)
        values = torch.where(own, fresh[1][rows].to(values.dtype), values)
    q_idx = torch.arange(max_query_len, device=query.device)
    rows = (starts[:, None] + q_idx[None, :]).clamp(max=num_tokens - 1)  # [num_reqs, max_q]
    q = query[rows]  # [num_reqs, max_q, num_heads, head_dim]
    # position of each padded query row in its sequence; keys up to and including it are seen
    q_pos = (seq_lens.long() - num_q)[:, None] + q_idx[None, :]  # [num_reqs, max_q]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [num_reqs, max_q, key_len]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [num_reqs, num_heads, max_q, head_dim]
        keys.transpose(1, 2),  # [num_reqs, num_kv_heads, key_len, head_dim]
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [num_reqs, max_q, num_heads, head_dim]
    valid = q_idx[None, :] < num_q[:, None]  # [num_reqs, max_q]
    return out[valid]  # [num_tokens, num_heads, head_dim], in row order


def unified_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """paged_attention_ref request by request, gathering only its keys, fp32 result.

    Reads no slot past seq_len (unlike paged_attention_ref, whose padded gather turns NaN in
    unused slots into NaN output). Syncs with the host; for tests.
    """
    # q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] fp32
    num_heads = q.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    flat_kv = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, num_kv_heads, head_dim]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start or seq_len == 0:
            continue
        k_pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, k_pos // block_size].long() * block_size + k_pos % block_size
        # [seq_len, num_heads, head_dim] each: kv heads repeated for their query heads
        group = num_heads // num_kv_heads
        keys = dequantize_kv_ref(flat_kv[0, slots], k_scale, torch.float32)
        values = dequantize_kv_ref(flat_kv[1, slots], v_scale, torch.float32)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys) * scale
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """unified_attention_ref with one query row per request, fp32 result."""
    # q: [num_reqs, num_heads, head_dim] -> [num_reqs, num_heads, head_dim] fp32
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return unified_attention_ref(
        q, kv_cache, query_start_loc, seq_lens, block_tables, scale, k_scale, v_scale
    )
