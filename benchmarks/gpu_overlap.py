"""One call on the lent GPU: what overlapped scheduling buys, and where the decode step's GPU
time goes (llama3-8b bf16, random weights).

1. ceilings: copy bandwidth, bf16 matmul rate;
2. the GEMMs alone: each projection at M=1 (and the 32 layers + lm_head in one graph), as
   TB/s of weight bytes, against the whole decode graph at batch 1;
3. per-kernel GPU time of one eager batch-1 decode step (torch.profiler), by kind;
4. hidden host syncs: a few engine steps under torch.cuda.set_sync_debug_mode("warn");
5. workloads (default W2, W5) with async_scheduling on and off on the same engine, each from
   a cold prefix cache, with a per-step timeline (mixed prefill steps vs decode-only steps).

    PYTHONPATH=. python3 benchmarks/gpu_overlap.py [--workloads W2,W5,W3-1000]
        [--num-prompts ,,1000] [--modes async,sync] [--skip gemm,graph,profile,sync]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections import defaultdict

import torch
import torch.nn.functional as F

from lantau import LLM, SamplingParams
from lantau.bench.offline import (
    _num_segments,
    graph_ms,
    measure_ceilings,
    replay_ms,
    run_lantau,
)
from lantau.bench.workloads import make_workload

RESULTS: dict = {}
TABLE: list[tuple[str, str, str]] = []


def gemm_study(model, copy_tb_s: float) -> None:
    """Each projection of every layer at M=1 through F.linear (cuBLAS), inside one graph."""
    layers = model.model.layers
    dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
    kinds = {
        "qkv": [lay.self_attn.qkv_proj.weight for lay in layers],
        "o": [lay.self_attn.o_proj.weight for lay in layers],
        "gate_up": [lay.mlp.gate_up_proj.weight for lay in layers],
        "down": [lay.mlp.down_proj.weight for lay in layers],
        "lm_head": [model.lm_head.weight],
    }
    out = {}
    total_ms, total_bytes = 0.0, 0
    for m in (1, 8, 64):
        for name, ws in kinds.items():
            xs = [torch.randn(m, w.shape[1], device=dev, dtype=dt) for w in ws]

            def run(ws=ws, xs=xs):
                for w, x in zip(ws, xs, strict=True):
                    F.linear(x, w)

            ms = graph_ms(run, iters=20)
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            out[f"{name}-m{m}"] = {"ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3)}
            if m == 1:
                total_ms += ms
                total_bytes += nbytes
    out["all-m1"] = {
        "ms": round(total_ms, 4),
        "tb_s": round(total_bytes / total_ms / 1e9, 3),
        "floor_ms": round(total_bytes / copy_tb_s / 1e9, 4),
    }
    RESULTS["gemm"] = out
    print(json.dumps(out, indent=1), flush=True)
    TABLE.append(
        (
            "GEMMs alone, M=1, 32 layers + lm_head",
            f"{total_ms:.3f} ms ({out['all-m1']['tb_s']} TB/s)",
            f"floor {out['all-m1']['floor_ms']} ms; per kind TB/s "
            + ", ".join(f"{k} {out[k + '-m1']['tb_s']}" for k in kinds),
        )
    )


def kernel_profile(llm) -> None:
    """GPU time per kernel kind of eager batch-1 decode steps (kernel durations, no gaps)."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine.core
    graphs = core.runner.graphs
    core.runner.graphs = None  # eager
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    llm.generate(prompt, params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
    core.runner.graphs = graphs
    kinds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    steps = 23  # decode steps in the profiled generate (1 prefill + 23 decodes)
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key.lower()
        t = evt.device_time_total / 1e3  # ms
        kind = next(
            (
                k
                for k, pats in (
                    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "xmma", "splitk")),
                    ("attention", ("attention", "attn", "_merge")),
                    ("norm", ("rms",)),
                    ("rotary", ("rotary", "rope")),
                    ("kv_write", ("kv_cache", "write_kv")),
                    ("silu", ("silu",)),
                    ("sampling", ("argmax", "reduce", "softmax", "index", "copy", "fill")),
                )
                if any(p in name for p in pats)
            ),
            "other",
        )
        kinds[kind] += t
        counts[kind] += evt.count
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=20)
    print(table, flush=True)
    per_step = {k: round(v / (steps + 1), 4) for k, v in kinds.items()}
    RESULTS["kernel_profile_ms_per_step"] = per_step
    RESULTS["kernel_counts_per_step"] = {k: v // (steps + 1) for k, v in counts.items()}
    TABLE.append(
        (
            "eager bs1 step, GPU ms by kind",
            f"{sum(per_step.values()):.3f} ms",
            ", ".join(f"{k} {v}" for k, v in sorted(per_step.items(), key=lambda x: -x[1])),
        )
    )


def sync_check(llm) -> None:
    """Count host syncs torch flags during engine steps (the token copy uses an event, which
    is not flagged; anything flagged is a hidden sync)."""
    core = llm.engine.core
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=16, ignore_eos=True,
                       detokenize=False, seed=3, repetition_penalty=1.1, logprobs=2),
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(500 + i, 600 + i))} for i in range(8)]
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"sync{i}", p, params[i % 2])
    core.step()
    core.step()  # prefill done, decodes in flight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(6):
                if i == 2:  # a new prompt mid-way: mixed prefill + decode steps are checked too
                    llm.engine.add_request("sync-late", prompts[0], params[0])
                llm.engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    flagged = [w for w in caught if "prototype" not in str(w.message)]
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in flagged})
    RESULTS["sync_warnings"] = where
    TABLE.append(("host syncs flagged in 6 steps", str(len(flagged)), ", ".join(where)))


