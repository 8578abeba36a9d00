"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

The only place (with model/ and sampling/) where tensors live. It keeps its own copy of each
running request's tokens and block table, updated from the scheduler's diffs. Decode-only steps
replay a CUDA graph captured for the next bucket size up (cuda_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lantau.config import EngineConfig
from lantau.model.llama import LlamaForCausalLM
from lantau.request import SamplingParams
from lantau.runner.attention import AttentionMetadata, ForwardContext
from lantau.sampling.sampler import Sampler, SamplingRow, uses_penalties
from lantau.scheduler.output import RunnerOutput, SchedulerOutput


@dataclass
class CachedRequestState:
    token_ids: list[int]  # prompt + output tokens
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]


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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())


def kv_cache_bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    m = config.model_config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * m.num_hidden_layers * config.cache.block_size * m.kv_size * elem


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: LlamaForCausalLM, num_blocks: int, device: torch.device
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.kv_caches = allocate_kv_caches(config, num_blocks, model.lm_head.weight.dtype, device)
        self.states: dict[str, CachedRequestState] = {}
        # per-request generators outlive preemption, so a seeded request resumes its stream
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(seed=config.seed, device=device)
        # the last sampling step's rows and raw logits, kept by reference for parity checks
        self._last_sampled: tuple[list[str], torch.Tensor | None] = ([], None)
        self.graphs = None  # CudaGraphRunner, once captured

    @property
    def last_logits(self) -> dict[str, torch.Tensor]:
        """Request id -> raw logits of the last step that sampled (built only when asked)."""
        sample_ids, logits = self._last_sampled
        return {} if logits is None else dict(zip(sample_ids, logits, strict=True))

    def capture_cuda_graphs(self) -> None:
        from lantau.runner.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.config, self.model, self.kv_caches, self.device)
        self.graphs.capture()

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids:
            self.states.pop(request_id, None)
            self.generators.pop(request_id, None)
        for request_id in out.preempted_req_ids:
            self.states.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            self.states[new.request_id] = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.block_ids
            )
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self.generators:
                self.generators[new.request_id] = torch.Generator(self.device).manual_seed(seed)
        for cached in out.scheduled_cached_reqs:
            self.states[cached.request_id].block_ids.extend(cached.new_block_ids)

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        scheduled = [(r.request_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        scheduled += [(r.request_id, r.num_computed_tokens) for r in out.scheduled_cached_reqs]
        num_tokens = out.total_num_scheduled_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
        seq_lens = np.empty(len(scheduled), dtype=np.int32)
        max_blocks = max(len(self.states[r].block_ids) for r, _ in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        sample_ids, logits_indices = [], []
        row = 0
        for i, (request_id, start) in enumerate(scheduled):
            state = self.states[request_id]
            n = out.num_scheduled_tokens[request_id]
            end = start + n
            input_ids[row : row + n] = state.token_ids[start:end]
            positions[row : row + n] = np.arange(start, end)
            block_tables[i, : len(state.block_ids)] = state.block_ids
            row += n
            query_start_loc[i + 1] = row
            seq_lens[i] = end
            if end == len(state.token_ids):  # the last known token: its logits pick the next
                sample_ids.append(request_id)
                logits_indices.append(row - 1)
        # slot of each token: its block (looked up per request row) * block_size + offset
        req_of_token = np.repeat(np.arange(len(scheduled)), np.diff(query_start_loc))
        block_ids = block_tables[req_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        return StepInputs(
            input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
            sample_ids, np.asarray(logits_indices, dtype=np.int64),
        )  # fmt: skip

    def _to_device(self, inputs: StepInputs) -> tuple[torch.Tensor, ForwardContext]:
        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(inputs.slot_mapping),
            query_start_loc=tensor(inputs.query_start_loc),
            seq_lens=tensor(inputs.seq_lens),
            block_tables=tensor(inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc_cpu=inputs.query_start_loc.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
        )
        ctx = ForwardContext(meta, self.kv_caches, tensor(inputs.positions))
        return tensor(inputs.input_ids), ctx

    def _forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the sampling rows: [num_sample, vocab_size]."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)[: len(inputs.sample_ids)]
        input_ids, ctx = self._to_device(inputs)
        hidden = self.model(input_ids, ctx)
        indices = torch.from_numpy(inputs.logits_indices).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[indices])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._update_states(out)
        if out.is_empty:
            return RunnerOutput()
        inputs = self._prepare_inputs(out)
        logits = self._forward_logits(inputs)
        if not inputs.sample_ids:
            return RunnerOutput()
        self._last_sampled = (inputs.sample_ids, logits)
        rows = []
        for request_id in inputs.sample_ids:
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
                )
            )
        sampled = self.sampler(logits, rows)
        result = RunnerOutput()
        for request_id, token_id, logprobs in zip(
            inputs.sample_ids, sampled.token_ids, sampled.logprobs, strict=True
        ):
            self.states[request_id].token_ids.append(token_id)
            result.sampled_token_ids[request_id] = token_id
            if logprobs is not None:
                result.logprobs[request_id] = logprobs
        return result


def allocate_kv_caches(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One allocation for the whole cache, viewed per layer."""
    m = config.model_config
    shape = (m.num_hidden_layers, 2, num_blocks, config.cache.block_size, m.num_key_value_heads)
    # NOTE: zeros, not empty: padded attention reads masked slots, and 0 * NaN is NaN.
    cache = torch.zeros((*shape, m.head_dim), dtype=dtype, device=device)
    return list(cache.unbind(0))
