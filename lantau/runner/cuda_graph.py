"""CUDA graphs for decode-only steps: one graph per bucket batch size, replayed with padding.

A decode step launches hundreds of small kernels; replaying them as one graph removes the
per-launch CPU cost, which dominates at small batch. Graphs read their inputs from persistent
buffers that each step overwrites; padding rows write no KV (slot -1) and are discarded.

A step's inputs reach the device in one copy of one buffer, staged in pinned host memory,
padding rows included: int64 input ids, positions, slots, and for each row whose input token
the previous step sampled on the device, that token's row in the runner's `prev_token_ids`,
else -1; then int32 sequence lengths and block tables. The graph's first kernel picks each
row's input token from `prev_token_ids` or the host's ids as it embeds it. With
`greedy_in_graph` (on, see there) the graph ends with the greedy pick of each row, written into
`prev_token_ids`: for an all-greedy batch the sampler takes it, so between replays run only the
copy of the ids to the host and the copy of the next step's inputs.

A small bucket can have a second graph for batches whose contexts are all short
(`ops.short_context_keys`): its attention is captured with another tiling, and each step
replays the one its longest context allows.
"""

from __future__ import annotations

import bisect
import logging

import torch

from lantau.config import EngineConfig
from lantau.kv_cache.manager import cdiv
from lantau.model.llama import LlamaForCausalLM
from lantau.runner.attention import AttentionMetadata, ForwardContext
from lantau.sampling.sampler import greedy_pick

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
        prev_token_ids: torch.Tensor,
    ) -> None:
        """prev_token_ids: the runner's [max_num_seqs] int64 ids of the last sampling step."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = config.scheduler.max_model_len
        self.batch_sizes = graph_batch_sizes(min(config.scheduler.max_num_seqs, MAX_GRAPH_BS))
        self.max_bs = self.batch_sizes[-1]
        max_blocks = cdiv(self.max_seq_len, config.cache.block_size)
        n = self.max_bs

        self.max_blocks = max_blocks
        # the inputs, one buffer (one copy a step): input ids, positions, slots, pending source
        # row (-1: the host's id) as int64 [4, n]; then int32 sequence lengths [n], then the
        # block table rows [n, max_blocks]
        self._bytes64 = 8 * 4 * n
        self.buffer = torch.zeros(
            self._bytes64 + 4 * n * (1 + max_blocks), dtype=torch.uint8, device=device
        )
        self.ids64, self.ids32 = self._views(self.buffer)
        self.ids64[3].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping, self.pending_src = self.ids64.unbind(0)
        self.seq_lens = self.ids32[:n]
        self.block_tables = self.ids32[n:].view(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.prev_token_ids = prev_token_ids
        # two pinned host copies of the buffer, used in turn: a step's staging never
        # overwrites one whose copy the device has not done yet (its event)
        pin = device.type == "cuda"
        self._host = [
            torch.zeros(self.buffer.shape, dtype=torch.uint8, pin_memory=pin) for _ in range(2)
        ]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # bucket -> (graph, its logits [bs, vocab], its greedy ids [bs] or None); the short ones
        # serve batches whose contexts are all within model.ops.short_context_keys(bucket)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.short_graphs: dict[int, tuple] = {}
        # the greedy pick inside the graph (see the module docstring), through the argmax
        # kernel: W2 3.866 vs 3.911 / 3.913 ms/token, same run (runs/2026-12-03m-gemv_ab.log);
        # with the two-stage torch argmax it gained nothing (4.039 vs 4.042,
        # runs/2026-12-03k-w2_greedy_ab.log). A sampled batch pays the kernel's few us
        self.greedy_in_graph = True
        # that pick through the one-launch argmax kernel (as the sampler's `argmax_kernel`)
        self.argmax_kernel = True
        # each row's input token picked inside the embedding kernel (one launch), not by torch
        # ops before it (five launches, ~10 us at batch 1)
        self.fused_pick = True

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 [4, n] and int32 views of an input buffer."""
        ids64 = buffer[: self._bytes64].view(torch.int64).view(4, self.max_bs)
        return ids64, buffer[self._bytes64 :].view(torch.int32)

    def can_run(self, inputs) -> bool:
        return inputs.max_query_len == 1 and inputs.num_reqs <= self.max_bs

    def _forward(self, bs: int, max_seq_len: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=max_seq_len,  # an upper bound: kernels read true lengths
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )
        ctx = ForwardContext(meta, self.kv_caches, self.positions[:bs])
        src = self.pending_src[:bs]
        if self.fused_pick:
            hidden = self.model(self.input_ids[:bs], ctx, (src, self.prev_token_ids))
        else:
            input_ids = torch.where(
                src >= 0, self.prev_token_ids[src.clamp(min=0)], self.input_ids[:bs]
            )
            hidden = self.model(input_ids, ctx)
        return self.model.compute_logits(hidden)  # [bs, vocab_size]

    def _step(
        self, bs: int, max_seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph runs: the logits, and (greedy_in_graph) each row's argmax, also written
        to prev_token_ids for the next step (a sampler that picks otherwise overwrites it).
        max_seq_len: the bound on the rows' contexts the graph serves (default: the model's)."""
        logits = self._forward(bs, max_seq_len or self.max_seq_len)
        if not self.greedy_in_graph:
            return logits, None
        # [bs], a view of prev_token_ids (the kernel writes it there: no copy node)
        token_ids = greedy_pick(logits, self.argmax_kernel, out=self.prev_token_ids[:bs])
        return logits, token_ids

    def bucket(self, num_reqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_reqs)]

    def stage(self, inputs, bs: int) -> None:
        """Write a decode step's inputs, padded to `bs` rows, into the graphs' buffer: one
        copy from pinned memory, queued on the stream without waiting."""
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # two steps back: long done
        host64, host32 = self._views(self._host[turn])
        ids, n, n_max = host64.numpy(), inputs.num_reqs, self.max_bs
        ids[0, :n], ids[1, :n], ids[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        ids[0:2, n:bs] = 0
        ids[2, n:bs] = -1  # padding rows write no KV
        ids[3, :bs] = -1
        ids[3, inputs.pending_rows] = inputs.pending_src
        lens = host32.numpy()
        lens[:n] = inputs.seq_lens
        lens[n:bs] = 1  # padding rows: one valid slot to read
        tables = lens[n_max : n_max + bs * self.max_blocks].reshape(bs, self.max_blocks)
        width = inputs.block_tables.shape[1]
        tables[:n, :width] = inputs.block_tables  # columns past width: never read
        tables[n:bs, 0] = 0
        end = self._bytes64 + 4 * (n_max + bs * self.max_blocks)  # block rows past bs: unread
        self.buffer[:end].copy_(self._host[turn][:end], non_blocking=True)
        if self.buffer.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all sharing one memory pool (replays never overlap)."""
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        self.pending_src.fill_(-1)
        pool = None
        for bs in reversed(self.batch_sizes):
            short = self.short_keys(bs)
            for graphs, max_seq_len in ((self.graphs, None), (self.short_graphs, short)):
                if max_seq_len == 0:
                    continue
                self._step(bs, max_seq_len)  # warm-up: compiles kernels, settles the allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, token_ids = self._step(bs, max_seq_len)
                pool = graph.pool()
                graphs[bs] = (graph, logits, token_ids)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for batch sizes %s (and for short contexts: %s)",
            self.batch_sizes, sorted(self.short_graphs),
        )  # fmt: skip

    def short_keys(self, bs: int) -> int:
        """The context length up to which bucket bs has a short-context graph (0: none): the
        ops' (short_context_keys), at most the model's length, which sizes the block tables."""
        return min(self.model.ops.short_context_keys(bs), self.max_seq_len)

    def pick(self, inputs, bs: int) -> tuple[torch.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        """The bucket's graph for these inputs: its short-context one when every row fits."""
        short = bs in self.short_graphs
        if short and int(inputs.seq_lens.max()) <= self.short_keys(bs):
            return self.short_graphs[bs]
        return self.graphs[bs]

    def run(self, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [bucket, vocab] and the greedy ids [bucket] (or None); the first
        inputs.num_reqs rows are real."""
        bs = self.bucket(inputs.num_reqs)
        self.stage(inputs, bs)
        graph, logits, token_ids = self.pick(inputs, bs)
        graph.replay()
        return logits, token_ids
