"""Tensor parallelism on a multi-GPU machine, in one call: for each size (default 1, 2 and every
power of two up to the GPUs there), a fresh engine on random:llama3-8b (bf16), each in its own
process, checked against the first size's greedy tokens, then W2 (batch 1, ms a token) and a
W3 throughput row.

    PYTHONPATH=. python3 benchmarks/gpu_tp.py [--sizes 1,2,4] [--model random:llama3-8b] \\
        [--w3 W3-1000] [--w3-prompts 256] [--eager]

On CPU it runs too (gloo), as a smoke run: `--model random:tiny --sizes 1,2 --w3 in:16/out:8`.

Expected on H200s: W2 falls from 3.7 ms at one rank towards ~2.2 at two (half the weights'
bytes a GPU, plus two all-reduces a layer of ~10-20 us each); W3 rises less than 2x (the
all-reduces of large steps move hidden x tokens x 2 bytes each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from _stages import Stages

from lantau import LLM, SamplingParams
from lantau.bench.offline import run_lantau
from lantau.bench.workloads import make_workload


def encode_cost(num_rows: int = 384, repeats: int = 200) -> dict[str, float]:
    """Rank 0's cost of sending one decode step of num_rows requests to its workers: the
    SchedulerOutput as the typed msgpack message it sends, against a pickle (us)."""
    import pickle

    import msgspec

    from lantau.engine.tp_workers import Launch
    from lantau.scheduler.output import CachedRequestData, SchedulerOutput

    ids = [f"cmpl-{i:04d}-0123456789abcdef#0" for i in range(num_rows)]
    out = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData(r, [i] if i % 16 == 0 else [], 500 + i)
                               for i, r in enumerate(ids)],
        num_scheduled_tokens=dict.fromkeys(ids, 1),
    )  # fmt: skip
    encoder, cost = msgspec.msgpack.Encoder(), {}
    for name, encode in (("msgpack", lambda: encoder.encode(Launch(out))),
                         ("pickle", lambda: pickle.dumps(out))):  # fmt: skip
        start = time.perf_counter()
        for _ in range(repeats):
            encode()
        cost[name] = (time.perf_counter() - start) / repeats * 1e6
    return cost


CHECK_PROMPTS = [[1, 15, 900, 42, 7, 3000, 12, 88], [5] * 40, list(range(100, 400))]


def run_size(args, size: int) -> dict:
    """One engine split over `size` ranks: its greedy tokens on CHECK_PROMPTS, W2, a W3 row."""
    llm = LLM(args.model, tensor_parallel_size=size, max_model_len=4096, max_num_seqs=384,
              enforce_eager=args.eager)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in CHECK_PROMPTS], greedy)
    row = {"tokens": [o.outputs[0].token_ids for o in outputs]}
    for spec, n in (("W2", None), (args.w3, args.w3_prompts)):
        w = make_workload(spec, llm.config.model_config.vocab_size, n)
        row[spec] = {**run_lantau(llm, w).summary(), "num_prompts": w.num_prompts}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=None, help="e.g. 1,2,4 (default: powers of 2)")
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--w3", default="W3-1000")
    parser.add_argument("--w3-prompts", type=int, default=256)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child's size
    args = parser.parse_args()
    if args.one:  # NOTE: each size in its own process: a GPU process keeps its NCCL group
        print("RESULT " + json.dumps(run_size(args, args.one)), flush=True)
        return
    num_gpus = torch.cuda.device_count()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [
        1 << i for i in range(num_gpus.bit_length()) if 1 << i <= num_gpus
    ]  # fmt: skip
    card = torch.cuda.get_device_name() if num_gpus else "cpu (gloo: a smoke run)"
    print(torch.__version__, num_gpus, "x", card, flush=True)
    cost = encode_cost()
    print(f"a 384-row decode step to the workers: msgpack {cost['msgpack']:.1f} us to encode, "
          f"pickle {cost['pickle']:.1f} us", flush=True)  # fmt: skip
    stages, reference = Stages(), None  # its results and table, reported last
    stages.results["encode_us"] = cost
    for size in sizes:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--one", str(size)],
            capture_output=True, text=True,
        )  # fmt: skip
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
        if child.returncode or not lines:
            print(child.stderr[-2000:])
            stages.table.append((f"tp {size}", "FAILED", f"exit {child.returncode}"))
            continue
        row = json.loads(lines[-1].removeprefix("RESULT "))
        reference = reference or row["tokens"]
        same = sum(a == b for a, b in zip(row["tokens"], reference, strict=True))
        row["greedy_same_as_first"] = f"{same}/{len(reference)}"
        for spec in ("W2", args.w3):
            stats = row[spec]
            if spec == "W2":
                figure = f"{stats['ms_per_token']:.2f} ms/token"
            else:
                figure = f"{stats['output_tok_s']:.0f} tok/s x{stats['num_prompts']}"
            comparison = (f"GPU util {stats['gpu_util_pct']}%, greedy tokens "
                          f"{row['greedy_same_as_first']} as the first size's")  # fmt: skip
            stages.table.append((f"tp {size}, {spec}", figure, comparison))
            print(stages.table[-1], flush=True)
        stages.results[size] = row
    stages.report("gpu_tp.json")


if __name__ == "__main__":
    main()
