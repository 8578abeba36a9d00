"""FP8 weights' accuracy on CPU, the figures docs/fp8.md states: bf16 and fp8 against the fp32
model (torch backend) on the default model (SmolLM2-135M-Instruct) and the tests' tiny random
Llama. Every position's logits over tests/data/fp8_text.txt (relative error, top-1 agreement,
perplexity) and greedy continuations of eight chat prompts (tiny: random ids).

    .venv/bin/python benchmarks/cpu_fp8_accuracy.py [--tokens 24] [--models default,tiny]

About 3 minutes on 2 cores. tests/test_fp8_accuracy.py asserts bounds on the same measures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from lantau import LLM
from lantau.bench import accuracy

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "tests" / "data" / "fp8_text.txt").read_text()
CHATS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Give me three tips for staying healthy.",
    "Explain what a computer is to a child.",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Say hello in French.",
]


def tiny_model(folder: str) -> tuple[str, list[int], list[list[int]], dict]:
    """The tests' tiny random Llama (tests/conftest.py), text as byte ids, random prompts."""
    import transformers

    from tests.conftest import TINY_LLAMA, save_tiny_hf_model

    save_tiny_hf_model(folder, transformers.LlamaConfig(**TINY_LLAMA))
    gen = torch.Generator().manual_seed(0)
    lengths = (4, 9, 16, 23, 30, 41, 50, 64)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    return folder, list(TEXT.encode())[:512], prompts, {"num_kv_blocks": 128}


def default_model() -> tuple[None, list[int], list[list[int]], dict]:
    ref = LLM(None, dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=160)
    prompts = [ref.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    return None, ref.tokenizer.encode(TEXT), prompts, {"max_model_len": 2048, "num_kv_blocks": 160}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens a prompt")
    parser.add_argument("--models", default="default,tiny")
    args = parser.parse_args()
    for name in args.models.split(","):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            model, text_ids, prompts, engine = (
                tiny_model(folder) if name == "tiny" else default_model()
            )
            ref = LLM(model, dtype="float32", device="cpu", **engine)
            ref_logits = accuracy.sequence_logits(ref.engine.core.runner.model, text_ids)
            ref_tokens = accuracy.greedy_tokens(ref, prompts, args.tokens)
            del ref
            print(f"{name}: {len(text_ids)} text tokens, {len(prompts)} prompts x {args.tokens}")
            for dtype in ("bfloat16", "fp8"):
                llm = LLM(model, dtype=dtype, device="cpu", **engine)
                found = accuracy.compare(
                    llm, ref_logits, ref_tokens, text_ids, prompts, args.tokens
                )
                print("  " + found.line(f"{dtype} vs fp32"))
                del llm
        print(f"  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
