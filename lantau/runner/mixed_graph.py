"""CUDA graphs for steps that carry prompt tokens (a prefill chunk beside running decodes, or
prefills alone) of up to `max_tokens` tokens: one graph per token bucket, replayed with padding.

Queued eagerly, such a step costs the host longer than the device takes to run it, so an
arriving prompt stalls every running decode by the host's time, not the device's. Larger steps
are compute-bound and run eagerly. The graph runs the model's body (embedding to the last
layer); the rows that sample go through the final norm and lm_head eagerly after it, so no
padding row costs a vocabulary projection.

A bucket of T tokens serves up to R = min(T, max_num_seqs) requests: the step's tokens are
padded to T (input id 0, position 0, slot -1: no KV write) and its requests to R with empty
requests (no query rows, no keys: attention's tiles for them exit at once, and rows past the
last real request are never written). The inputs reach the device in one copy of one buffer
staged in pinned memory; tokens the previous step sampled on the device are written into the
input ids after it (ModelRunner.fill_pending), in stream order before the replay.
"""

from __future__ import annotations

import bisect
import logging

import torch
from torch import Tensor

from lantau.config import EngineConfig
from lantau.kv_cache.manager import cdiv
from lantau.model.forward_context import AttentionMetadata, ForwardContext
from lantau.model.llama import LlamaForCausalLM
from lantau.model.lora import LoRABatch
from lantau.runner.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# steps of more tokens run eagerly; a step pads to the next multiple of BUCKET_STEP (a coarser
# grid made a 278-token step cost a 512-token one)
MAX_TOKENS, BUCKET_STEP = 1024, 64


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    cap = min(MAX_TOKENS, max_num_batched_tokens)
    return list(range(BUCKET_STEP, cap, BUCKET_STEP)) + [cap]


class MixedGraphRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        sched = config.scheduler
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = sched.max_model_len
        self.buckets = token_buckets(sched.max_num_batched_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_reqs = min(self.max_tokens, sched.max_num_seqs)
        self.max_blocks = cdiv(sched.max_model_len, config.cache.block_size)
        # int64 input ids, positions, slots and, with LoRA adapters, each token's adapter slot
        # [3 or 4, max_tokens]; then int32 query_start_loc [max_reqs + 1], seq_lens
        # [max_reqs], block tables [max_reqs, max_blocks]
        self.lora = getattr(model, "adapter_slots", None) is not None
        self.rows64 = 4 if self.lora else 3
        self.bytes64 = 8 * self.rows64 * self.max_tokens
        size = self.bytes64 + 4 * (2 * self.max_reqs + 1 + self.max_reqs * self.max_blocks)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        (
            self.input_ids, self.positions, self.slot_mapping, self.lora_index,
            self.query_start_loc, self.seq_lens, self.block_tables,
        ) = self._views(self.buffer)  # fmt: skip
        # two pinned host copies, used in turn: one is restaged only once its copy is done
        pin = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # each host copy's numpy views, made once: staging writes through them every step
        self._host_views = [
            tuple(None if v is None else v.numpy() for v in self._views(h)) for h in self._host
        ]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # with adapters, the same for steps with adapter rows (self.graphs: the base model's)
        self.lora_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids64 = buffer[: self.bytes64].view(torch.int64).view(self.rows64, -1)
        ids32 = buffer[self.bytes64 :].view(torch.int32)
        r = self.max_reqs
        tables = ids32[2 * r + 1 :].view(r, self.max_blocks)
        lora = ids64[3] if self.lora else None
        return (*ids64[:3].unbind(0), lora, ids32[: r + 1], ids32[r + 1 : 2 * r + 1], tables)

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.max_query_len > 1 and len(inputs.input_ids) <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def padded_tokens(self, num_tokens: int) -> int:
        """The tokens a step of num_tokens with prompt tokens computes: its bucket's, or its
        own when it runs eagerly."""
        return self.bucket(num_tokens) if num_tokens <= self.max_tokens else num_tokens

    def pick(self, inputs: StepInputs, num_tokens: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The bucket's graph for a step: the adapter-rows pass when a row has an adapter."""
        return (self.lora_graphs if inputs.has_adapter_rows else self.graphs)[num_tokens]

    def forward(self, num_tokens: int, lora: bool = False) -> torch.Tensor:
        """What bucket num_tokens's graph runs: the model's body on the staged buffers,
        [num_tokens, hidden_size]; lora: the pass of steps with adapter rows."""
        r = min(num_tokens, self.max_reqs)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: r + 1],
            seq_lens=self.seq_lens[:r],
            block_tables=self.block_tables[:r],
            max_query_len=num_tokens,  # upper bounds: they only choose the tiles
            max_seq_len=self.max_seq_len,
        )
        ctx = ForwardContext(meta, self.kv_caches, self.positions[:num_tokens])
        if lora:  # each token's delta by its slot (-1: none)
            ctx.lora = LoRABatch(self.lora_index[:num_tokens])
        return self.model(self.input_ids[:num_tokens], ctx)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Every bucket's graph, largest first, in `pool` (the decode graphs': replays never
        overlap), with adapters twice (the base model's steps, and with the deltas); returns
        the pool."""
        # inputs that make each capture's warm-up a no-op on the cache: no keys, no KV writes
        self.slot_mapping.fill_(-1)
        if self.lora:
            self.lora_index.fill_(-1)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        variants = [(self.graphs, False)] + ([(self.lora_graphs, True)] if self.lora else [])
        for t in reversed(self.buckets):
            for graphs, lora in variants:
                self.forward(t, lora)  # warm-up: compiles kernels, settles the allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the weights may be loading on other threads (load_in_background)
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden = self.forward(t, lora)
                pool = graph.pool()
                graphs[t] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for steps with prompts of up to %s tokens", self.buckets)
        return pool

    def stage(self, inputs: StepInputs, num_tokens: int) -> None:
        """Write a step's inputs, padded to bucket num_tokens, into the buffer: one copy from
        pinned memory, queued on the current stream (so after the last replay that read it)."""
        host = self._host[self._turn]
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # two steps ago: long done
        ids, pos, slots, lora, qsl, lens, tables = self._host_views[self._turn]
        n, k, r = len(inputs.input_ids), inputs.num_reqs, min(num_tokens, self.max_reqs)
        ids[:n], pos[:n], slots[:n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        if lora is not None:
            lora[:n], lora[n:num_tokens] = inputs.lora_index, -1
        ids[n:num_tokens] = pos[n:num_tokens] = 0
        slots[n:num_tokens] = -1  # padding tokens write no KV
        qsl[: k + 1] = inputs.query_start_loc
        qsl[k + 1 : r + 1] = n  # padding requests: no query rows
        lens[:k] = inputs.seq_lens
        lens[k:r] = 0  # ... and no keys
        tables[:k, : inputs.block_tables.shape[1]] = inputs.block_tables  # the rest: unread
        end = self.bytes64 + 4 * (2 * self.max_reqs + 1 + k * self.max_blocks)
        if self.buffer.device.type != "cuda":
            self.buffer[:end].copy_(host[:end])
            return
        self.buffer[:end].copy_(host[:end], non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        self._turn ^= 1
