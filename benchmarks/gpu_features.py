"""The request features that leave the engine's fast path, checked on a device (one call):
logit bias, min_tokens, structured outputs, prompt logprobs, n, with CUDA graphs and without;
then LoRA adapters: a zero adapter is the base model, a drawn one changes the tokens, the
Triton ops' and graphs' tokens with it agree with the torch reference ops'.

Each engine (`--graphs` and `--eager`: enforce_eager) runs the same requests; a check is a
property of the output (a forced token, the grammar followed, no stop before min_tokens) or
agreement between the two engines (greedy tokens; prompt logprobs within --atol), and the
engine's wall time for the whole set is printed beside the same set without the features.

    python3 benchmarks/gpu_features.py [--model random:llama3.2-1b] [--device cuda]
        [--atol 0.05] [--out DIR]

On CPU (`--device cpu --model random:tiny`) it is the same run without graphs: a dry run.
"""

from __future__ import annotations

import argparse
import json
import re
import time

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
PROMPTS = [f"Question {i}: " + "the weather " * (3 + i % 5) for i in range(16)]


def requests(params_cls, eos: int):
    """(name, prompts, params, check(outputs) -> str | None): None when it holds."""
    greedy = dict(temperature=0.0, max_tokens=16)

    def forced(outs):
        bad = [o.outputs[0].token_ids for o in outs if set(o.outputs[0].token_ids) != {42}]
        return f"not all 42: {bad[:2]}" if bad else None

    def json_ok(outs):
        for o in outs:
            try:
                value = json.loads(o.outputs[0].text)
            except ValueError:
                return f"not JSON: {o.outputs[0].text!r}"
            if set(value) != {"answer", "n"}:
                return f"not the schema: {value}"
        return None

    def regex_ok(outs):
        bad = [
            o.outputs[0].text for o in outs if not re.fullmatch(r"(cat|dog)s?", o.outputs[0].text)
        ]
        return f"off the regex: {bad[:2]}" if bad else None

    def min_ok(outs):
        short = [len(o.outputs[0].token_ids) for o in outs if len(o.outputs[0].token_ids) < 8]
        return f"ended before min_tokens: {short}" if short else None

    structured = [
        ("json schema", PROMPTS,
         params_cls(temperature=0.8, seed=1, max_tokens=40, structured_outputs={"json": SCHEMA}),
         json_ok),
        ("regex", PROMPTS,
         params_cls(temperature=0.8, seed=2, max_tokens=8,
                    structured_outputs={"regex": "(cat|dog)s?"}), regex_ok),
    ] if has_llguidance() else []  # fmt: skip
    return [
        ("plain greedy", PROMPTS, params_cls(**greedy), lambda outs: None),
        ("logit_bias +100", PROMPTS, params_cls(**greedy, logit_bias={42: 100.0}), forced),
        ("min_tokens 8, EOS", PROMPTS,
         params_cls(temperature=0.0, max_tokens=16, min_tokens=8, stop_token_ids=[eos]), min_ok),
        *structured,
        ("prompt logprobs", PROMPTS, params_cls(**greedy, prompt_logprobs=2), lambda outs: None),
        ("n=4 sampled", PROMPTS[:4], params_cls(temperature=1.0, seed=3, n=4, max_tokens=16),
         lambda outs: None if all(len(o.outputs) == 4 for o in outs) else "n"),
    ]  # fmt: skip


def has_llguidance() -> bool:
    """Structured outputs need llguidance (carry its wheel in .whl on the GPU image); without
    it their two checks are reported as not run, and the rest run."""
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def run_engine(llm, params_cls, eos: int) -> dict:
    results = {}
    for name, prompts, params, check in requests(params_cls, eos):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        results[name] = dict(outs=outs, seconds=seconds, problem=check(outs))
    return results


def write_adapter(folder: str, config, seed: int, zero_b: bool = False, rank: int = 8) -> None:
    """A PEFT-layout LoRA adapter for `config`'s model (r `rank`, alpha 2r, all seven
    projections), written without peft (not on the GPU image); B all zeros with zero_b."""
    import os

    import torch
    from safetensors.torch import save_file

    from lantau.model.lora import _shape

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"):  # fmt: skip
            size_in, size_out = _shape(module, config)
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, size_in, generator=gen) * 0.02
            b = torch.randn(size_out, rank, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = b * 0 if zero_b else b
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                ],
            },
            f,
        )