def timeline(core):
    """Wrap core.step: per scheduled step, what the scheduler put in it and the wall time of
    the step() call that waited for it. Overlapped, call k schedules step k and waits for step
    k - 1, so its time goes to step k - 1 (before 2026-12-03i it went to step k: a burst of
    prefill steps lent its last step's time to the decode step after it)."""
    rows = []
    schedule, step = core.scheduler.schedule, core.step

    def sched_wrapper():
        out = schedule()
        rows.append([out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), 0.0])
        return out

    def step_wrapper():
        t = time.perf_counter()
        try:
            return step()
        finally:
            waited = rows[-2] if core.async_scheduling and len(rows) > 1 else rows[-1]
            waited[2] += time.perf_counter() - t

    core.scheduler.schedule, core.step = sched_wrapper, step_wrapper

    def undo():
        core.scheduler.schedule, core.step = schedule, step
        decode = [r for r in rows if r[0] == r[1] and r[0] > 0]
        mixed = [r for r in rows if r[0] > r[1]]
        tokens = sum(r[0] - r[1] for r in mixed)  # prefill tokens, about
        mixed_s = sum(r[2] for r in mixed)
        return {
            "steps": len(rows),
            "mixed_steps": len(mixed),
            "mixed_s": round(mixed_s, 3),
            "prefill_tokens": tokens,
            "prefill_tflop_s_8b": round(2 * 7.5e9 * tokens / max(mixed_s, 1e-9) / 1e12, 1),
            "decode_steps": len(decode),
            "decode_s": round(sum(r[2] for r in decode), 3),
            "decode_mean_ms": round(1e3 * statistics.mean(r[2] for r in decode), 3)
            if decode
            else None,
            "decode_mean_batch": round(statistics.mean(r[1] for r in decode), 1)
            if decode
            else None,
        }

    return undo


