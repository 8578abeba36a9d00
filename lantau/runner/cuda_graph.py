"""CUDA graphs for decode-only steps: one graph per bucket batch size, replayed with padding.

A decode step launches hundreds of small kernels; replaying them as one graph removes the
per-launch CPU cost, which dominates at small batch. Graphs read their inputs from persistent
buffers that each step overwrites; padding rows write no KV (slot -1) and are discarded.

A step's inputs reach the device in one copy of one buffer, staged in pinned host memory,
padding rows included: int64 input ids, positions, slots, and for each row whose input token
the previous step sampled on the device, that token's row in the previous step's ids buffer
(the runner's `token_ids`), else -1; then int32 sequence lengths and block tables. The graph's
first kernel picks each row's input token from those ids or the host's as it embeds it. The
graph ends with the greedy pick of each row (the argmax kernel), written into its own ids
buffer: for an all-greedy batch the sampler takes it; a sampled batch pays the kernel's few us.

Turns. Everything a graph reads or writes between steps comes in two copies, one per turn:
the input buffer, and the runner's ids buffers (turn t's graphs write `token_ids[t]` and read
the pending tokens from `token_ids[1 - t]`); each sampling step writes the buffer the step
before did not. So with `copy_streams` the copies leave the device's critical path: the next
step's inputs go to the other turn's buffer on a copy stream while the current graph runs,
and the sampled ids go to the host on the sampler's own stream while the next graph runs.
Between two replays the stream then holds only event records and waits.

A small bucket can have a second graph for batches whose contexts are all short
(`ops.short_context_keys`): its attention is captured with another tiling, and each step
replays the one its longest context allows. A model no longer than that has one graph a
bucket, which takes the short tiling itself.
"""

from __future__ import annotations

import bisect
import logging

import torch

from lantau.config import EngineConfig
from lantau.kv_cache.manager import cdiv
from lantau.model.forward_context import AttentionMetadata, ForwardContext
from lantau.model.llama import LlamaForCausalLM
from lantau.model.lora import LoRABatch
from lantau.runner.step_inputs import StepInputs
from lantau.sampling.sampler import greedy_pick

logger = logging.getLogger(__name__)


# larger decode batches run eagerly. NOTE: not 512: on an H200, random:llama3-8b in fp8 at
# max_num_seqs 768 ran its eager decode steps host-bound (W3-fp8-128 15,241 tok/s at 61.7 % GPU
# use against 20,904 at 384 rows in graphs; benchmarks/RESULTS.md)
MAX_GRAPH_BS = 1024


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def graph_logits_bytes(config: EngineConfig, model: LlamaForCausalLM) -> int:
    """The decode graphs' logits buffers (GraphInputs.logits, one a turn)."""
    rows = min(config.scheduler.max_num_seqs, MAX_GRAPH_BS)
    return 2 * rows * model.lm_head.weight.shape[0] * model.lm_head.weight.element_size()


class GraphInputs:
    """One turn's input buffer (one copy a step): input ids, positions, slots, pending source
    row (-1: the host's id) and, with LoRA adapters, each row's adapter slot (-1: none) as
    int64 [4 or 5, n]; then int32 sequence lengths [n], then the block table rows [n,
    max_blocks]; views of each, and the turn's graphs."""

    def __init__(
        self, n: int, max_blocks: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
        lora: bool = False,
    ) -> None:  # fmt: skip
        self.rows64 = 5 if lora else 4
        self.bytes64 = 8 * self.rows64 * n
        self.buffer = torch.zeros(
            self.bytes64 + 4 * n * (1 + max_blocks), dtype=torch.uint8, device=device
        )
        ids64, ids32 = self.views(self.buffer)
        ids64[3:].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping, self.pending_src = ids64[:4].unbind(0)
        self.lora_index = ids64[4] if lora else None
        self.seq_lens = ids32[:n]
        self.block_tables = ids32[n:].view(n, max_blocks)
        # the logits of every graph of the turn, each its first rows: a turn's replays never
        # overlap, and a bucket's own logits would hold sum(buckets) rows (at 768 sequences
        # and llama3's vocab, 8.9 GiB a turn, none counted when the KV cache was sized)
        self.logits = torch.empty(n, vocab_size, dtype=dtype, device=device)
        # bucket -> (graph, its logits [bs, vocab] (the first rows of `logits`), its greedy ids
        # [bs]); the short ones serve batches whose contexts are all within
        # model.ops.short_context_keys(bucket)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.short_graphs: dict[int, tuple] = {}
        # with adapters, the same for steps with adapter rows (the plain ones, the base
        # model's steps, add no delta: an adapter server's base traffic runs as without one)
        self.lora_graphs: dict[int, tuple] = {}
        self.lora_short_graphs: dict[int, tuple] = {}
        # the last replay that read the buffer (a copy into it waits for it)
        self.released: torch.cuda.Event | None = None

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 [4, n] and int32 views of a buffer laid out as this one (or this one)."""
        ids64 = buffer[: self.bytes64].view(torch.int64).view(self.rows64, -1)
        return ids64, buffer[self.bytes64 :].view(torch.int32)


class CudaGraphRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        token_ids: list[torch.Tensor],
    ) -> None:
        """token_ids: the runner's two [max_num_seqs] int64 buffers of sampled ids, one a
        turn (see the module docstring)."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = config.scheduler.max_model_len
        self.batch_sizes = graph_batch_sizes(min(config.scheduler.max_num_seqs, MAX_GRAPH_BS))
        self.max_bs = self.batch_sizes[-1]
        self.max_blocks = cdiv(self.max_seq_len, config.cache.block_size)
        n = self.max_bs
        assert len(token_ids) == 2, "one ids buffer a turn"
        self.token_ids = token_ids
        vocab_size, dtype = model.lm_head.weight.shape[0], model.lm_head.weight.dtype
        lora = getattr(model, "adapter_slots", None) is not None  # rows' adapter slots too
        self.turns = [
            GraphInputs(n, self.max_blocks, vocab_size, dtype, device, lora) for _ in token_ids
        ]
        # turn 0's views and graphs under their plain names (what the benchmarks time)
        first = self.turns[0]
        self.buffer, self.graphs, self.short_graphs = first.buffer, first.graphs, first.short_graphs
        self.input_ids, self.positions, self.slot_mapping = (
            first.input_ids, first.positions, first.slot_mapping,
        )  # fmt: skip
        self.seq_lens, self.block_tables = first.seq_lens, first.block_tables
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # a pinned host copy of each turn's buffer, restaged only once the device has copied
        # it (its event)
        pin = device.type == "cuda"
        self._host = [
            torch.zeros(self.buffer.shape, dtype=torch.uint8, pin_memory=pin) for _ in self.turns
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self.turns)
        # the stream that copies a step's inputs in, overlapping the graph before (None: the
        # current stream, behind that graph); see the module docstring
        self.copy_stream: torch.cuda.Stream | None = None

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.max_query_len == 1 and inputs.num_reqs <= self.max_bs

    def _forward(self, bs: int, max_seq_len: int, turn: int, lora: bool = False) -> torch.Tensor:
        inp = self.turns[turn]
        meta = AttentionMetadata(
            slot_mapping=inp.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=inp.seq_lens[:bs],
            block_tables=inp.block_tables[:bs],
            max_query_len=1,
            max_seq_len=max_seq_len,  # an upper bound: kernels read true lengths
        )
        ctx = ForwardContext(meta, self.kv_caches, inp.positions[:bs])
        if lora:  # the adapter-rows pass: each row's delta by its slot (-1: none)
            ctx.lora = LoRABatch(inp.lora_index[:bs])
        pick = (inp.pending_src[:bs], self.token_ids[1 - turn])  # input tokens picked on device
        return self.model.decode_logits(inp.input_ids[:bs], ctx, pick, out=inp.logits)

    @torch.inference_mode()  # as capture() and the runner's launch(); also for the tests
    def _step(
        self, bs: int, max_seq_len: int | None = None, turn: int = 0, lora: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What turn `turn`'s graph runs: the logits, and each row's argmax, also written to
        token_ids[turn] for the next step (a sampler that picks otherwise overwrites it).
        max_seq_len: the bound on the rows' contexts the graph serves (default: the model's);
        lora: the pass of steps with adapter rows."""
        logits = self._forward(bs, max_seq_len or self.max_seq_len, turn, lora)
        # [bs], a view of token_ids[turn] (the kernel writes it there: no copy node)
        use_pdl = self.model.ops.config.enable_pdl
        token_ids = greedy_pick(logits, out=self.token_ids[turn][:bs], use_pdl=use_pdl)
        return logits, token_ids

    def bucket(self, num_reqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_reqs)]

    def stage(self, inputs: StepInputs, bs: int, turn: int = 0) -> None:
        """Write a decode step's inputs, padded to `bs` rows, into turn `turn`'s buffer: one
        copy from pinned memory, queued without waiting (on copy_stream if set, after the
        turn's last replay; the current stream waits for it)."""
        inp = self.turns[turn]
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the turn's last step: long done
        host64, host32 = inp.views(self._host[turn])
        ids, n, n_max = host64.numpy(), inputs.num_reqs, self.max_bs
        ids[0, :n], ids[1, :n], ids[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        ids[0:2, n:bs] = 0
        ids[2, n:bs] = -1  # padding rows write no KV
        ids[3, :bs] = -1
        ids[3, inputs.pending_rows] = inputs.pending_src
        if inp.lora_index is not None:
            ids[4, :n], ids[4, n:bs] = inputs.lora_index, -1
        lens = host32.numpy()
        lens[:n] = inputs.seq_lens
        lens[n:bs] = 1  # padding rows: one valid slot to read
        tables = lens[n_max : n_max + bs * self.max_blocks].reshape(bs, self.max_blocks)
        width = inputs.block_tables.shape[1]
        tables[:n, :width] = inputs.block_tables  # columns past width: never read
        tables[n:bs, 0] = 0
        end = inp.bytes64 + 4 * (n_max + bs * self.max_blocks)  # block rows past bs: unread
        if inp.buffer.device.type != "cuda":
            inp.buffer[:end].copy_(self._host[turn][:end])
            return
        copied = self._copied[turn] = torch.cuda.Event()
        if self.copy_stream is None:
            inp.buffer[:end].copy_(self._host[turn][:end], non_blocking=True)
            copied.record()
            return
        if inp.released is not None:
            self.copy_stream.wait_event(inp.released)
        with torch.cuda.stream(self.copy_stream):
            inp.buffer[:end].copy_(self._host[turn][:end], non_blocking=True)
            copied.record()
        torch.cuda.current_stream().wait_event(copied)

    @torch.inference_mode()
    def capture(self):
        """Each turn's, largest first, all sharing one memory pool (replays never overlap);
        returns the pool. Only turn 0's captures run their shape eagerly first (compiling its
        kernels, settling the allocator): turn 1's shapes are the same, only buffers differ.
        With adapters, each graph twice: for the base model's steps, and with the deltas."""
        pool = None
        for turn, inp in enumerate(self.turns):
            inp.seq_lens.fill_(1)
            inp.slot_mapping.fill_(-1)
            inp.pending_src.fill_(-1)
            variants = [(inp.graphs, inp.short_graphs, False)]
            if inp.lora_index is not None:
                inp.lora_index.fill_(-1)
                variants.append((inp.lora_graphs, inp.lora_short_graphs, True))
            for bs in reversed(self.batch_sizes):
                short = self.short_keys(bs)
                for long_graphs, short_graphs, lora in variants:
                    for graphs, max_seq_len in ((long_graphs, None), (short_graphs, short)):
                        if max_seq_len == 0:
                            continue
                        if turn == 0:  # warm-up: compiles kernels, settles the allocator
                            self._step(bs, max_seq_len, turn, lora)
                            torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        # thread_local: the weights may be loading on other threads
                        # (load_in_background)
                        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                            logits, token_ids = self._step(bs, max_seq_len, turn, lora)
                        pool = graph.pool()
                        graphs[bs] = (graph, logits, token_ids)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for batch sizes %s (and for short contexts: %s)",
            self.batch_sizes, sorted(self.short_graphs),
        )  # fmt: skip
        return pool

    def short_keys(self, bs: int) -> int:
        """The context length up to which bucket bs has a short-context graph (0: none): the
        ops' (short_context_keys), if below the model's length. At or above it, the bucket's
        one graph, bounded by the model's length, takes the short config itself."""
        keys = self.model.ops.short_context_keys(bs)
        return keys if keys < self.max_seq_len else 0

    def pick(
        self, inputs: StepInputs, bs: int, turn: int = 0
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """The turn's graph of the bucket for these inputs: its short-context one when every
        row fits; the adapter-rows pass when a row has an adapter."""
        inp = self.turns[turn]
        lora = inputs.has_adapter_rows
        short_graphs = inp.lora_short_graphs if lora else inp.short_graphs
        if bs in short_graphs and int(inputs.seq_lens.max()) <= self.short_keys(bs):
            return short_graphs[bs]
        return (inp.lora_graphs if lora else inp.graphs)[bs]

    def run(self, inputs: StepInputs, turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [bucket, vocab] and the greedy ids [bucket]; the first
        inputs.num_reqs rows are real. turn: the runner's ids buffer this step writes."""
        bs = self.bucket(inputs.num_reqs)
        self.stage(inputs, bs, turn)
        graph, logits, token_ids = self.pick(inputs, bs, turn)
        graph.replay()
        inp = self.turns[turn]
        inp.released = torch.cuda.Event()
        inp.released.record()
        return logits, token_ids
