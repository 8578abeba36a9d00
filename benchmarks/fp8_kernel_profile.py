"""Where an fp8 engine's device time goes, by kernel: W3-fp8-128 (llama3-8b) and W4-128
(llama3-70b) waves under torch.profiler, eager (the kernels a CUDA graph replays, each seen),
or with `--graphs` as served (CUDA graphs: the device's gaps between kernels, by the family of
the kernel after each gap, say what a step costs beyond its kernels).

For each model: one wave of `--rows` prompts of the workload's (`--workloads`, W3-128 by
default: 128 tokens in, 128 out), first prefill only (max_tokens 1), then prefill and every
decode step, then the decode steps alone (the prompts computed before, unprofiled); each
phase's kernels grouped by name (device ms, share), by family (fp8 GEMM, activation
quantization, attention, the rest; serially too: a kernel launched early by PDL is charged
from the end of the one before), the wave's wall time and its implied tok/s against the
same-run ceilings (fp8 matmul TFLOP/s, copy TB/s).

    PYTHONPATH=. python3 benchmarks/fp8_kernel_profile.py [--models 8b,70b] [--rows 384,128]
        [--workloads W3-128,W3-128] [--graphs] [--layers 40]

`--layers N` builds each model with its first N layers only (same shapes: a 70B layer's kernels
on a GPU that cannot hold 80 of them with their KV cache); a workload may be in:N/out:M.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from lantau import LLM, SamplingParams
from lantau.bench.offline import measure_ceilings
from lantau.bench.workloads import make_workload
from lantau.model.random_weights import RANDOM_SHAPES

OUT = os.environ.get("OUT", ".")
FAMILIES = [
    ("fp8 gemm", re.compile(r"scaled_mm|f8|fp8.*gemm|e4m3|sm90_xmma_gemm.*f8|cutlass.*f8", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|matmul|nvjet", re.I)),  # nvjet: cuBLAS's
    ("quant", re.compile(r"quant", re.I)),
    ("attention", re.compile(r"attn|attention|paged", re.I)),
    ("norm/rope/act", re.compile(r"norm|rope|rotary|silu|act", re.I)),
]


def family(name: str) -> str:
    return next((fam for fam, pat in FAMILIES if pat.search(name)), "other")


def kernel_times(prof) -> tuple[dict[str, float], dict[str, int]]:
    """A profile's kernels: device ms and launches by name."""
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0)
        if us > 0:
            kernels[evt.key] += us / 1e3
            counts[evt.key] += evt.count
    return kernels, counts


GAP_IDLE_US = 100.0  # a longer gap between kernels is the host's (between steps), not a launch's


