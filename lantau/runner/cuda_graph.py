"""CUDA graphs for decode-only steps: one graph per bucket batch size, replayed with padding.

A decode step launches hundreds of small kernels; replaying them as one graph removes the
per-launch CPU cost, which dominates at small batch. Graphs read their inputs from persistent
buffers that each step overwrites; padding rows write no KV (slot -1) and are discarded.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from lantau.config import EngineConfig
from lantau.kv_cache.manager import cdiv
from lantau.model.llama import LlamaForCausalLM
from lantau.runner.attention import AttentionMetadata, ForwardContext

logger = logging.getLogger(__name__)


MAX_GRAPH_BS = 512  # larger decode batches run eagerly (launch cost is small next to them)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = config.scheduler.max_model_len
        self.batch_sizes = graph_batch_sizes(min(config.scheduler.max_num_seqs, MAX_GRAPH_BS))
        self.max_bs = self.batch_sizes[-1]
        max_blocks = cdiv(self.max_seq_len, config.cache.block_size)
        n = self.max_bs

        def buf(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.slot_mapping = buf(n), buf(n), buf(n)
        self.seq_lens = buf(n, dtype=torch.int32)
        self.block_tables = buf(n, max_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, inputs) -> bool:
        return inputs.max_query_len == 1 and inputs.num_reqs <= self.max_bs

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # an upper bound: kernels read true lengths
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )
        ctx = ForwardContext(meta, self.kv_caches, self.positions[:bs])
        hidden = self.model(self.input_ids[:bs], ctx)
        return self.model.compute_logits(hidden)  # [bs, vocab_size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all sharing one memory pool (replays never overlap)."""
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        pool = None
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for batch sizes %s", self.batch_sizes)

    def run(self, inputs, fill_pending) -> torch.Tensor:
        """Logits [bucket, vocab]; the first inputs.num_reqs rows are real.

        `fill_pending(input_ids, inputs)` writes the input tokens still on the device.
        """
        n = inputs.num_reqs
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

        def put(dst: torch.Tensor, src: np.ndarray) -> None:
            # NOTE: through pinned memory: a pageable copy would wait for the queued steps
            dst.copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)

        put(self.input_ids[:n], inputs.input_ids)
        fill_pending(self.input_ids, inputs)
        put(self.positions[:n], inputs.positions)
        put(self.slot_mapping[:n], inputs.slot_mapping)
        put(self.seq_lens[:n], inputs.seq_lens)
        width = inputs.block_tables.shape[1]
        put(self.block_tables[:n, :width], inputs.block_tables)
        if bs > n:  # padding rows: no KV write, one valid slot to read
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(0)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits
