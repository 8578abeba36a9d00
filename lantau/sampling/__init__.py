"""Batched token sampling on torch: penalties, logit bias, greedy, temperature, filters,
logprobs."""

from __future__ import annotations

from lantau.sampling.sampler import (
    Logprob,
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_penalties,
    compute_logprobs,
    process_logits,
)

__all__ = [
    "Logprob",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "apply_penalties",
    "compute_logprobs",
    "process_logits",
]
