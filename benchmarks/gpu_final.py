"""The session's closing run on the lent GPU: W5 with HF transformers `generate` as its peer in
the same run, and W3-128, on one engine (random:llama3-8b, bf16, max_num_seqs 384).

    PYTHONPATH=. python3 benchmarks/gpu_final.py [--w3-128 3000] [--peer-prompts 32]

--w3-128 0 leaves W3-128 out, --peer-prompts 0 the HF peer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from lantau import LLM
from lantau.bench.offline import _num_segments, run_hf_peer, run_lantau
from lantau.bench.workloads import Workload, make_workload
from lantau.model.random_weights import RANDOM_SHAPES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--w3-128", type=int, default=3000)
    parser.add_argument("--peer-prompts", type=int, default=32)
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results, table = {}, []
    llm = LLM("random:llama3-8b", max_model_len=4096, max_num_seqs=384, max_num_batched_tokens=8192)
    specs = [("W5", None)] + ([("W3-128", args.w3_128)] if args.w3_128 else [])
    for spec, n in specs:
        w = make_workload(spec, 128256, n)
        marks = {}

        def on_start(marks=marks):
            marks["segments"] = _num_segments(torch.device("cuda"))

        stats = run_lantau(llm, w, on_start).summary()
        stats["new_segments"] = _num_segments(torch.device("cuda")) - marks["segments"]
        results[spec] = stats
        table.append(
            f"| {spec} x{w.num_prompts} | {stats['output_tok_s']:.0f} tok/s | GPU util "
            f"{stats['gpu_util_pct']}%, P95 e2e {stats['e2e_p95_s']} s, +seg "
            f"{stats['new_segments']} |"
        )
        print(table[-1], flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.peer_prompts:
        table.append(hf_peer(args.peer_prompts, results))
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_final.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| what | figure | comparison |")
    print("\n".join(table))


def hf_peer(num_prompts: int, results: dict) -> str:
    """HF generate on W5's first prompts, static batches of 16: its table row."""
    w5 = make_workload("W5", 128256)
    peer = Workload("W5", w5.prompts[:num_prompts], w5.max_tokens, 16)
    stats = run_hf_peer(RANDOM_SHAPES["llama3-8b"], peer, torch.device("cuda"), False).summary()
    results["W5-hf"] = stats
    ratio = results["W5"]["output_tok_s"] / stats["output_tok_s"]
    return (
        f"| W5 HF generate, static batches of 16, first {num_prompts} prompts | "
        f"{stats['output_tok_s']:.0f} tok/s | lantau {ratio:.1f}x, GPU util "
        f"{stats['gpu_util_pct']}% |"
    )


if __name__ == "__main__":
    main()
