"""What a forward pass carries besides token ids: the attention metadata of the step's flat
batch and the per-layer KV caches. The runner builds it; the model and its ops read it.

The batch is flat ("varlen"): request i owns query rows query_start_loc[i]:query_start_loc[i+1],
at positions seq_lens[i] - num_q[i] .. seq_lens[i] - 1 of its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's KV goes to
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: row offsets of each request
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    max_query_len: int  # upper bounds: they choose tile shapes, the kernels read true lengths
    max_seq_len: int
    # the leading requests of one query row each (decodes) that a step with prompt rows may
    # attend through the decode kernel, the rest in the unified launch (0: all in one launch)
    num_decodes: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class KeptRows:
    """The rows of a step whose output its caller reads (the rows that sample, each the last
    of its request's rows): the last layer writes every row's keys and values, and computes
    the rest (attention, o_proj, the MLP) for these rows only."""

    rows: torch.Tensor  # [n] int64: their row indices in the step
    attn: AttentionMetadata  # their requests as a decode batch: one query row each

    @classmethod
    def of(
        cls, meta: AttentionMetadata, rows: torch.Tensor, reqs: torch.Tensor, max_seq_len: int
    ) -> KeptRows:
        """rows [n] int64, row i the last of request reqs[i]'s in the step `meta` describes;
        max_seq_len: their longest context (a host int: no device sync here)."""
        attn = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=rows.device),
            seq_lens=meta.seq_lens[reqs],
            block_tables=meta.block_tables[reqs],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        return cls(rows, attn)


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids."""

    attn: AttentionMetadata
    # one per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values)
    kv_caches: list[torch.Tensor]
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    cos_sin_cache: torch.Tensor | None = None  # [max_positions, head_dim] fp32, set by the model
    lora: object | None = None  # the step's adapter tokens (lantau/model/lora.py's LoRABatch)
    keep: KeptRows | None = None  # the rows the last layer computes (None: every row)
