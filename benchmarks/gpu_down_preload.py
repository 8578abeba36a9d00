"""W2's down_proj (4096 x 14336) as a preloading GEMV on the lent GPU.

down_proj is the one batch-1 projection that does not preload (ops.preload_max_k 4096): its
K-loop programs (32 x 1024 tiles, 255 registers: one program an SM) start loading only after
gate_up's last program ends. Preloading, each program loads its rows whole before the PDL wait
(2 rows over 8 warps: 56 registers of weights a thread), so down_proj streams in behind
gate_up's tail, as the other projections do.

1. The preloading GEMV alone at the down shape against gemv_ref (bf16 tolerance), per tiling.
2. The engine's batch-1 decode graph at 384 keys, recaptured per arm: min of 3 x 50 replays.
3. W2, the fastest arm against the default, alternated twice; greedy tokens against the
   default's first 32 (a tiling changes the sums' order).

Run zj (runs/2026-12-03zj-w2_chain.log, this script's arms inside gpu_w2_chain.py at 60a7243):
every preload lost, the graph taking 4.049 (2 rows x 8 warps), 4.321 (4 x 8), 4.327 (2 x 4)
and 3.821 ms (1 x 4) against the K loop's 3.794 / 3.794. The same run tried the residual add +
norm after the o and/or down projection done by the GEMV launch's last program (an atomic
count; gemv `add_norm`, reverted since): 3.818 (down), 3.892 (o), 3.915 (both) against 3.794,
the product and the sum equal to the unfused ops'.

    PYTHONPATH=. python3 benchmarks/gpu_down_preload.py
"""

from __future__ import annotations

import torch
from w2_arms import finish, graph_arm, row, start, w2_arms

from lantau.kernels.gemv import gemv, gemv_ref

SHAPE = (4096, 14336)
# (label, preload_max_k, preload tiling (BLOCK_N, -, warps, stages) or None: preload_config's)
ARMS = [
    ("K-loop (default)", 4096, None),
    ("preload 2 rows x 8 warps", 16384, None),
    ("preload 4 rows x 8 warps", 16384, (4, 0, 8, 1)),
    ("preload 2 rows x 4 warps", 16384, (2, 0, 4, 1)),
    ("preload 1 row x 4 warps", 16384, (1, 0, 4, 1)),
    ("preload 4 rows x 16 warps", 16384, (4, 0, 16, 1)),
    ("K-loop again", 4096, None),
]


def main() -> None:
    llm, w2, res, table = start()
    torch.manual_seed(0)
    x = torch.randn(1, SHAPE[1], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) / SHAPE[1] ** 0.5
    ref = gemv_ref(x, w)
    for label, _, config in ARMS[1:-1]:
        y = gemv(x, w, None, config, preload=True)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        row(table, f"| down GEMV alone, {label} | rel err {err:.2e} vs gemv_ref | |")
        assert err < 1e-2, err
    core = llm.engine.core
    ops = core.runner.model.ops

    def set_arm(arm) -> None:
        _, ops.preload_max_k, config = arm
        ops.preload_configs.pop(SHAPE, None)
        if config:
            ops.preload_configs[SHAPE] = config
        core.runner.capture_cuda_graphs()

    reference, timed = None, []
    for arm in ARMS:
        set_arm(arm)
        tokens, ms = graph_arm(llm, w2, f"down {arm[0]}", reference, res, table)
        reference = reference or tokens
        timed.append((ms, arm))
    best = min(timed, key=lambda t: t[0])[1]
    w2_arms(llm, w2, [ARMS[0], best] * 2, set_arm, res, table)
    finish("gpu_down_preload", res, table)


if __name__ == "__main__":
    main()
