"""StepInputs: one step's flat batch on the host, what the runner's eager forward and the CUDA
graphs' staging both take."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepInputs:
    """One step's batch on the host (numpy), in request order."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_tables: np.ndarray  # [num_reqs, max_blocks] int32, padded with 0
    sample_ids: list[str]  # requests that sample this step, in row order
    logits_indices: np.ndarray  # [num_sample] int64: their last token's row
    # input rows whose token the previous step sampled and the host has not seen yet, and
    # that token's row in the previous step's sampled ids
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # [num_tokens] int64: each token's LoRA adapter slot, -1 for the base model; None for an
    # engine without adapters (lantau/model/lora.py)
    lora_index: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def has_adapter_rows(self) -> bool:
        """Whether a token of the step runs through a LoRA adapter (else the step is the base
        model's alone: no adapter delta to add)."""
        return self.lora_index is not None and bool((self.lora_index >= 0).any())

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())

    @property
    def num_leading_decodes(self) -> int:
        """How many requests, from the first, have one query row each (decodes)."""
        prompt = np.flatnonzero(np.diff(self.query_start_loc) != 1)
        return int(prompt[0]) if len(prompt) else self.num_reqs
