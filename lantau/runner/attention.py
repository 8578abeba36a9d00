"""Attention over the paged KV cache: the metadata a step carries and the torch reference.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values).
Token t of a request lives in slot `block_table[t // block_size] * block_size + t % block_size`.
The batch is flat ("varlen"): request i owns query rows query_start_loc[i]:query_start_loc[i+1],
at positions seq_lens[i] - num_q[i] .. seq_lens[i] - 1 of its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's KV goes to
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: row offsets of each request
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host copies, so the reference path needs no device sync
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions."""

    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    cos_sin_cache: torch.Tensor | None = None  # [max_positions, head_dim] fp32, set by the model


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys/values into their slots."""
    # key, value: [num_tokens, num_kv_heads, head_dim]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context.

    Pads the batch to [num_reqs, max_query_len] queries and [num_reqs, max_seq_len] keys so one
    SDPA call serves prefill, chunked prefill and decode rows alike.
    """
    # query: [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = len(meta.seq_lens_cpu)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_blocks = -(-meta.max_seq_len // block_size)
    tables = meta.block_tables[:, :max_blocks].long()
    # [2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim]
    kv = kv_cache[:, tables].reshape(2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    key_len = max_blocks * block_size

    starts = meta.query_start_loc[:-1].long()
    num_q = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    q_idx = torch.arange(meta.max_query_len, device=query.device)
    rows = (starts[:, None] + q_idx[None, :]).clamp(max=num_tokens - 1)  # [num_reqs, max_q]
    q = query[rows]  # [num_reqs, max_q, num_heads, head_dim]
    # position of each padded query row in its sequence; keys up to and including it are seen
    q_pos = (meta.seq_lens.long() - num_q)[:, None] + q_idx[None, :]  # [num_reqs, max_q]
    k_pos = torch.arange(key_len, device=query.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [num_reqs, max_q, key_len]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [num_reqs, num_heads, max_q, head_dim]
        kv[0].transpose(1, 2),  # [num_reqs, num_kv_heads, key_len, head_dim]
        kv[1].transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [num_reqs, max_q, num_heads, head_dim]
    valid = q_idx[None, :] < num_q[:, None]  # [num_reqs, max_q]
    return out[valid]  # [num_tokens, num_heads, head_dim], in row order
