"""The standard workloads of shared/WORKLOADS.md as lists of token-id prompts (no torch)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids, one list per request
    max_tokens: int  # fixed output length (EOS ignored)
    peer_batch: int = 16  # HF generate runs static batches of this size

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # NOTE: skip the first 256 ids, where tokenizers keep their special tokens
    return [rng.randrange(256, vocab) for _ in range(n)]


def make_workload(
    spec: str, vocab_size: int, num_prompts: int | None = None, seed: int = 0
) -> Workload:
    """W1 | W2 | W5 | W3-1000 | W3-128 | W3-2048 | in:N/out:M; num_prompts overrides the count,
    seed picks the random ids."""
    rng = random.Random(seed)
    if spec == "W1":  # the online workload: 500 requests, 467 in / 256 out
        prompts = [_random_ids(rng, 467, vocab_size) for _ in range(num_prompts or 500)]
        return Workload("W1", prompts, 256)
    if spec == "W2":
        n = num_prompts or 1
        prompts = [_random_ids(rng, 128, vocab_size) for _ in range(n)]
        return Workload("W2", prompts, 512, peer_batch=1)
    if spec == "W5":
        system = _random_ids(rng, 512, vocab_size)  # the shared system prompt
        n = num_prompts or 256
        return Workload("W5", [system + _random_ids(rng, 512, vocab_size) for _ in range(n)], 128)
    w3 = {"W3-1000": (1000, 1000, 3000), "W3-128": (128, 128, 30000), "W3-2048": (2048, 128, 3000)}
    if spec in w3:
        num_in, num_out, default_n = w3[spec]
        n = num_prompts or default_n
        return Workload(spec, [_random_ids(rng, num_in, vocab_size) for _ in range(n)], num_out)
    m = re.fullmatch(r"in:(\d+)/out:(\d+)", spec)
    if m:
        num_in, num_out = int(m[1]), int(m[2])
        n = num_prompts or 1
        return Workload(spec, [_random_ids(rng, num_in, vocab_size) for _ in range(n)], num_out)
    raise ValueError(
        f"workload: {spec!r} is not W1, W2, W5, W3-1000, W3-128, W3-2048 or in:N/out:M"
    )
