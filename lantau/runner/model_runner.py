"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

The only place (with model/ and sampling/) where tensors live. It keeps its own copy of each
running request's tokens and block table, updated from the scheduler's diffs. Decode-only steps
replay a CUDA graph captured for the next bucket size up (cuda_graph.py).

A step is three calls, so the engine can overlap the host with the device:
    launch(out)    queue the forward pass (no wait); a request's input token that the previous
                   step sampled and the host has not seen yet is read from the device
    sample(step)   queue the sampling, with the rows' histories as of now
    collect(step)  wait for this step's token ids alone and append them
`execute(out)` does all three.

Sampled ids stay on the device in two buffers (`token_ids`), which sampling steps write in
turn: a step reads its pending tokens from the buffer the step before wrote, and the copy of
a step's ids to the host (on the sampler's copy stream) may still be reading its buffer while
the next step runs. collect(N) waits for that copy before launch(N + 2), the next writer of
the buffer, is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lantau.config import EngineConfig
from lantau.kernels import require_triton
from lantau.kv_cache.manager import cdiv
from lantau.model.forward_context import AttentionMetadata, ForwardContext, KeptRows
from lantau.model.llama import LlamaForCausalLM
from lantau.model.lora import LoRABatch
from lantau.request import Logprob, SamplingParams
from lantau.runner.memory import MemoryBaseline, kv_cache_budget
from lantau.runner.step_inputs import StepInputs
from lantau.sampling.sampler import (
    PendingSample,
    Sampler,
    SamplingRow,
    compute_logprobs,
    to_device,
    uses_penalties,
)
from lantau.scheduler.output import RunnerOutput, SchedulerOutput
from lantau.structured import Grammars


@dataclass
class CachedRequestState:
    token_ids: list[int]  # prompt + output tokens
    num_prompt_tokens: int
    params: SamplingParams
    row: int  # its row of ModelRunner.block_table
    num_blocks: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # its prompt's logprobs so far (None for the first token), while it collects them: from
    # its first scheduling to its first sample
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_slot: int = -1  # its LoRA adapter's slot (-1: the base model)


class BlockTable:
    """Block ids of every request the runner holds, one numpy row each, kept across steps so
    a step gathers its table with one fancy index instead of converting lists per request."""

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.ids = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self.free_rows:  # more requests than rows: grow
            n = len(self.ids)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self.free_rows.pop()
        self.ids[row, : len(block_ids)] = block_ids
        return row

    def release(self, row: int) -> None:
        self.free_rows.append(row)


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampling rows and their logits."""

    sample_ids: list[str] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [num_sample, vocab_size]
    sampled: PendingSample | None = None  # once sample() has queued it
    # [num_sample] each row's argmax, picked (and written to the step's ids buffer) inside the
    # CUDA graph; None after an eager forward
    greedy_ids: torch.Tensor | None = None
    serial: int = -1  # its launch's number, which tensor-parallel workers know it by


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's ("auto") or e4m3 ("fp8", one byte: twice a
    bf16 cache's tokens in the same memory). NOTE: the fp8 cache's scales are per tensor and
    fixed at 1.0 (the kernels' default k_scale / v_scale), vLLM's default without calibrated
    scales. e4m3's error is relative (3 mantissa bits) from 2^-6 to 448, so a scale only
    moves which values fall below 2^-6 or past 448: on SmolLM2 (keys up to ~16, values up to
    ~11) per-layer amax / 448 scales left each layer's K and V error at 2.5-2.7 % against
    2.4-2.9 % at 1.0 (docs/fp8-kv.md), not worth a calibration pass, or scales fixed by a
    first prefill that a later request's larger keys would clip against."""
    return torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else model_dtype


