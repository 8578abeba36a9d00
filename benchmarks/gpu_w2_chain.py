"""W2's chain of batch-1 launches on the lent GPU: down_proj preloading, and the residual add +
norm done by the GEMV launch before it.

- down_proj (4096 x 14336) is the one batch-1 projection that does not preload
  (ops.preload_max_k 4096): its K-loop programs (32 x 1024 tiles, 255 registers: one program
  an SM) start loading only after gate_up's last program ends. Preloading, each program loads
  its rows whole before the PDL wait (2 rows over 8 warps: 56 registers of weights a thread).
- ops.fuse_add_norm: the add + norm after the o and/or down projection done by the GEMV
  launch's last program (gemv's add_norm), one launch and one kernel boundary fewer each.

1. The preloading GEMV alone at the down shape against gemv_ref (bf16 tolerance), and the
   add_norm tail at the o shape against the product then fused_add_rms_norm.
2. The engine's batch-1 decode graph at 384 keys, recaptured per arm: min of 3 x 50 replays;
   each arm's first 32 greedy tokens of W2's first prompt against the default's.
3. W2, the fastest arm against the default, alternated twice.

    PYTHONPATH=. python3 benchmarks/gpu_w2_chain.py
"""

from __future__ import annotations

import json
import os

import torch

from lantau import LLM
from lantau.bench.offline import batch1_graph, greedy_agreement, replay_ms, run_lantau
from lantau.bench.workloads import make_workload
from lantau.kernels.gemv import gemv, gemv_ref
from lantau.kernels.rms_norm import fused_add_rms_norm

OUT = os.environ.get("OUT", ".")
DOWN = (4096, 14336)
DEFAULTS = {"preload_max_k": 4096, "preload_configs": {}, "fuse_add_norm": frozenset()}


def down_preload(config=None) -> dict:
    return {"preload_max_k": 16384, "preload_configs": {DOWN: config} if config else {}}


ARMS = [
    ("default", {}),
    ("down preload 2 rows x 8 warps", down_preload()),
    ("down preload 4 rows x 8 warps", down_preload((4, 0, 8, 1))),
    ("down preload 2 rows x 4 warps", down_preload((2, 0, 4, 1))),
    ("down preload 1 row x 4 warps", down_preload((1, 0, 4, 1))),
    ("add_norm down", {"fuse_add_norm": frozenset({"down"})}),
    ("add_norm o", {"fuse_add_norm": frozenset({"o"})}),
    ("add_norm o + down", {"fuse_add_norm": frozenset({"o", "down"})}),
    ("default again", {}),
]


def kernel_checks(table: list[str]) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, DOWN[1], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*DOWN, device="cuda", dtype=torch.bfloat16) / DOWN[1] ** 0.5
    ref = gemv_ref(x, w)
    for label, settings in ARMS[1:5]:
        y = gemv(x, w, None, settings["preload_configs"].get(DOWN), preload=True)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        table.append(f"| down GEMV alone, {label} | rel err {err:.2e} vs gemv_ref | |")
        print(table[-1], flush=True)
        assert err < 1e-2, err
    x, w = x[:, :4096].contiguous(), w[:, :4096].contiguous() * 2
    residual, weight = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), x[0].abs()
    for preload in (False, True):
        ref, ref_res = gemv(x, w, preload=preload), residual.clone()
        fused_add_rms_norm(ref, ref_res, weight, 1e-5)
        res = residual.clone()
        out = gemv(x, w, preload=preload, add_norm=(res, weight, 1e-5))
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        same = torch.equal(res, ref_res)
        table.append(
            f"| add_norm tail, o shape, preload {preload} | rel err {err:.2e} vs unfused "
            f"| residual equal: {same} |"
        )
        print(table[-1], flush=True)
        assert err < 1e-2 and same, (err, same)


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    res: dict = {"card": torch.cuda.get_device_name()}
    table: list[str] = []
    kernel_checks(table)
    llm = LLM("random:llama3-8b", max_model_len=1152, max_num_seqs=8)
    core = llm.engine.core
    ops = core.runner.model.ops
    block_size = llm.config.cache.block_size
    w2 = make_workload("W2", 128256)

    def set_arm(arm) -> None:
        for name, value in {**DEFAULTS, **arm[1]}.items():
            setattr(ops, name, value)
        core.runner.capture_cuda_graphs()

    def graph_arm(arm, reference):
        set_arm(arm)
        tokens, same = greedy_agreement(llm, w2.prompts[0], reference)
        graph = batch1_graph(core.runner.graphs, 384, block_size)
        ms = min(replay_ms(graph, 50) for _ in range(3))
        res.setdefault("graph", []).append({"arm": arm[0], "graph_ms": ms, "same": same})
        table.append(f"| decode graph bs1, 384 keys, {arm[0]} | {ms:.4f} ms | {same}/32 |")
        print(table[-1], flush=True)
        return tokens, ms

    reference, timed = None, []
    for arm in ARMS:
        tokens, ms = graph_arm(arm, reference)
        reference = reference or tokens
        timed.append((ms, arm))
    preloads = [t for t in timed if "preload" in t[1][0]]
    norms = [t for t in timed if "add_norm" in t[1][0]]
    best_preload = min(preloads, key=lambda t: t[0])[1]
    best_norm = min(norms, key=lambda t: t[0])[1]
    both = (f"{best_preload[0]} + {best_norm[0]}", {**best_preload[1], **best_norm[1]})
    timed.append((graph_arm(both, reference)[1], both))
    best = min(timed, key=lambda t: t[0])[1]
    for arm in [ARMS[0], best] * 2:
        set_arm(arm)
        stats = run_lantau(llm, w2).summary()
        res.setdefault("w2", []).append({"arm": arm[0], **stats})
        table.append(
            f"| W2, {arm[0]} | {stats['ms_per_token']:.3f} ms/token | GPU util "
            f"{stats['gpu_util_pct']}% |"
        )
        print(table[-1], flush=True)
    with open(os.path.join(OUT, "gpu_w2_chain.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| what | figure | comparison |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
