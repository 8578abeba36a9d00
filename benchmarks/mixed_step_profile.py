"""Where a served prompt's prefill time goes: W1's shape (467-token prompts beside ~20 running
decodes) in an engine built as `lantau serve` builds it (CUDA graphs, the serve defaults), each
step's device time (CUDA events, as the served step log's) by kind, the new prompt's time from
arrival to its first token in the engine, the kernels of its steps against those of the
decode-only steps beside them (torch.profiler), and the bf16 GEMM floor at the steps' rows.

Per `--thresholds` value (`--long-prefill-token-threshold`; 0: no chunking) one engine:
`--decodes` requests are prefilled and left decoding, then `--prompts` new 467-token prompts
arrive one at a time (each after the last one's first token and a few decode-only steps).

    PYTHONPATH=. python3 benchmarks/mixed_step_profile.py [--model random:llama3-8b]
        [--thresholds 256,0] [--decodes 20] [--prompts 12]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from fp8_kernel_profile import family, kernel_times
from torch.profiler import ProfilerActivity, profile

from lantau import LLM, SamplingParams
from lantau.cli import make_parser, serve_engine_args
from lantau.engine.pacer import StepPacer

OUT = os.environ.get("OUT", ".")
ACTIVITIES = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
PROMPT_LEN = 467  # W1


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(model: str, threshold: int, extra: list[str]) -> LLM:
    args = make_parser().parse_args(
        ["serve", model, "--long-prefill-token-threshold", str(threshold), *extra]
    )
    llm = LLM(**serve_engine_args(args))
    core = llm.engine.core
    if core.async_scheduling and torch.cuda.is_available():
        core.pacer = StepPacer()  # the served loop's step timing (CUDA events a step)
    return llm


def run_arm(model: str, threshold: int, decodes: int, prompts: int, seed: int, extra) -> dict:
    llm = build(model, threshold, extra)
    engine, core = llm.engine, llm.engine.core
    vocab = min(core.config.model_config.vocab_size, 32000)
    gen = torch.Generator().manual_seed(seed)

    def prompt() -> dict:
        return {"prompt_token_ids": torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()}

    records: list[dict] = []
    core.on_step = records.append
    long = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True, detokenize=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    for i in range(decodes):
        engine.add_request(f"d{i}", prompt(), long)
    while core.scheduler.has_partial_prompts or core.scheduler.num_waiting:
        engine.step()
    for _ in range(8):
        engine.step()

    def one_prompt(name: str) -> tuple[float, int]:
        """A new prompt: seconds from its arrival to its first token, and the steps taken."""
        first = len(records)
        start = time.perf_counter()
        engine.add_request(name, prompt(), one)
        done = False
        while not done:
            done = any(o.request_id == name for o in engine.step())
        return time.perf_counter() - start, len(records) - first

    for i in range(3):  # warm: every shape these steps take, compiled and timed once
        one_prompt(f"warm{i}")
        for _ in range(4):
            engine.step()
    records.clear()
    ttft, steps_taken = [], []
    for i in range(prompts):
        seconds, n = one_prompt(f"p{i}")
        ttft.append(seconds * 1e3)
        steps_taken.append(n)
        for _ in range(4):
            engine.step()
    for _ in range(2):
        engine.step()  # the last steps' device times collected
    device = {r["timed_step"]: r["device_ms"] for r in records if r["device_ms"] is not None}
    kinds: dict[str, list[float]] = defaultdict(list)
    for r in records:
        ms = device.get(r["step"])
        if ms is None or not r["reqs"]:
            continue
        if r["tokens"] == r["reqs"]:
            kinds[f"decode {r['reqs']} rows"].append(ms)
        else:
            kinds[f"mixed {r['tokens']} tokens ({r['decodes']} decodes)"].append(ms)
    by_kind = {
        k: {"steps": len(v), "device_ms": round(statistics.median(v), 3)}
        for k, v in sorted(kinds.items(), key=lambda kv: -len(kv[1]))
    }
    # the kernels: 16 decode-only steps, then one prompt's window (its steps and the step
    # that collects them), each under the profiler
    sync()
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(16):
            engine.step()
        sync()
    decode_kernels = {k: v / 16 for k, v in kernel_times(prof)[0].items()}
    with profile(activities=ACTIVITIES) as prof:
        seconds, n = one_prompt("profiled")
        sync()
    window = kernel_times(prof)[0]
    extra = {k: window.get(k, 0.0) - n * decode_kernels.get(k, 0.0) for k in window}
    fams: dict[str, float] = defaultdict(float)
    for k, ms in extra.items():
        fams[family(k)] += ms
    for i in range(decodes):
        engine.abort_request(f"d{i}")
    out = {
        "threshold": threshold,
        "decodes": decodes,
        "ttft_ms": {
            "mean": round(statistics.mean(ttft), 3),
            "median": round(statistics.median(ttft), 3),
            "min": round(min(ttft), 3),
        },
        "steps_to_first_token": statistics.median(steps_taken),
        "device_ms_by_kind": by_kind,
        "profiled_window": {"steps": n, "ms": round(seconds * 1e3, 3)},
        "decode_step_kernels_ms": round(sum(decode_kernels.values()), 3),
        "window_kernels_ms": round(sum(window.values()), 3),
        "extra_over_decode_by_family_ms": {k: round(v, 3) for k, v in sorted(fams.items())},
        "extra_top": [
            (k[:100], round(v, 3)) for k, v in sorted(extra.items(), key=lambda kv: -kv[1])[:16]
        ],
    }
    return out


def gemm_floor(rows: list[int], hidden=4096, inter=14336, heads=32, kv_heads=8) -> dict:
    """bf16 torch.mm at the 8B projections' shapes, per BLAS library torch may call (cuBLAS,
    cuBLASLt): ms for one layer's four GEMMs and per projection, times 32 layers for the model
    (weights past L2: two copies alternated)."""
    head_dim = hidden // heads
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    weights = {
        k: [torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for k, (n, kk) in shapes.items()
    }
    flop_per_row = 2 * sum(n * kk for n, kk in shapes.values())
    out: dict = {}
    default = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in rows:
            per = {}
            for k, (_, kk) in shapes.items():
                x = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
                for i in range(3):
                    x @ weights[k][i % 2].t()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(40):
                    x @ weights[k][i % 2].t()
                end.record()
                torch.cuda.synchronize()
                per[k] = round(start.elapsed_time(end) / 40, 4)
            layer = sum(per.values())
            out.setdefault(lib, {})[m] = {
                "model_ms": round(32 * layer, 3),
                "tflops": round(flop_per_row * m / (layer / 1e3) / 1e12, 1),
                "per_projection_ms": per,
            }
    torch.backends.cuda.preferred_blas_library(default)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--thresholds", default="256,0")
    parser.add_argument("--decodes", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--gemm-rows", default=",".join(str(m) for m in [21, *range(64, 641, 32)]))
    parser.add_argument("--serve-args", default="", help="more `lantau serve` arguments")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.model} on {device}", flush=True)
    results = {"arms": []}
    for t in [int(x) for x in args.thresholds.split(",")]:
        arm = run_arm(args.model, t, args.decodes, args.prompts, t, args.serve_args.split())
        results["arms"].append(arm)
        gc.collect()  # the arm's engine, before the next one's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(json.dumps(arm, indent=1), flush=True)
    if "8b" in args.model and torch.cuda.is_available():
        results["gemm_floor"] = floor = gemm_floor([int(r) for r in args.gemm_rows.split(",")])
        print("\n| rows | " + " | ".join(f"{lib} ms (TFLOP/s)" for lib in floor) + " |")
        print("| --- |" + " --- |" * len(floor))
        for m in next(iter(floor.values())):
            cells = [f"{floor[lib][m]['model_ms']} ({floor[lib][m]['tflops']})" for lib in floor]
            print(f"| {m} | " + " | ".join(cells) + " |")
    with open(os.path.join(OUT, "mixed_step_profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| threshold | TTFT in engine (median ms) | steps | step kinds: device ms (median) |")
    print("| --- | --- | --- | --- |")
    for arm in results["arms"]:
        kinds = "; ".join(
            f"{k} x{v['steps']}: {v['device_ms']}" for k, v in arm["device_ms_by_kind"].items()
        )
        print(f"| {arm['threshold']} | {arm['ttft_ms']['median']} | "
              f"{arm['steps_to_first_token']} | {kinds} |")  # fmt: skip


if __name__ == "__main__":
    main()
