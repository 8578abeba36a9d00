"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

The only place (with model/ and sampling/) where tensors live. It keeps its own copy of each
running request's tokens and block table, updated from the scheduler's diffs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from lantau.config import EngineConfig
from lantau.model.llama import LlamaForCausalLM
from lantau.request import SamplingParams
from lantau.runner.attention import AttentionMetadata, ForwardContext
from lantau.sampling.sampler import Sampler, SamplingRow
from lantau.scheduler.output import RunnerOutput, SchedulerOutput


@dataclass
class CachedRequestState:
    token_ids: list[int]  # prompt + output tokens
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]


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
        dtype = model.lm_head.weight.dtype
        m = config.model_config
        # NOTE: zeros, not empty: padded attention reads masked slots, and 0 * NaN is NaN.
        self.kv_caches = [
            torch.zeros(
                2,
                num_blocks,
                self.block_size,
                m.num_key_value_heads,
                m.head_dim,
                dtype=dtype,
                device=device,
            )  # fmt: skip
            for _ in range(m.num_hidden_layers)
        ]
        self.states: dict[str, CachedRequestState] = {}
        # per-request generators outlive preemption, so a seeded request resumes its stream
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(seed=config.seed, device=device)
        self.last_logits: dict[str, torch.Tensor] = {}  # request id -> raw logits, last step

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

    def _scheduled(self, out: SchedulerOutput) -> list[tuple[str, int]]:
        """(request id, tokens already computed) in batch order."""
        return [(r.request_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] + [
            (r.request_id, r.num_computed_tokens) for r in out.scheduled_cached_reqs
        ]

    def _prepare_inputs(self, out: SchedulerOutput):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, tables = [0], [], []
        sample_ids, logits_indices = [], []
        bs = self.block_size
        for request_id, start in self._scheduled(out):
            state = self.states[request_id]
            end = start + out.num_scheduled_tokens[request_id]
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(state.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables.append(state.block_ids)
            if end == len(state.token_ids):  # the last known token: its logits pick the next
                sample_ids.append(request_id)
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(data, dtype=torch.int64):
            return torch.tensor(data, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded, torch.int32),
            max_query_len=max(b - a for a, b in itertools.pairwise(query_start_loc)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return tensor(input_ids), tensor(positions), meta, sample_ids, tensor(logits_indices)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._update_states(out)
        if out.is_empty:
            return RunnerOutput()
        input_ids, positions, meta, sample_ids, logits_indices = self._prepare_inputs(out)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches))
        if not sample_ids:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[logits_indices])  # [num_sample, vocab]
        self.last_logits = dict(zip(sample_ids, logits, strict=True))  # for parity checks
        rows = []
        for request_id in sample_ids:
            state = self.states[request_id]
            rows.append(
                SamplingRow(
                    params=state.params,
                    generator=self.generators.get(request_id),
                    prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
                    output_token_ids=state.token_ids[state.num_prompt_tokens :],
                )
            )
        sampled = self.sampler(logits, rows)
        result = RunnerOutput()
        for request_id, token_id, logprobs in zip(
            sample_ids, sampled.token_ids, sampled.logprobs, strict=True
        ):
            self.states[request_id].token_ids.append(token_id)
            result.sampled_token_ids[request_id] = token_id
            if logprobs is not None:
                result.logprobs[request_id] = logprobs
        return result