def lora_rows(args) -> list[tuple[str, str, str]]:
    """LoRA adapters on the device: a zero adapter's tokens are the base model's (the same
    graphs: exactly), a drawn adapter's change them, its tokens through the Triton ops and
    CUDA graphs agree with the torch reference ops' (eager) on the same device, and the same
    adapter loaded at runtime into a free slot (after the capture) gives its tokens."""
    import tempfile

    from lantau import LLM, SamplingParams
    from lantau.engine.args import build_engine_config

    config = build_engine_config(args.model)[0].model_config
    root = tempfile.mkdtemp()
    write_adapter(f"{root}/brand", config, 1)
    write_adapter(f"{root}/zero", config, 2, zero_b=True)
    modules = [f"brand={root}/brand", f"zero={root}/zero"]
    outs, seconds = {}, {}
    for backend in ("triton", "torch"):
        llm = LLM(args.model, device=args.device, max_model_len=1024, max_num_seqs=64,
                  enforce_eager=backend == "torch", lora_modules=modules, max_loras=3,
                  attention_backend=backend if args.device != "cpu" else "torch")  # fmt: skip
        if backend == "triton":  # the same adapter again, into the free slot after capture
            llm.engine.core.load_adapter("late", f"{root}/brand")
        for lora in (None, "zero", "brand", "late"):
            if backend == "torch" and lora not in (None, "brand"):
                continue
            params = SamplingParams(temperature=0.0, max_tokens=16, lora=lora, logprobs=0)
            start = time.perf_counter()
            result = llm.generate(PROMPTS, params)
            seconds[(backend, lora)] = time.perf_counter() - start
            # the tokens, and the first token's logprob (random weights: greedy may not move)
            outs[(backend, lora)] = [
                (o.outputs[0].token_ids, round(o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]]
                                               .logprob, 3))
                for o in result
            ]  # fmt: skip
        del llm

    def agree(a, b) -> int:  # the same tokens and the same first logprob (to 1e-3)
        return sum(x == y for x, y in zip(outs[a], outs[b], strict=True))

    n = len(PROMPTS)
    zero_ok = agree(("triton", None), ("triton", "zero")) == n
    changed = n - agree(("triton", None), ("triton", "brand"))
    late_ok = agree(("triton", "brand"), ("triton", "late")) == n

    def same_tokens(lora) -> int:  # Triton ops + graphs against the torch ops, eager
        return sum(x[0] == y[0] for x, y in zip(outs[("triton", lora)], outs[("torch", lora)],
                                                strict=True))  # fmt: skip

    ref, ref_base = same_tokens("brand"), same_tokens(None)
    return [
        ("lora zero = base", f"{seconds[('triton', 'zero')]:.2f}",
         "ok" if zero_ok else "a zero adapter changed tokens"),
        ("lora adapter", f"{seconds[('triton', 'brand')]:.2f} / "
         f"{seconds[('torch', 'brand')]:.2f}",
         ("; ".join(p for p in (
             "" if changed >= n // 2 else f"the adapter changed only {changed}/{n}",
             "" if ref >= n * 0.75 else f"triton and torch ops agree on {ref}/{n}",
             "" if late_ok else "the adapter loaded at runtime is not the start-up one",
         ) if p) or f"ok (changed {changed}/{n}; triton = torch ops on {ref}/{n}")
         + f"; the base model's triton = torch ops on {ref_base}/{n}"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--atol", type=float, default=0.05, help="prompt logprobs, graphs vs eager")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from lantau import LLM, SamplingParams

    engines = {}
    for name, eager in (("graphs", False), ("eager", True)):
        if args.device == "cpu" and not eager:
            continue  # no graphs on CPU: the eager engine alone
        llm = LLM(args.model, device=args.device, max_model_len=1024, max_num_seqs=64,
                  enforce_eager=eager)  # fmt: skip
        eos = llm.engine.core.config.model_config.eos_token_ids[0]
        engines[name] = run_engine(llm, SamplingParams, eos)
        del llm
    rows = []
    base = next(iter(engines))
    for feature in engines[base]:
        problems = [
            f"{e}: {r[feature]['problem']}" for e, r in engines.items() if r[feature]["problem"]
        ]
        if len(engines) == 2:
            a, b = (engines[e][feature]["outs"] for e in engines)
            if feature in ("plain greedy", "logit_bias +100", "min_tokens 8, EOS"):
                same = sum(
                    x.outputs[0].token_ids == y.outputs[0].token_ids
                    for x, y in zip(a, b, strict=True)
                )
                if same < len(a) * 0.75:  # bf16 graphs vs eager: near ties may differ
                    problems.append(f"graphs and eager agree on {same}/{len(a)}")
            if feature == "prompt logprobs":
                worst = max(
                    abs(ex[t].logprob - ey[t].logprob)
                    for x, y in zip(a, b, strict=True)
                    for ex, ey, t in zip(
                        x.prompt_logprobs[1:],
                        y.prompt_logprobs[1:],
                        x.prompt_token_ids[1:],
                        strict=True,
                    )  # fmt: skip
                )
                if worst > args.atol:
                    problems.append(f"prompt logprobs differ by {worst:.3f}")
        times = " / ".join(f"{engines[e][feature]['seconds']:.2f}" for e in engines)
        rows.append((feature, times, "; ".join(problems) or "ok"))
    if not has_llguidance():
        rows.append(("json schema, regex", "-", "NOT RUN: llguidance is not installed"))
    rows += lora_rows(args)
    print(f"\n{args.model} on {args.device}; seconds for the set ({' / '.join(engines)})")
    print(f"{'feature':<20} {'seconds':>13}  check")
    for feature, times, verdict in rows:
        print(f"{feature:<20} {times:>13}  {verdict}")
    if args.out:
        import os

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_features.json"), "w") as f:
            json.dump(
                [dict(zip(("feature", "seconds", "check"), r, strict=True)) for r in rows],
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