def kv_cache_bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one block of every layer's keys and values in a cache of `dtype` (on one
    rank: its heads)."""
    m = config.model_config
    elem = torch.empty((), dtype=dtype).element_size()
    kv_size = m.kv_size // config.tensor_parallel_size  # a rank's heads
    return 2 * m.num_hidden_layers * config.cache.block_size * kv_size * elem


# Headroom kept free on the card beyond the profiled peak: CUDA graphs, allocator slack.
CUDA_HEADROOM_BYTES = 1 << 30


def profile_inputs(config: EngineConfig):
    """A worst-case step for profiling: a full token budget of prefill as max_model_len prompts
    (the last one shorter), each on its own blocks from 0 up, and logits for max_num_seqs rows.
    Returns (StepInputs, the number of KV blocks it covers)."""
    sched, block_size = config.scheduler, config.cache.block_size
    num_tokens = sched.max_num_batched_tokens
    longest = min(num_tokens, sched.max_model_len)
    lens = [longest] * (num_tokens // longest) + [num_tokens % longest] * bool(num_tokens % longest)
    blocks = [cdiv(n, block_size) for n in lens]
    first = np.cumsum([0, *blocks])[:-1]
    block_tables = np.zeros((len(lens), max(blocks)), dtype=np.int32)
    for i, (start, n) in enumerate(zip(first, blocks, strict=True)):
        block_tables[i, :n] = np.arange(start, start + n)
    inputs = StepInputs(
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lens]),
        slot_mapping=np.concatenate(
            [
                b * block_size + np.arange(n, dtype=np.int64)
                for b, n in zip(first, lens, strict=True)
            ]
        ),
        query_start_loc=np.cumsum([0, *lens]).astype(np.int32),
        seq_lens=np.array(lens, dtype=np.int32),
        block_tables=block_tables,
        sample_ids=[],
        logits_indices=np.full(min(sched.max_num_seqs, num_tokens), num_tokens - 1),
    )
    return inputs, sum(blocks)


def _row_order(out: SchedulerOutput) -> list[tuple[str, int]]:
    """A step's requests in row order, (request id, tokens computed before this step): the
    running ones first, as the scheduler ordered them (oldest first, so their decodes lead
    the step and a prompt continuing from the last step comes after them; TritonOps.attention
    attends leading decodes apart), then the new ones."""
    scheduled = [(r.request_id, r.num_computed_tokens) for r in out.scheduled_cached_reqs]
    return scheduled + [(r.request_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        device: torch.device,
        tokenizer_json: Callable[[], str] | None = None,
    ) -> None:
        """`tokenizer_json`: the model's tokenizer.json (as text) for structured outputs'
        grammars, asked for at the first constrained request; None: no structured outputs."""
        if device.type == "cuda":  # the sampler's greedy pick is a Triton kernel there
            require_triton("running on CUDA")
        self.config = config
        self.model = model
        self.adapter_slots = getattr(model, "adapter_slots", None)  # None: no LoRA here
        self.device = device
        self.block_size = config.cache.block_size
        cache_dtype = kv_cache_dtype(config, model.lm_head.weight.dtype)
        self.kv_caches = allocate_kv_caches(config, num_blocks, cache_dtype, device)
        self.states: dict[str, CachedRequestState] = {}
        max_blocks = cdiv(config.scheduler.max_model_len, self.block_size)
        self.block_table = BlockTable(config.scheduler.max_num_seqs, max_blocks)
        # per-request generators outlive preemption, so a seeded request resumes its stream
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(config.seed, device, use_pdl=config.kernels.enable_pdl)
        # the last sampling step's rows and raw logits, kept by reference for parity checks
        self._last_sampled: tuple[list[str], torch.Tensor | None] = ([], None)
        # the last queued sampling: request id -> row, and the token ids on the device: two
        # persistent buffers written in turn (see the module docstring), which the next step's
        # inputs, CUDA graphs included, read; `_last` is the one the last sampling step wrote
        self._prev_rows: dict[str, int] = {}
        self.token_ids = [
            torch.zeros(config.scheduler.max_num_seqs, dtype=torch.int64, device=device)
            for _ in range(2)
        ]
        self._last = 1
        self.collecting_prompt_logprobs: set[str] = set()  # CachedRequestState.prompt_logprobs
        # structured outputs' matchers, a constrained request each (lantau/structured.py)
        m = config.model_config
        self.grammars = (
            Grammars(tokenizer_json, m.vocab_size, list(m.eos_token_ids))
            if tokenizer_json is not None
            else None
        )
        self.graphs = None  # CudaGraphRunner (decode-only steps), once captured
        self.mixed_graphs = None  # MixedGraphRunner (steps with prompt tokens), once captured
        # the copies between steps on their own streams, off the device's critical path: the
        # graphs' inputs in, the sampled ids out (cuda_graph.py's docstring)
        self.use_copy_streams(device.type == "cuda")

    @classmethod
    @torch.inference_mode()
    def num_kv_blocks(
        cls, config: EngineConfig, model: LlamaForCausalLM, baseline: MemoryBaseline | None = None
    ) -> int:
        """KV blocks that fit the engine's share of the card (memory.py; `baseline`: the card
        when the engine started) once the weights and the peak of a worst-case step
        (profile_inputs) with its sampling are counted; that step runs on a throwaway runner
        whose own KV cache is not counted."""
        cache_dtype = kv_cache_dtype(config, model.lm_head.weight.dtype)
        per_block = kv_cache_bytes_per_block(config, cache_dtype)
        device = torch.device(config.device)
        if device.type != "cuda":
            return max(config.cache.cpu_kv_cache_bytes // per_block, 0)
        inputs, num_blocks = profile_inputs(config)
        runner = cls(config, model, num_blocks, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        logits = runner._forward_logits(inputs)
        rows = [SamplingRow(SamplingParams(top_p=0.9, top_k=50), None, [], [])] * len(logits)
        runner.sampler(logits, rows)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - num_blocks * per_block
        del runner, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        if baseline is None:  # none taken: all the card holds counts against the share
            baseline = MemoryBaseline(0, 0, 0)
        budget = kv_cache_budget(
            baseline,
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(device),
            allocated=torch.cuda.memory_allocated(device),
            peak=peak,
            utilization=config.cache.gpu_memory_utilization,
        )
        if not config.enforce_eager:  # the CUDA graphs' logits, captured after the cache
            from lantau.runner.cuda_graph import graph_logits_bytes

            budget -= graph_logits_bytes(config, model)
        return max((budget - CUDA_HEADROOM_BYTES) // per_block, 0)

    @property
    def last_logits(self) -> dict[str, torch.Tensor]:
        """Request id -> raw logits of the last step that sampled (built only when asked)."""
        sample_ids, logits = self._last_sampled
        return {} if logits is None else dict(zip(sample_ids, logits, strict=True))

    def capture_cuda_graphs(self) -> None:
        from lantau.runner.cuda_graph import CudaGraphRunner
        from lantau.runner.mixed_graph import MixedGraphRunner

        self.graphs = CudaGraphRunner(
            self.config, self.model, self.kv_caches, self.device, self.token_ids
        )
        self.use_copy_streams(self.copy_streams)
        pool = self.graphs.capture()
        self.mixed_graphs = MixedGraphRunner(self.config, self.model, self.kv_caches, self.device)
        self.mixed_graphs.capture(pool)

    def use_copy_streams(self, on: bool) -> None:
        """Copy a graph step's inputs in, and every step's sampled ids out, on side streams
        (on), or on the current stream, between the steps' kernels."""
        self.copy_streams = on
        cuda = on and self.device.type == "cuda"
        self.sampler.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        if self.graphs is not None:
            self.graphs.copy_stream = torch.cuda.Stream(self.device) if cuda else None

    def _drop(self, request_id: str) -> None:
        self.collecting_prompt_logprobs.discard(request_id)
        if self.grammars is not None:
            self.grammars.drop(request_id)
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_table.release(state.row)

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids:
            self._drop(request_id)
            self.generators.pop(request_id, None)
        for request_id in out.preempted_req_ids:
            self._drop(request_id)
        for new in out.scheduled_new_reqs:
            self._drop(new.request_id)  # a resumed request's old state, if any
            self.states[new.request_id] = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                self.block_table.add(new.block_ids), len(new.block_ids), new.eos_token_ids,
            )  # fmt: skip
            if new.sampling_params.lora is not None:  # its adapter stays loaded while it runs
                self.states[new.request_id].lora_slot = self.lora_slots[new.sampling_params.lora]
            if new.sampling_params.prompt_logprobs is not None and (
                len(new.token_ids) == new.num_prompt_tokens and new.num_computed_tokens == 0
            ):  # NOTE: resumed after its first sample, it sent them already
                self.states[new.request_id].prompt_logprobs = [None]
                self.collecting_prompt_logprobs.add(new.request_id)
            if new.sampling_params.structured_outputs is not None:
                self.grammars.add(  # past the outputs a resumed request has
                    new.request_id,
                    new.sampling_params.structured_outputs,
                    new.token_ids[new.num_prompt_tokens :],
                    new.sampling_params.grammar_after,
                )
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self.generators:
                self.generators[new.request_id] = torch.Generator(self.device).manual_seed(seed)
        ids = self.block_table.ids
        for cached in out.scheduled_cached_reqs:
            if cached.new_block_ids:
                state = self.states[cached.request_id]
                end = state.num_blocks + len(cached.new_block_ids)
                ids[state.row, state.num_blocks : end] = cached.new_block_ids
                state.num_blocks = end

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        scheduled = _row_order(out)
        num_reqs = len(scheduled)
        num_scheduled = out.num_scheduled_tokens
        token_ids: list[int] = []
        rows = np.empty(num_reqs, dtype=np.int64)  # block-table row of each request
        starts = np.empty(num_reqs, dtype=np.int64)
        counts = np.empty(num_reqs, dtype=np.int64)
        max_blocks = 1
        sample_ids, logits_indices = [], []
        pending_rows, pending_src = [], []
        for i, (request_id, start) in enumerate(scheduled):
            state = self.states[request_id]
            n = num_scheduled[request_id]
            end = start + n
            known = len(state.token_ids)
            if end > known:  # its last token was sampled by the step still in flight
                assert end == known + 1 and request_id in self._prev_rows, request_id
                token_ids.extend(state.token_ids[start:known])
                pending_rows.append(len(token_ids))
                pending_src.append(self._prev_rows[request_id])
                token_ids.append(0)  # overwritten on the device
            else:
                token_ids.extend(state.token_ids[start:end])
            rows[i], starts[i], counts[i] = state.row, start, n
            max_blocks = max(max_blocks, state.num_blocks)
            if end >= known:  # the last token, known or not: its logits pick the next
                sample_ids.append(request_id)
                logits_indices.append(len(token_ids) - 1)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = (starts + counts).astype(np.int32)
        # position of each token: its request's start + its offset within the request
        req_of_token = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(len(token_ids), dtype=np.int64) + np.repeat(
            starts - query_start_loc[:-1], counts
        )
        block_tables = self.block_table.ids[rows, :max_blocks]
        # slot of each token: its block (looked up per request row) * block_size + offset
        block_ids = block_tables[req_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        return StepInputs(
            np.asarray(token_ids, dtype=np.int64), positions, slot_mapping, query_start_loc,
            seq_lens, block_tables, sample_ids, np.asarray(logits_indices, dtype=np.int64),
            np.asarray(pending_rows, dtype=np.int64), np.asarray(pending_src, dtype=np.int64),
            None if self.adapter_slots is None else self._lora_index(scheduled, counts),
        )  # fmt: skip

    @property
    def lora_slots(self) -> dict[str, int]:
        """LoRA adapter name -> its slot, as loaded now."""
        return {} if self.adapter_slots is None else self.adapter_slots.names

    def load_adapter(self, name: str, path: str) -> None:
        from lantau.model.lora import read_adapter

        self.adapter_slots.load(read_adapter(name, path, self.model.config))

    def unload_adapter(self, name: str) -> None:
        self.adapter_slots.unload(name)

    def _lora_index(self, scheduled, counts: np.ndarray) -> np.ndarray:
        """StepInputs.lora_index: each token's adapter slot (-1: the base model)."""
        slots = np.fromiter((self.states[request_id].lora_slot for request_id, _ in scheduled),
                            dtype=np.int64, count=len(scheduled))  # fmt: skip
        return np.repeat(slots, counts)

    def fill_pending(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Write the tokens the previous step sampled into this step's device input ids."""
        if not len(inputs.pending_rows):
            return
        rows = to_device(inputs.pending_rows, self.device)
        src = to_device(inputs.pending_src, self.device)
        input_ids.index_copy_(0, rows, self.token_ids[self._last][src])

    def _to_device(self, inputs: StepInputs) -> tuple[torch.Tensor, ForwardContext]:
        def tensor(a: np.ndarray) -> torch.Tensor:
            return to_device(a, self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(inputs.slot_mapping),
            query_start_loc=tensor(inputs.query_start_loc),
            seq_lens=tensor(inputs.seq_lens),
            block_tables=tensor(inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=int(inputs.seq_lens.max()),
            num_decodes=inputs.num_leading_decodes,
        )
        ctx = ForwardContext(meta, self.kv_caches, tensor(inputs.positions))
        if inputs.has_adapter_rows:  # else the base model's step: no deltas
            ctx.lora = LoRABatch(tensor(inputs.lora_index))
        input_ids = tensor(inputs.input_ids)
        self.fill_pending(input_ids, inputs)
        return input_ids, ctx

    def _forward_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits of the sampling rows, eagerly: [num_sample, vocab_size]; None for a step of
        prefill chunks only (its KV is written; no row needs logits). A step with prompt rows
        computes its last layer past the keys and values for the sampling rows only."""
        if inputs.max_query_len == 1 or inputs.has_adapter_rows:
            return self._sample_logits(self._forward(inputs), inputs)
        hidden = self._forward(inputs, keep=True)
        return self.model.compute_logits(hidden) if len(hidden) else None

    def _forward(self, inputs: StepInputs, keep: bool = False) -> torch.Tensor:
        """The model's body, eagerly: [num_tokens, hidden_size] (`keep`: of the sampling
        rows only, ForwardContext.keep)."""
        input_ids, ctx = self._to_device(inputs)
        if keep:
            ctx.keep = self._kept_rows(inputs, ctx.attn)
        return self.model(input_ids, ctx)

    def _kept_rows(self, inputs: StepInputs, meta: AttentionMetadata) -> KeptRows:
        """The sampling rows (each its request's last row) and their requests as a decode
        batch over the step's metadata."""
        rows = inputs.logits_indices
        reqs = np.searchsorted(inputs.query_start_loc, rows, side="right") - 1
        longest = int(inputs.seq_lens[reqs].max()) if len(rows) else 0
        return KeptRows.of(
            meta, to_device(rows, self.device), to_device(reqs, self.device), longest
        )

    def _sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows of `hidden` (the model's body's output) that sample."""
        if not len(inputs.logits_indices):
            return None
        indices = to_device(inputs.logits_indices, self.device)
        return self.model.compute_logits(hidden[indices])

    def _mixed_graph_forward(self, inputs: StepInputs) -> torch.Tensor:
        """_forward, the model's body replayed as the step's bucket's graph (its rows past
        the step's tokens are padding)."""
        graphs = self.mixed_graphs
        num_tokens = graphs.bucket(len(inputs.input_ids))
        graphs.stage(inputs, num_tokens)
        self.fill_pending(graphs.input_ids[:num_tokens], inputs)
        graph, hidden = graphs.pick(inputs, num_tokens)
        graph.replay()
        return hidden

    def _mixed_graph_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """_forward_logits through the step's bucket's graph."""
        return self._sample_logits(self._mixed_graph_forward(inputs), inputs)

    def _prompt_logprob_rows(
        self, out: SchedulerOutput, inputs: StepInputs
    ) -> list[tuple[str, int, list[int]]]:
        """The requests collecting their prompt's logprobs with prompt positions in this
        step whose next token is a prompt token: (request id, the first such position's row
        in the step, those next tokens)."""
        scheduled = _row_order(out)
        found = []
        for i, (request_id, start) in enumerate(scheduled):
            state = self.states[request_id]
            if state.prompt_logprobs is None:
                continue
            # position p's logits give the logprob of token p + 1
            end = min(start + out.num_scheduled_tokens[request_id], state.num_prompt_tokens - 1)
            if end > start:
                found.append(
                    (
                        request_id,
                        int(inputs.query_start_loc[i]),
                        state.token_ids[start + 1 : end + 1],
                    )
                )
        return found

    def _collect_prompt_logprobs(
        self, hidden: torch.Tensor, found: list[tuple[str, int, list[int]]], chunk: int = 512
    ) -> None:
        """Each found request's prompt logprobs at this step's positions, appended to its
        state (the logits of `chunk` rows at a time; waits for the device)."""
        rows, targets, wanted = [], [], []
        for request_id, first_row, next_tokens in found:
            rows += range(first_row, first_row + len(next_tokens))
            targets += next_tokens
            k = self.states[request_id].params.prompt_logprobs
            wanted += [SamplingRow(SamplingParams(logprobs=k), None, [], [])] * len(next_tokens)
        dicts: list[dict[int, Logprob] | None] = []
        for s in range(0, len(rows), chunk):
            logits = self.model.compute_logits(hidden[to_device(rows[s : s + chunk], self.device)])
            tokens = to_device(targets[s : s + chunk], self.device)
            dicts += compute_logprobs(logits, wanted[s : s + chunk], tokens)
        at = 0
        for request_id, _, next_tokens in found:
            self.states[request_id].prompt_logprobs.extend(dicts[at : at + len(next_tokens)])
            at += len(next_tokens)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One whole step: launch, sample, collect."""
        step = self.launch(out)
        self.sample(step)
        return self.collect(step)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue the step's forward pass; returns without waiting for the device."""
        self._update_states(out)
        if out.is_empty:
            return LaunchedStep()
        inputs = self._prepare_inputs(out)
        num_sample, greedy_ids = len(inputs.sample_ids), None
        found = self._prompt_logprob_rows(out, inputs) if self.collecting_prompt_logprobs else []
        if not found and self.graphs is not None and self.graphs.can_run(inputs):
            # the turn: the ids buffer this step writes, the one the last sampling step did not
            logits, greedy_ids = self.graphs.run(inputs, 1 - self._last)
            logits, greedy_ids = logits[:num_sample], greedy_ids[:num_sample]
        elif found:  # a rare step: its prompt positions' logprobs too, for which the host waits
            if self.mixed_graphs is not None and self.mixed_graphs.can_run(inputs):
                hidden = self._mixed_graph_forward(inputs)
            else:
                hidden = self._forward(inputs)
            logits = self._sample_logits(hidden, inputs)
            self._collect_prompt_logprobs(hidden, found)
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(inputs):
            logits = self._mixed_graph_logits(inputs)
        else:
            logits = self._forward_logits(inputs)
        if not inputs.sample_ids:
            return LaunchedStep()
        return LaunchedStep(inputs.sample_ids, logits, greedy_ids=greedy_ids)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> None:
        """Queue the step's sampling. Call it after collecting the previous step, so that
        penalties see every earlier token."""
        if not step.sample_ids:
            return
        self._last_sampled = (step.sample_ids, step.logits)
        rows = []
        for request_id in step.sample_ids:
            state = self.states[request_id]
            # NOTE: token history only feeds penalties; copying it per row per step would
            # cost O(context) host time for every request
            history = uses_penalties(state.params)
            n = state.num_prompt_tokens
            rows.append(
                SamplingRow(
                    params=state.params,
                    generator=self.generators.get(request_id),
                    prompt_token_ids=state.token_ids[:n] if history else [],
                    output_token_ids=state.token_ids[n:] if history else [],
                    banned=self._banned(state) if state.params.min_tokens else (),
                )
            )
        if self.grammars is not None and self.grammars.matchers:
            constrained = [i for i, r in enumerate(step.sample_ids) if self.grammars.constrains(r)]
            if constrained:  # each one's tokens allowed next, after every earlier token
                masks = self.grammars.masks([step.sample_ids[i] for i in constrained])
                for row, i in enumerate(constrained):
                    rows[i].allowed = masks[row]
        step.sampled = self.sampler.sample(step.logits, rows, greedy_ids=step.greedy_ids)
        self._prev_rows = {request_id: i for i, request_id in enumerate(step.sample_ids)}
        # the buffer launch() gave the step (no sampling step comes between the two calls)
        self._last = 1 - self._last
        if step.sampled.token_ids is not step.greedy_ids:  # else the graph wrote them there
            self.token_ids[self._last][: len(rows)].copy_(step.sampled.token_ids)

    @staticmethod
    def _banned(state: CachedRequestState) -> tuple[int, ...]:
        """What its next token may not be: EOS and its stop tokens while it has fewer than
        min_tokens outputs (every earlier step is collected: its tokens are all here)."""
        params = state.params
        if len(state.token_ids) - state.num_prompt_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else state.eos_token_ids
        return (*eos, *params.stop_token_ids)

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for the step's token ids and append them to the requests' histories."""
        result = RunnerOutput()
        if step.sampled is None:
            return result
        sampled = step.sampled.resolve()
        # NOTE: once a request a step: the grammars only asked while one is held
        grammars = self.grammars if self.grammars is not None and self.grammars.matchers else None
        for request_id, token_id, logprobs in zip(
            step.sample_ids, sampled.token_ids, sampled.logprobs, strict=True
        ):
            # NOTE: a request preempted since the launch has no state here, but the
            # scheduler still takes its token; a finished one's is dropped there
            state = self.states.get(request_id)
            if state is not None:
                state.token_ids.append(token_id)
                if grammars is not None:
                    grammars.consume(request_id, token_id)
                if state.prompt_logprobs is not None:  # its first sample: with them, once
                    result.prompt_logprobs[request_id] = state.prompt_logprobs
                    state.prompt_logprobs = None
                    self.collecting_prompt_logprobs.discard(request_id)
            result.sampled_token_ids[request_id] = token_id
            if logprobs is not None:
                result.logprobs[request_id] = logprobs
        return result


def allocate_kv_caches(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One allocation for the whole cache (this rank's heads), viewed per layer."""
    m = config.model_config
    num_kv_heads = m.num_key_value_heads // config.tensor_parallel_size  # a rank's
    shape = (m.num_hidden_layers, 2, num_blocks, config.cache.block_size, num_kv_heads)
    # NOTE: zeros, not empty: padded attention reads masked slots, and 0 * NaN is NaN.
    cache = torch.zeros((*shape, m.head_dim), dtype=dtype, device=device)
    return list(cache.unbind(0))