def device_spans(prof) -> list[tuple[float, float, str]]:
    """The profile's kernels and copies on the device: (start us, end us, name), by start."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )


def kernel_gaps(prof) -> dict:
    """The device's gaps between consecutive kernels (and copies): under GAP_IDLE_US by the
    family of the kernel after the gap (launch and drain costs), longer ones summed apart."""
    spans = device_spans(prof)
    gaps: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    # the idle gaps: (us, ms from the first kernel, the kernel before, the kernel after)
    idle: list[tuple[float, float, str, str]] = []
    idle_us, end, last = 0.0, None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            if start - end > GAP_IDLE_US:
                idle_us += start - end
                idle.append((start - end, (end - spans[0][0]) / 1e3, last[:60], name[:60]))
            else:
                gaps[family(name)] += (start - end) / 1e3
                counts[family(name)] += 1
        if end is None or stop >= end:
            last = name
        end = stop if end is None else max(end, stop)
    pairs: dict[str, list[float]] = defaultdict(list)  # idle us by (kernel before -> after)
    for us, _, before, after in idle:
        pairs[f"{before} -> {after}"].append(us)
    return {
        "launch_gaps_ms": {k: round(v, 3) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])},
        "launch_gap_counts": dict(counts),
        "idle_ms": round(idle_us / 1e3, 3),
        # where the idle lies: its gaps by the kernels around them (count, ms), and the longest
        "idle_by_pair": {
            k: (len(v), round(sum(v) / 1e3, 3))
            for k, v in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:8]
        },
        "idle_longest": [
            (round(us), round(at, 1), before, after) for us, at, before, after in sorted(idle)[-8:]
        ],
    }


def serial_times(prof) -> dict[str, float]:
    """Device ms by family, each kernel charged only from the end of the kernels before it:
    a kernel launched early (PDL) and waiting on the one before is not counted twice."""
    fams: dict[str, float] = defaultdict(float)
    end = None
    for start, stop, name in device_spans(prof):
        begin = start if end is None else max(start, end)
        fams[family(name)] += max(stop - begin, 0.0) / 1e3
        end = stop if end is None else max(end, stop)
    return {k: round(v, 3) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])}


def profiled(llm, prompts, max_tokens: int, cached: bool = False) -> dict:
    """One generate of `prompts` under the profiler; `cached`: the prompts computed once
    before (max_tokens 1, not profiled), so that the profiled run is its decode steps and one
    step of each prompt's last token."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:8], params)  # warm
    llm.reset_prefix_cache()
    if cached:
        llm.generate(batch, dataclasses.replace(params, max_tokens=1))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(batch, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    llm.reset_prefix_cache()
    kernels, counts = kernel_times(prof)
    busy = sum(kernels.values())
    fams: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        fams[family(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        **kernel_gaps(prof),
        "wall_ms": wall * 1e3,
        "device_busy_ms": busy,
        "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
        "families_serial_ms": serial_times(prof),
        "top": [(name[:110], round(ms, 2), counts[name]) for name, ms in top],
    }


def run_model(
    name: str,
    rows: int,
    workload: str,
    table: list,
    results: dict,
    graphs: bool = False,
    layers: int = 0,
) -> None:
    model = {"8b": "llama3-8b", "70b": "llama3-70b"}[name]
    if layers:  # the same shapes, fewer layers: registered under a name of its own
        shape = dataclasses.replace(RANDOM_SHAPES[model], num_hidden_layers=layers)
        model = f"{model}-{layers}l"
        RANDOM_SHAPES[model] = shape
    model = f"random:{model}"
    t = time.perf_counter()
    wave = make_workload(workload, 128256, rows)  # llama3's vocabulary, both sizes
    prompt_len, output_len = len(wave.prompts[0]), wave.max_tokens
    llm = LLM(
        model, dtype="fp8", kv_cache_dtype="fp8", max_model_len=max(2048, prompt_len + output_len),
        max_num_seqs=rows, max_num_batched_tokens=65536 if name == "8b" else 16384,
        enforce_eager=not graphs,
    )  # fmt: skip
    mode = "graphs" if graphs else "eager"
    print(f"{model} fp8 {mode} up in {time.perf_counter() - t:.1f} s", flush=True)
    n_params = sum(p.numel() for p in llm.engine.core.runner.model.parameters())
    name = f"{name} {workload}"
    res = results[name] = {"rows": rows, "params": n_params}
    phases = (("prefill", 1, False), ("wave", output_len, False), ("decode", output_len, True))
    for phase, max_tokens, cached in phases:
        r = res[phase] = profiled(llm, wave.prompts, max_tokens, cached)
        tokens = rows * (max_tokens if cached else prompt_len + max_tokens)
        tflop = 2 * n_params * tokens / 1e12
        r["matmul_tflop_s_of_wall"] = tflop / r["wall_ms"] * 1e3
        print(name, phase, json.dumps(r, indent=1), flush=True)
        fams = ", ".join(f"{k} {v:.0f}" for k, v in list(r["families_serial_ms"].items())[:5])
        gaps = ", ".join(f"{k} {v:.0f}" for k, v in list(r["launch_gaps_ms"].items())[:5])
        table.append(
            (
                f"{name} {phase} x{rows} ({mode})",
                f"wall {r['wall_ms']:.0f} ms, busy {r['device_busy_ms']:.0f}",
                f"{r['matmul_tflop_s_of_wall']:.0f} TFLOP/s of wall; {fams}; gaps before "
                f"{gaps}; idle {r['idle_ms']:.0f}",
            )
        )
    wave_ms = res["wave"]["wall_ms"] - res["prefill"]["wall_ms"]
    table.append(
        (f"{name} decode x{rows} (wave - prefill)", f"{wave_ms / (output_len - 1):.2f} ms/step", "")
    )
    steps = output_len  # the cached prompts' last tokens, then output_len - 1 decode steps
    per_step = ", ".join(
        f"{k} {v / steps:.2f}" for k, v in res["decode"]["families_serial_ms"].items()
    )
    table.append((f"{name} decode x{rows} (cached prompts)", "ms a step by family", per_step))
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--rows", default="384,128", help="max_num_seqs and wave size, per model")
    p.add_argument("--workloads", default="W3-128,W3-128", help="the waves' shape, per model")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs, as served (not eager)")
    p.add_argument("--layers", type=int, default=0, help="the models' first N layers only")
    args = p.parse_args()
    table: list[tuple[str, str, str]] = []
    results: dict = {"ceilings": measure_ceilings(torch.device("cuda"))}
    table.append(("ceilings", json.dumps(results["ceilings"]), ""))
    runs = zip(args.models.split(","), args.rows.split(","), args.workloads.split(","), strict=True)
    for name, rows, workload in runs:
        try:
            run_model(name, int(rows), workload, table, results, args.graphs, args.layers)
        except Exception as e:  # the next model still runs
            table.append((name, "FAILED", f"{type(e).__name__}: {str(e)[:90]}"))
    os.makedirs(OUT, exist_ok=True)  # OUT may name a folder still to make (one a tree)
    with open(os.path.join(OUT, "fp8_kernel_profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| what | figure | detail |\n| --- | --- | --- |")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
