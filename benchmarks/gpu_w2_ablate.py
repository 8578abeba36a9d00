"""Where W2's decode step spends its time, by taking pieces out (llama3-8b bf16, batch 1).

A profiler cannot say it: with programmatic dependent launch each kernel starts while the one
before still runs, so kernel durations overlap. Instead the engine's batch-1 decode graph at 384
keys is captured again with one kind of op replaced by nothing (its output left as a buffer of
zeros made before capture) and timed: the difference to the full graph is what that op adds to
the step's critical path. The results are wrong numbers, on purpose; only the times count.

Rows: the full graph; without each of the GEMVs (qkv, o, gate_up, down, lm_head), the norms,
rotary + KV write, attention; the GEMVs alone (no norms, rotary, attention) and the rest alone
(no GEMVs). Each GEMV row also gives the weight bytes over the time it adds, in TB/s, and the
GEMVs-alone row against the step's weight bytes over the same run's copy bandwidth. With rotary
inside decode attention (ops.fuse_rope_attention, the default), "without attention" takes the
rotary out with it, and "without rotary" is attention without its rope.

With --attn-sweep, first: the same graph with decode attention's knobs changed one set at a
time (tiles, splits, the merge, early KV loads), each set's GPU time, and W2 itself with the
fastest set against the engine's default, alternated twice, greedy tokens checked; the
ablation then runs with the fastest set.

With --norm-sweep instead (no ablation): the norms' weights folded into the projections
(fold_norm_weights; the flag RMSNorm.folded then only says whether the fused GEMVs skip loading
the all-ones weights), then the graph and W2 with the norms apart (the default), folded into
the GEMVs with each GEMV program summing its row's squares, folded with the sums handed over
by the launch that wrote the row (ops.norm_sums), and the same without the weight loads.

    PYTHONPATH=. python3 benchmarks/gpu_w2_ablate.py [--attn-sweep | --norm-sweep]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from lantau import LLM
from lantau.bench.offline import (
    batch1_graph,
    graph_ms,
    greedy_agreement,
    measure_ceilings,
    replay_ms,
    run_lantau,
)
from lantau.bench.workloads import make_workload
from lantau.model.llama import RMSNorm

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
        self.rope_attention = ops.fuse_rope_attention
        if "rotary" in skip:  # and out of attention, where fuse_rope_attention put it
            ops.rotary_and_write_kv = lambda q, k, v, *args: q
            ops.fuse_rope_attention = False
        if "attention" in skip:  # rotary inside it too, unless taken out above
            ops.attention = lambda q, kv_cache, meta, scale: q
            ops._decode_attention = lambda q, kv_cache, meta, scale, rope=None: q

    def restore(self) -> None:
        names = ("_gemv_linear", "add_rms_norm", "rms_norm", "rotary_and_write_kv", "attention")
        for name in (*names, "_decode_attention"):
            self.ops.__dict__.pop(name, None)
        self.ops.fuse_rope_attention = self.rope_attention


ATTN_SETS = [  # runs/2026-12-03o-u: tiles, splits, merges, early exit, fused norms, rope
    {},
    {"attn_short_config": (64, 8, 1)},
    {"gemv_maxnreg": 168},
    {"gemv_maxnreg": 168, "attn_early_maxnreg": 168},
    {"attn_early_maxnreg": 168},
    {"attn_short_config": (64, 8, 1), "gemv_maxnreg": 168, "attn_early_maxnreg": 168},
    {"attn_short_config": (64, 8, 1), "attn_short_keys": 512},
    {"attn_early_merge_kernel": True},
    {},
]
# W2 itself, each arm twice, alternated (the graph's fastest set is added if not among them)
W2_ARMS = [
    {},
    {"attn_short_config": (64, 8, 1)},
    {"gemv_maxnreg": 168},
    {"gemv_maxnreg": 168, "attn_early_maxnreg": 168},
]
# --norm-sweep: "model.folded" sets RMSNorm.folded on every norm (runs/2026-12-03x: norms
# 2.2 us a layer; fuse_decode summing in every program lost 3.925 vs 3.839, runs s)
NORM_SETS = [
    {},
    {"fuse_decode": True, "norm_sums": False},
    {"fuse_decode": True},
    {"fuse_decode": True, "model.folded": True},
    {},
]
NORM_ARMS = [{}, {"fuse_decode": True}, {"fuse_decode": True, "model.folded": True}]
# batch-1 decode attention alone at these context lengths, default vs each config
LONG_KEYS = (384, 2048, 8192, 32768)
LONG_CONFIGS = [
    {"merge_chunk": 0, "config": (64, 8, 2)},
    {"merge_chunk": 0, "config": (64, 8, 1)},
    {},
]


def apply_knobs(core, knobs: dict) -> None:
    """Set the knobs (the model's ops', or the decode graphs' with a "graphs." prefix) and
    capture the decode graphs again."""
    graph_knobs = {}
    for key, value in knobs.items():
        if key.startswith("graphs."):
            graph_knobs[key.removeprefix("graphs.")] = value
        elif key == "model.folded":
            for norm in norms(core.runner.model):
                norm.folded = value
        else:
            setattr(core.runner.model.ops, key, value)
    core.runner.capture_cuda_graphs()
    if graph_knobs:
        for key, value in graph_knobs.items():
            setattr(core.runner.graphs, key, value)
        core.runner.graphs.capture()


def norms(model) -> list[RMSNorm]:
    return [m for m in model.modules() if isinstance(m, RMSNorm)]


def knob_default(core, key: str):
    if key == "model.folded":
        return False
    if key.startswith("graphs."):
        return getattr(core.runner.graphs, key.removeprefix("graphs."))
    return getattr(core.runner.model.ops, key)


def knob_sweep(llm, results: dict, sets=ATTN_SETS, arms=W2_ARMS) -> tuple[list[str], dict]:
    """The sweep's table rows, and the fastest set of knobs (left set on the ops)."""
    core = llm.engine.core
    block_size = llm.config.cache.block_size
    defaults = {key: knob_default(core, key) for s in sets for key in s}
    table, timed = [], []
    for knobs in sets:
        apply_knobs(core, {**defaults, **knobs})
        graph = batch1_graph(core.runner.graphs, 384, block_size)
        ms = min(replay_ms(graph, 50) for _ in range(3))
        label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        timed.append((ms, knobs))
        results.setdefault("attn_sweep", []).append({"knobs": label, "graph_ms": ms})
        table.append(f"| graph, attention {label} | {ms:.3f} ms | |")
        print(table[-1], flush=True)
    best = min(timed, key=lambda t: t[0])[1]
    w2 = make_workload("W2", 128256)
    reference = None
    arms = arms + ([] if best in arms else [best])
    defaults.update({key: knob_default(core, key) for arm in arms for key in arm})
    for knobs in arms * 2:
        apply_knobs(core, {**defaults, **knobs})
        tokens, same = greedy_agreement(llm, w2.prompts[0], reference)
        reference = reference or tokens
        stats = run_lantau(llm, w2).summary()
        label = ", ".join(f"{k}={v}" for k, v in knobs.items() if defaults[k] != v) or "default"
        results.setdefault("attn_w2", []).append({"knobs": label, **stats})
        table.append(
            f"| W2, attention {label} | {stats['ms_per_token']:.3f} ms/token | "
            f"GPU util {stats['gpu_util_pct']}%; {same}/32 greedy tokens as the default's |"
        )
        print(table[-1], flush=True)
    apply_knobs(core, {**defaults, **best})
    return table, best


def long_contexts(results: dict) -> list[str]:
    """Batch-1 decode attention (early KV loads, 16 splits, llama3-8b's heads) at each of
    LONG_KEYS keys, each LONG_CONFIGS entry: us a launch, 32 launches captured in one graph."""
    from lantau.kernels.paged_attention import paged_decode_attention

    dev, block_size = torch.device("cuda"), 16
    max_keys = max(LONG_KEYS)
    kv = torch.randn(
        2, max_keys // block_size, block_size, 8, 128, device=dev, dtype=torch.bfloat16
    )
    q = torch.randn(1, 32, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.arange(max_keys // block_size, dtype=torch.int32, device=dev)[None]
    table = []
    for keys in LONG_KEYS:
        lens = torch.tensor([keys], dtype=torch.int32, device=dev)
        row = []
        for kwargs in LONG_CONFIGS:

            def launches(kwargs=kwargs, lens=lens):
                for _ in range(32):
                    paged_decode_attention(
                        q, kv, out, lens, tables, 4096, 128**-0.5, num_splits=16, early_kv=True,
                        **kwargs,
                    )  # fmt: skip

            us = graph_ms(launches) / 32 * 1e3
            row.append(f"{us:.2f}")
            results.setdefault("long", []).append({"keys": keys, **kwargs, "us": us})
        table.append(
            f"| decode attention bs1, {keys} keys | {' / '.join(row)} us | {LONG_CONFIGS} |"
        )
        print(table[-1], flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn-sweep", action="store_true")
    parser.add_argument("--norm-sweep", action="store_true", help="no ablation after it")
    parser.add_argument("--long", action="store_true", help="attention alone at long contexts")
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
            apply_knobs(core, results.get("ablation_knobs") or {})
            graph = batch1_graph(core.runner.graphs, 384, block_size)
            return min(replay_ms(graph, 50) for _ in range(3))
        finally:
            ablation.restore()

    table = long_contexts(results) if args.long else []
    if args.norm_sweep:
        model.fold_norm_weights()
        table, best = knob_sweep(llm, results, NORM_SETS, NORM_ARMS)
        rows = []
    elif args.attn_sweep:  # first, so that the ablation below runs with the fastest knobs
        table, best = knob_sweep(llm, results)
        results["ablation_knobs"] = best  # left set by the sweep
        table.append(f"| ablation below with {best or 'the defaults'} | | |")
    if not args.norm_sweep:
        rows = [("full", set())]
        rows += [(f"without {name}", {name}) for name in GEMVS + SMALL]
        rows += [("GEMVs alone", set(SMALL)), ("without GEMVs", set(GEMVS)), ("full again", set())]
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
    with open(os.path.join(OUT, "gpu_w2_ablate.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\n| W2 decode graph, batch 1, 384 keys | GPU time a replay | what it says |")
    print("| --- | --- | --- |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
