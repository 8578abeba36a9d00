"""Where W2's decode step spends its time, by taking pieces out (llama3-8b bf16, batch 1).

A profiler cannot say it: with programmatic dependent launch each kernel starts while the one
before still runs, so kernel durations overlap. Instead the engine's batch-1 decode graph at 384
keys is captured again with one kind of op replaced by nothing (its output left as a buffer of
zeros made before capture) and timed: the difference to the full graph is what that op adds to
the step's critical path. The results are wrong numbers, on purpose; only the times count.

Rows: the full graph; without each of the GEMVs (qkv, o, gate_up, down, lm_head), the norms,
rotary + KV write, attention; the GEMVs alone (no norms, rotary, attention) and the rest alone
(no GEMVs). Each GEMV row also gives the weight bytes over the time it adds, in TB/s, and the
GEMVs-alone row against the step's weight bytes over the same run's copy bandwidth.

With --attn-sweep, then: the same graph with decode attention's knobs changed one set at a
time (tiles, splits, the merge, early KV loads), each set's GPU time, and W2 itself with the
fastest set against the engine's default, alternated twice, greedy tokens checked.

    PYTHONPATH=. python3 benchmarks/gpu_w2_ablate.py [--attn-sweep]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from lantau import LLM, SamplingParams
from lantau.bench.offline import batch1_graph, measure_ceilings, replay_ms, run_lantau
from lantau.bench.workloads import make_workload

OUT = os.environ.get("OUT", ".")
GEMVS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
SMALL = ("norms", "rotary", "attention")


class Ablation:
    """Replaces the chosen ops of a TritonOps instance by instance attributes (the class's own
    methods stay), and restores them."""

    def __init__(self, model, ops) -> None:
        self.model, self.ops = model, ops
        self.layer_kind: dict[int, str] = {id(model.lm_head): "lm_head"}
        for layer in model.model.layers:
            for name in ("qkv_proj", "o_proj"):
                self.layer_kind[id(getattr(layer.self_attn, name))] = name
            for name in ("gate_up_proj", "down_proj"):
                self.layer_kind[id(getattr(layer.mlp, name))] = name
        self.zeros: dict[tuple, torch.Tensor] = {}

    def _zeros(self, shape, like: torch.Tensor) -> torch.Tensor:
        # made on the first (warm-up) call, outside any capture, and reused
        key = (tuple(shape), like.dtype)
        if key not in self.zeros:
            self.zeros[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.zeros[key]

    def apply(self, skip: set[str]) -> None:
        ops, cls = self.ops, type(self.ops)
        gemv_linear = cls._gemv_linear.__get__(ops)
        skipped = skip & set(GEMVS)

        def _gemv_linear(x, layer, **fusions):
            if self.layer_kind.get(id(layer)) not in skipped:
                return gemv_linear(x, layer, **fusions)
            n = layer.weight.shape[0] // (2 if fusions.get("gated") else 1)
            return self._zeros((x.shape[0], n), x)

        ops._gemv_linear = _gemv_linear
        if "norms" in skip:
            ops.add_rms_norm = lambda x, residual, weight, eps: (x, residual)
            ops.rms_norm = lambda x, weight, eps: x
        if "rotary" in skip:
            ops.rotary_and_write_kv = lambda q, k, v, *args: q
        if "attention" in skip:
            ops.attention = lambda q, kv_cache, meta, scale: q

    def restore(self) -> None:
        names = ("_gemv_linear", "add_rms_norm", "rms_norm", "rotary_and_write_kv", "attention")
        for name in names:
            self.ops.__dict__.pop(name, None)


ATTN_SETS = [  # runs/2026-12-03o-attn_sweep.log swept tiles, splits and merges one at a time
    {},
    {"attn_early_merge_kernel": True},
    {"attn_num_splits": 8},
    {"attn_num_splits": 8, "attn_early_merge_kernel": True},
    {"attn_early_config": (32, 4, 2)},
    {"attn_early_config": (32, 4, 2), "attn_early_merge_kernel": True},
    {"attn_early_config": (16, 4, 1), "attn_early_merge_kernel": True},
    {"attn_early_merge_kernel": True},
    {},
]


def attention_sweep(llm, results: dict) -> list[str]:
    core = llm.engine.core
    ops, block_size = core.runner.model.ops, llm.config.cache.block_size
    defaults = {key: getattr(ops, key) for s in ATTN_SETS for key in s}
    table, timed = [], []
    for knobs in ATTN_SETS:
        for key, value in {**defaults, **knobs}.items():
            setattr(ops, key, value)
        core.runner.capture_cuda_graphs()
        graph = batch1_graph(core.runner.graphs, 384, block_size)
        ms = min(replay_ms(graph, 50) for _ in range(3))
        label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        timed.append((ms, knobs))
        results.setdefault("attn_sweep", []).append({"knobs": label, "graph_ms": ms})
        table.append(f"| graph, attention {label} | {ms:.3f} ms | |")
        print(table[-1], flush=True)
    best = min(timed, key=lambda t: t[0])[1]
    w2 = make_workload("W2", 128256)
    check = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    reference = None
    for knobs in (defaults, best, defaults, best):
        for key, value in {**defaults, **knobs}.items():
            setattr(ops, key, value)
        core.runner.capture_cuda_graphs()
        llm.reset_prefix_cache()
        tokens = llm.generate({"prompt_token_ids": w2.prompts[0]}, check)[0].outputs[0].token_ids
        reference = reference or tokens
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), 32
        )
        stats = run_lantau(llm, w2).summary()
        label = ", ".join(f"{k}={v}" for k, v in knobs.items() if defaults[k] != v) or "default"
        results.setdefault("attn_w2", []).append({"knobs": label, **stats})
        table.append(
            f"| W2, attention {label} | {stats['ms_per_token']:.3f} ms/token | "
            f"GPU util {stats['gpu_util_pct']}%; {same}/32 greedy tokens as the default's |"
        )
        print(table[-1], flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn-sweep", action="store_true")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    llm = LLM("random:llama3-8b", max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=4096)
    core = llm.engine.core
    model, block_size = core.runner.model, llm.config.cache.block_size
    ablation = Ablation(model, model.ops)
    layer = model.model.layers[0]
    bytes_of = {
        "qkv_proj": layer.self_attn.qkv_proj.weight,
        "o_proj": layer.self_attn.o_proj.weight,
        "gate_up_proj": layer.mlp.gate_up_proj.weight,
        "down_proj": layer.mlp.down_proj.weight,
    }
    num_layers = len(model.model.layers)
    bytes_of = {k: w.numel() * w.element_size() * num_layers for k, w in bytes_of.items()}
    bytes_of["lm_head"] = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    ceilings = measure_ceilings(torch.device("cuda"))
    results: dict = {"ceilings": ceilings, "bytes": bytes_of}

    def time_without(skip: set[str]) -> float:
        ablation.apply(skip)
        try:
            core.runner.capture_cuda_graphs()
            graph = batch1_graph(core.runner.graphs, 384, block_size)
            return min(replay_ms(graph, 50) for _ in range(3))
        finally:
            ablation.restore()

    rows = [("full", set())]
    rows += [(f"without {name}", {name}) for name in GEMVS + SMALL]
    rows += [("GEMVs alone", set(SMALL)), ("without GEMVs", set(GEMVS)), ("full again", set())]
    table = []
    full = None
    for label, skip in rows:
        ms = time_without(skip)
        full = ms if full is None else full
        results[label] = ms
        note = ""
        if len(skip) == 1 and next(iter(skip)) in GEMVS:
            name = next(iter(skip))
            added_ms = full - ms
            rate = bytes_of[name] / (added_ms * 1e-3) / 1e12 if added_ms > 0 else float("nan")
            note = f"adds {added_ms:.3f} ms = {rate:.2f} TB/s of its {bytes_of[name] / 1e9:.2f} GB"
        elif skip:
            note = f"adds {full - ms:.3f} ms ({(full - ms) / num_layers * 1e3:.2f} us a layer)"
        if label == "GEMVs alone" and ceilings:
            floor = sum(bytes_of.values()) / (ceilings["copy_tb_s"] * 1e12) * 1e3
            note += f"; weight-read floor {floor:.3f} ms at the copy's {ceilings['copy_tb_s']} TB/s"
        table.append(f"| {label} | {ms:.3f} ms | {note} |")
        print(table[-1], flush=True)
    if args.attn_sweep:
        table += attention_sweep(llm, results)
    with open(os.path.join(OUT, "gpu_w2_ablate.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\n| W2 decode graph, batch 1, 384 keys | GPU time a replay | what it says |")
    print("| --- | --- | --- |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
