"""The engine's warm-up before it serves: synthetic requests through the real step loop, so that
every kernel specialization a serving step may need (Triton compiles one per constexpr and per
integer argument that is 1 or a multiple of 16) is compiled before the first user waits on it.

    wave 1  prompts of many lengths (1 .. max_model_len) at once: chunked prefills, big mixed
            steps, decode batches shrinking as the prompts finish
    wave 2  the same lengths arriving one step apart among running decodes: mixed steps of
            every small size, then decode-only batches of every size as they finish
    wave 3  the sampler's other paths: temperature, top-k/p, min-p, penalties, seeds, logprobs

The served core runs it before it is ready, an offline LLM before it returns (a fresh machine's
first W3-fp8-2048 run otherwise waited 1.1 s in one step on a compile; RESULTS.md 2026-12-07).

With LoRA adapters served, every other warm-up request runs through the first one:
the adapter kernels' variants of eager steps (no CUDA graph captured them) compile here too.

Nothing of it stays: its requests finish, the prefix cache is emptied, the counters zeroed. So
the served core runs it while an engine folder's weights still load (EngineCore's
`defer_weights`): it reads zeros or loaded values, and its tokens are thrown away.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from lantau.request import Request, SamplingParams

if TYPE_CHECKING:
    from lantau.engine.core import EngineCore

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 255, 467, 1000, 2047, 4095, 8191)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
SAMPLED = (
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.1, ignore_eos=True),
    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5, ignore_eos=True),
    SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: 5.0}, min_tokens=2),
)


def compiles_kernels(core: EngineCore) -> bool:
    """Whether the engine's first steps of a shape would wait on Triton compiling a kernel
    variant: on CUDA (on CPU the kernels run interpreted or as torch ops). The served core and
    an offline LLM then warm up before their first request."""
    return core.device.type == "cuda"


def warm_up(core: EngineCore, seed: int = 0) -> float:
    """Run the waves above to completion; returns the seconds they took."""
    start = time.perf_counter()
    config = core.config
    rng = np.random.default_rng(seed)
    longest = config.scheduler.max_model_len - GREEDY.max_tokens - 1
    lengths = [n for n in PROMPT_LENGTHS if n <= longest]

    adapter = next(iter(core.runner.lora_slots), None)

    def request(i: int, length: int, params: SamplingParams) -> Request:
        ids = rng.integers(0, config.model_config.vocab_size, length).tolist()
        if adapter is not None and i % 2:
            params = dataclasses.replace(params, lora=adapter)
        return Request(f"warmup-{i}", ids, params, config.model_config.eos_token_ids)

    for i, n in enumerate(lengths):  # wave 1
        core.add_request(request(i, n, GREEDY))
    _run(core)
    longer = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    for i, n in enumerate(lengths):  # wave 2
        core.add_request(request(i, n, longer))
        core.step()
    _run(core)
    for i, params in enumerate(SAMPLED):  # wave 3
        params = dataclasses.replace(params, max_tokens=4, detokenize=False)
        core.add_request(request(i, max(min(16 + i, longest), 1), params))
    _run(core)
    core.reset_prefix_cache()
    core.num_generated_tokens = 0
    sched = core.scheduler
    sched.num_preemptions = sched.num_prefix_queried_tokens = sched.num_prefix_hit_tokens = 0
    sched.newly_scheduled.clear()  # the metrics' first-scheduling times: none of these
    took = time.perf_counter() - start
    logger.info("warm-up: %d prompt lengths, %.1f s", len(lengths), took)
    return took


def _run(core: EngineCore) -> None:
    while core.has_unfinished_requests:
        core.step()
