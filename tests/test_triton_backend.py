"""The triton backend (fused kernels, run by the interpreter on CPU) gives the torch
backend's tokens and logits on a mixed batch: prefills, prefix hits, 16-token chunks, decodes."""

from __future__ import annotations

import random

import pytest

from lantau import LLM, SamplingParams
from lantau.config import KernelConfig


def test_triton_backend_matches_torch(tiny_llama_dir):
    rng = random.Random(2)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # a prefix shared by half the prompts
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]
        for i in range(6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
            max_num_batched_tokens=16, attention_backend=backend,
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        logits = dict(llm.engine.core.runner.last_logits)
        results[backend] = ([o.outputs[0].token_ids for o in outputs], logits, outputs)
    assert results["triton"][0] == results["torch"][0]
    assert any(o.num_cached_tokens > 0 for o in results["triton"][2])
    for key, ref in results["torch"][1].items():
        assert (results["triton"][1][key] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    # each switch on and off once: the default path, and both off
    ("gate_silu", "preload_max_bytes"),
    [(True, 8192), (False, 0)],
)
def test_triton_backend_small_batches_take_the_gemv_kernel(
    tiny_llama_dir, monkeypatch, gate_silu, preload_max_bytes
):
    """Batch-1 steps run every projection through the GEMV kernel (gate_up's with the
    SiLU-and-mul in its epilogue with enable_gate_silu; each program's weights loaded at once
    when a weight row is within gemv_preload_max_bytes), with the torch backend's tokens and
    logits; decode steps of up to attn_small_rows rows rotate and write the KV cache inside
    the attention launch (no rotary launch), prefill steps keep the rotary kernel."""
    from lantau.kernels import decode_attention, gemv, rotary

    calls, rotary_rows, rope_rows = [], [], []
    original_gemv = gemv.gemv
    original_rotary = rotary.apply_rotary_and_write_kv
    original_attn = decode_attention.paged_decode_attention

    def counting_gemv(x, *args, **kwargs):
        calls.append((x.shape[0], kwargs["gated"], kwargs.get("preload", False)))
        return original_gemv(x, *args, **kwargs)

    def counting_rotary(q, *args, **kwargs):
        rotary_rows.append(q.shape[0])
        return original_rotary(q, *args, **kwargs)

    def counting_attn(q, *args, **kwargs):
        if kwargs.get("rope") is not None:
            rope_rows.append(q.shape[0])
        return original_attn(q, *args, **kwargs)

    monkeypatch.setattr(gemv, "gemv", counting_gemv)
    monkeypatch.setattr(rotary, "apply_rotary_and_write_kv", counting_rotary)
    monkeypatch.setattr(decode_attention, "paged_decode_attention", counting_attn)
    kernels = KernelConfig(enable_gate_silu=gate_silu, gemv_preload_max_bytes=preload_max_bytes)
    results = _small_batches_both_backends(tiny_llama_dir, kernels, seed=5)
    assert calls and {c[0] for c in calls} == {1}  # batch 1 only
    # every row of the tiny model is within 8 KB
    assert {c[1:] for c in calls} == {(g, preload_max_bytes > 0) for g in {False, gate_silu}}
    assert set(rope_rows) == {1, 3}  # decode steps of one and three requests
    assert rotary_rows and all(rows > 3 for rows in rotary_rows)  # prefills only
    _assert_same_tokens_and_logits(results)


def _small_batches_both_backends(tiny_llama_dir, kernels: KernelConfig, seed: int) -> dict:
    """backend -> (greedy tokens, last logits) of one request alone, then three together (the
    triton backend under `kernels`)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 23, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
            attention_backend=backend, kernels=kernels,
        )  # fmt: skip
        tokens, logits = [], []
        for n in (1, 3):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params)
            tokens.append([o.outputs[0].token_ids for o in outs])
            logits.append(dict(llm.engine.core.runner.last_logits))
        results[backend] = (tokens, logits)
    return results


def _assert_same_tokens_and_logits(results: dict) -> None:
    assert results["triton"][0] == results["torch"][0]
    for ref_step, out_step in zip(results["torch"][1], results["triton"][1], strict=True):
        for key, ref in ref_step.items():
            err = ((out_step[key] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (key, err)
