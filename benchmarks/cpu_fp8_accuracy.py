"""FP8 weights' accuracy on CPU, the figures docs/fp8.md states: bf16 and fp8 against the fp32
model (torch backend) on the default model (SmolLM2-135M-Instruct) and the tests' tiny random
Llama. Every position's logits over tests/data/fp8_text.txt (relative error, top-1 agreement,
perplexity) and greedy continuations of eight chat prompts (tiny: random ids).

    PYTHONPATH=. python benchmarks/cpu_fp8_accuracy.py [--tokens 24] [--models default,tiny]
    PYTHONPATH=. python benchmarks/cpu_fp8_accuracy.py --tokens 8 --models wide:4,wide:12

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


def wide_model(folder: str, layers: int) -> tuple[str, list[int], list[list[int]], dict]:
    """A random Llama as wide as llama3-8b (hidden 4,096, 14,336, 32 / 8 heads; HF's init,
    std 0.02) but `layers` deep and with 4,096 ids: how fp8's error on a random net of that
    width grows with depth (the GPU script's random llama3-8b is 32 deep)."""
    import transformers

    from tests.conftest import save_tiny_hf_model

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=512,
        initializer_range=0.02, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    save_tiny_hf_model(folder, config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)]
    text = torch.randint(3, 4096, (96,), generator=gen).tolist()
    return folder, text, prompts, {"max_model_len": 256, "num_kv_blocks": 32}


def default_model() -> tuple[None, list[int], list[list[int]], dict]:
    ref = LLM(None, dtype="float32", device="cpu", max_model_len=2048, num_kv_blocks=160)
    prompts = [ref.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    return None, ref.tokenizer.encode(TEXT), prompts, {"max_model_len": 2048, "num_kv_blocks": 160}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens a prompt")
    parser.add_argument(
        "--models", default="default,tiny", help="default, tiny, wide:LAYERS (8B's width)"
    )
    args = parser.parse_args()
    for name in args.models.split(","):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            if name.startswith("wide:"):
                model, text_ids, prompts, engine = wide_model(folder, int(name[5:]))
            else:
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
