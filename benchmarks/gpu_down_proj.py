"""W2's down_proj GEMV (4096 x 14336, the one batch-1 projection that does not preload) on the
lent GPU: its tiling.

ptxas (sm_90, benchmarks/ptxas_registers.py's way) gives the tiling that was the default until
run zn, 32 rows x 1024 columns over 8 warps at 4 stages, 255 registers and 636 bytes of
spill stores a thread; 32 x 512 takes 213 and 16 x 1024 198, neither spilling.

1. The GEMV alone at llama3-8b's down shape: each arm's output against gemv_ref (bf16
   tolerance).
2. The engine's batch-1 decode graph at 384 keys, recaptured per arm: min of 3 x 50 replays.
   Each arm's first 32 greedy tokens against the default's (a tiling changes the sums' order).
3. W2, the fastest arm against the default, alternated twice.

Run zf (runs/2026-12-03zf-down_proj.log) also had arms with each row's first 1, 2 or 4 2 KB
chunks prefetched into L2 (cp.async.bulk.prefetch, inline PTX) before the PDL wait: the graph
took 3.844, 3.996 and 4.315 ms against 3.749, so that patch was not kept; the tilings below
gave 3.810 (32 x 512) and 3.885 (16 x 1024), so the default stayed. Run zn
(benchmarks/gpu_w2_knobs.py) found 4 x 1024 over 2 warps faster (1,024 programs over every
SM); it is the default now, and ARMS below keep 32 x 1024 over 8 warps as the old one.

    PYTHONPATH=. python3 benchmarks/gpu_down_proj.py
"""

from __future__ import annotations

import torch
from w2_arms import finish, graph_arm, row, start, w2_arms

from lantau.bench.offline import measure_ceilings
from lantau.kernels.gemv import default_config, gemv, gemv_ref

SHAPE = (4096, 14336)
DEFAULT = default_config(*SHAPE)
# tilings (BLOCK_N, BLOCK_K, warps, stages); the default again last, for drift
ARMS = [DEFAULT, (32, 1024, 8, 4), (32, 512, 8, 4), (16, 1024, 8, 4), DEFAULT]


def label(config) -> str:
    bn, bk, warps, stages = config
    return f"{bn} x {bk}, {warps} warps, {stages} stages"


def kernel_check(res: dict, table: list[str]) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, SHAPE[1], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) / SHAPE[1] ** 0.5
    ref = gemv_ref(x, w)
    for config in ARMS[:-1]:
        y = gemv(x, w, None, config)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        res.setdefault("kernel", []).append({"arm": label(config), "rel_err": err})
        row(table, f"| down GEMV alone, {label(config)} | rel err {err:.2e} vs gemv_ref | |")
        assert err < 1e-2, err


def main() -> None:
    llm, w2, res, table = start()
    res["ceilings"] = measure_ceilings(torch.device("cuda"))
    kernel_check(res, table)
    core = llm.engine.core
    ops = core.runner.model.ops

    def set_arm(arm) -> None:
        ops.gemv_configs[SHAPE] = arm[1]
        core.runner.capture_cuda_graphs()

    reference, timed = None, []
    for config in ARMS:
        arm = (f"down {label(config)}", config)
        set_arm(arm)
        tokens, ms = graph_arm(llm, w2, arm[0], reference, res, table)
        reference = reference or tokens
        timed.append((ms, arm))
    best = min(timed, key=lambda t: t[0])[1]
    w2_arms(llm, w2, [timed[0][1], best] * 2, set_arm, res, table)
    finish("gpu_down_proj", res, table)


if __name__ == "__main__":
    main()
