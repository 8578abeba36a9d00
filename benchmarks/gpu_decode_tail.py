"""The batch-1 decode graph's tail on the lent GPU: the last residual add fused with the final
norm (LlamaForCausalLM.decode_logits; before, a torch add launched without PDL, then the norm),
and the greedy argmax launched with PDL.

1. The engine's batch-1 decode graph at 384 keys, recaptured per arm: min of 3 x 50 replays;
   each arm's first 32 greedy tokens of W2's first prompt against the first arm's.
2. W2, the old tail against the new, alternated twice.

Run zi (runs/2026-12-03zi-l2_prefetch.log) also had arms in which the latency-bound kernels
asked L2 for the next projection's weight before their PDL wait (cp.async.bulk.prefetch.L2,
inline PTX): decode attention for the o projection's first 8 / 16 / 24 / 32 MB took the graph
from 3.796 ms to 3.857 / 3.868 / 3.867 / 3.884 (3.862 with the prefetch after the first KV
tile), and each residual add + norm for 4 MB of the next weight to 4.33 (8 MB: 4.97); tokens
were equal. The one-program norm kernel grew by ~8 us a launch for 4 MB, as if a program did
not retire before its bulk prefetches were served (one SM's rate, ~0.5 TB/s). So that patch
was not kept.

    PYTHONPATH=. python3 benchmarks/gpu_decode_tail.py
"""

from __future__ import annotations

from w2_arms import finish, graph_arm, start, w2_arms

from lantau.kernels import argmax

# (label, the new tail: fused final norm and PDL argmax)
ARMS = [("old tail", False), ("new tail", True)] * 2


def main() -> None:
    llm, w2, res, table = start()
    core = llm.engine.core

    def set_arm(arm) -> None:
        core.runner.model.fuse_final_norm = argmax.use_pdl = arm[1]
        core.runner.capture_cuda_graphs()

    reference = None
    for arm in ARMS:
        set_arm(arm)
        tokens, _ = graph_arm(llm, w2, arm[0], reference, res, table)
        reference = reference or tokens
    w2_arms(llm, w2, ARMS, set_arm, res, table)
    finish("gpu_decode_tail", res, table)


if __name__ == "__main__":
    main()