def workloads(llm, specs, modes) -> None:
    """Each workload from a cold prefix cache, in each scheduling mode."""
    core = llm.engine.core
    for spec, n in specs:
        spec, _, only = spec.partition(":")  # "W3-1000:async" runs in that mode alone
        w = make_workload(spec, 128256, n)
        for overlap in [only == "async"] if only else modes:
            core.async_scheduling = overlap
            core.reset_prefix_cache()
            marks = {}

            def on_start(marks=marks):
                marks["segments"] = _num_segments(torch.device("cuda"))
                marks["preempted"] = core.scheduler.num_preemptions
                marks["undo"] = timeline(core)

            stats = run_lantau(llm, w, on_start).summary()
            before, preempted, undo = marks["segments"], marks["preempted"], marks["undo"]
            stats["timeline"] = undo()
            stats["new_segments"] = _num_segments(torch.device("cuda")) - before
            stats["preemptions"] = core.scheduler.num_preemptions - preempted
            key = f"{spec}-{'async' if overlap else 'sync'}"
            RESULTS[key] = stats
            print(key, json.dumps(stats), flush=True)
            fig = (
                f"{stats['ms_per_token']:.3f} ms/tok"
                if spec == "W2"
                else f"{stats['output_tok_s']:.0f} tok/s"
            )
            tl = stats["timeline"]
            TABLE.append(
                (
                    f"{key} x{w.num_prompts}",
                    fig,
                    f"gpu {stats['gpu_util_pct']}%, p95 e2e {stats['e2e_p95_s']}s, "
                    f"+seg {stats['new_segments']}, preempted {stats['preemptions']}; "
                    f"mixed {tl['mixed_steps']} steps "
                    f"{tl['mixed_s']}s ({tl['prefill_tflop_s_8b']} TFLOP/s), decode "
                    f"{tl['decode_steps']} x {tl['decode_mean_ms']} ms @ {tl['decode_mean_batch']}",
                )
            )
    core.async_scheduling = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="W2,W5", help="comma-separated WORKLOADS ids")
    parser.add_argument("--num-prompts", default="", help="comma-separated, per workload")
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--scheduling-policy", default="max_utilization")
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    c = measure_ceilings(torch.device("cuda"))
    RESULTS["ceilings"] = c
    TABLE.append(("ceilings", f"{c['copy_tb_s']} TB/s copy", f"{c['bf16_matmul_tflop_s']} TFLOP/s"))
    torch.cuda.empty_cache()
    t = time.perf_counter()
    llm = LLM(
        "random:llama3-8b",
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
    )
    RESULTS["engine_start_s"] = round(time.perf_counter() - t, 1)
    RESULTS["kv_blocks"] = llm.config.cache.num_blocks
    TABLE.append(
        (
            "engine",
            f"up in {RESULTS['engine_start_s']} s",
            f"{llm.config.cache.num_blocks} KV blocks of 16, max_num_seqs "
            f"{llm.config.scheduler.max_num_seqs}, max_num_batched_tokens "
            f"{llm.config.scheduler.max_num_batched_tokens}",
        )
    )
    model = llm.engine.core.runner.model
    names = args.workloads.split(",")
    counts = (
        [int(n) if n else None for n in args.num_prompts.split(",")] if args.num_prompts else []
    )
    specs = list(zip(names, counts + [None] * (len(names) - len(counts)), strict=True))
    modes = [m == "async" for m in args.modes.split(",")]
    stages = [
        ("gemm", lambda: gemm_study(model, c["copy_tb_s"])),
        ("graph", lambda: decode_graph(llm)),
        ("profile", lambda: kernel_profile(llm)),
        ("sync", lambda: sync_check(llm)),
        ("workloads", lambda: workloads(llm, specs, modes)),
    ]
    for name, fn in stages:
        if name in skip:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # report and go on: one call should yield all it can
            import traceback

            traceback.print_exc()
            TABLE.append((name, "FAILED", f"{type(e).__name__}: {e}"[:100]))
        print(f"=== {name}: {time.perf_counter() - t:.1f}s", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_overlap.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print("\n| what | figure | comparison |")
    for row in TABLE:
        print(f"| {' | '.join(row)} |")


def decode_graph(llm) -> None:
    """The captured decode graphs replayed back to back, every row at one context length."""
    graphs = llm.engine.core.runner.graphs
    out = {}
    for bs, seq in ((1, 1), (1, 384), (1, 640), (64, 1), (256, 1), (256, 1100), (256, 1500)):
        graph = graphs.graphs[bs][0]
        nblk = -(-seq // 16)
        graphs.seq_lens[:bs].fill_(seq)
        # distinct blocks per row, as real requests have
        table = torch.arange(bs * nblk, device=graphs.seq_lens.device, dtype=torch.int32)
        graphs.block_tables[:bs, :nblk] = table.view(bs, nblk)
        graphs.slot_mapping[:bs].fill_(-1)
        out[f"bs{bs}-seq{seq}"] = round(replay_ms(graph, 20), 4)
    graphs.seq_lens.fill_(1)
    graphs.block_tables.zero_()
    RESULTS["decode_graph_ms"] = out
    TABLE.append(("decode graph replay, ms", ", ".join(f"{k} {v}" for k, v in out.items()), ""))


if __name__ == "__main__":
    main()
