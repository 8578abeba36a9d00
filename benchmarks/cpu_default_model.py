"""The default model's output tokens/s on CPU at batch 1 and batch 16, lantau against HF
transformers `generate` on the same dequantized GGUF weights, in the same run.

    .venv/bin/python benchmarks/cpu_default_model.py [--tokens 128] [--record]

--record appends the rows to benchmarks/RESULTS.md (workloads cpu-smollm2-bs1/-bs16).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import transformers

from lantau import LLM, SamplingParams
from lantau.model.loader import DEFAULT_MODEL_FILE, default_model_path

PROMPTS = [
    "Tell me a story about a dragon who learns to paint.",
    "Explain how a rainbow forms.",
    "What are the benefits of drinking water?",
    "Describe the city of Paris in a few sentences.",
]


def lantau_tokens_per_s(llm: LLM, batch: int, num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    convs = [
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}] for i in range(batch)
    ]
    llm.chat(convs[:1], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def hf_tokens_per_s(model, tokenizer, batch: int, num_tokens: int) -> float:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(batch)
    ]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=2)  # warm-up
        start = time.perf_counter()
        model.generate(**enc, max_new_tokens=num_tokens, do_sample=False, pad_token_id=2)
        elapsed = time.perf_counter() - start
    return batch * num_tokens / elapsed


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    llm = LLM(dtype="float32", device="cpu", max_model_len=2048)
    folder = default_model_path().parent
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
    ).eval()
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    rows = []
    for batch in (1, 16):
        ours = lantau_tokens_per_s(llm, batch, args.tokens)
        peer = hf_tokens_per_s(hf, llm.tokenizer, batch, args.tokens)
        rows.append((f"cpu-smollm2-bs{batch}", ours, peer))
    date = datetime.date.today().isoformat()
    command = f"python benchmarks/cpu_default_model.py --tokens {args.tokens}"
    lines = [
        f"| {date} | {commit()} | {wl} | {ours:.1f} | output tok/s | HF transformers generate "
        f"(dynamic cache) same run: {peer:.1f} tok/s; {machine} | `{command}` |"
        for wl, ours, peer in rows
    ]
    print(f"\n{'workload':<18} {'lantau tok/s':>13} {'HF tok/s':>10}")
    for wl, ours, peer in rows:
        print(f"{wl:<18} {ours:>13.1f} {peer:>10.1f}")
    if args.record:
        with open(Path(__file__).parent / "RESULTS.md", "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
