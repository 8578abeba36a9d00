"""The triton backend (fused kernels, run by the interpreter on CPU) gives the torch
backend's tokens and logits on a mixed batch: prefills, prefix hits, 16-token chunks, decodes."""

from __future__ import annotations

import random

import pytest
import torch

from lantau import LLM, SamplingParams


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
    ("fuse_decode", "fuse_gate_silu", "preload", "rope", "sums"),
    [
        (False, False, False, False, ""),
        (False, True, False, False, ""),
        (True, True, False, False, "handed"),
        (True, True, False, False, "summed"),
        (True, False, True, True, "handed"),
        (True, False, True, False, "folded"),
        (False, False, True, False, ""),
        (False, False, True, True, ""),
    ],
)
def test_triton_backend_small_batches_take_the_gemv_kernel(
    tiny_llama_dir, monkeypatch, fuse_decode, fuse_gate_silu, preload, rope, sums
):
    """Batch-1 steps run every projection through the GEMV kernel (with fuse_decode, the
    norms and residual adds folded into it and the SiLU-and-mul into gate_up's epilogue, and
    with rope the rotary and KV-cache write into qkv_proj's epilogue and decode attention's
    first KV tiles loaded apart; with fuse_gate_silu, the SiLU-and-mul into gate_up's
    epilogue; with preload, each program's weights loaded at once), with the torch backend's
    tokens and logits. sums: how each fused norm gets its row's sum of squares: handed over by
    the launch that wrote the row (ops.norm_sums), summed by the GEMV's programs, or handed
    over with the norm weights folded into the projections (fold_norm_weights)."""
    from lantau.kernels import gemv

    calls = []
    original = gemv.gemv
    monkeypatch.setattr(
        gemv,
        "gemv",
        lambda x, *a, **k: (calls.append((x.shape[0], *sorted(k))), original(x, *a, **k))[1],
    )

    def configure(model):  # the torch ops ignore these
        ops = model.ops
        ops.fuse_decode, ops.fuse_gate_silu, ops.gemv_preload = fuse_decode, fuse_gate_silu, preload
        ops.fuse_qkv_rope = rope
        ops.attn_early_kv_rows = 8 if rope else 0  # decode attention's first tiles apart too
        ops.norm_sums = sums != "summed"
        if sums == "folded" and ops.name == "triton":
            model.fold_norm_weights()

    results = _small_batches_both_backends(tiny_llama_dir, configure, seed=5)
    assert calls and {c[0] for c in calls} == {1}  # batch 1 only (ops.gemv_max_m)
    fusions = {c[1:] for c in calls}  # per layer: qkv and gate_up after a norm, o and down
    norm = ("eps", "norm", "norm_weight")  # a norm folded in, with its weight
    if fuse_decode and rope and preload:
        assert fusions == {
            (*norm, "preload", "rope", "sumsq"),  # qkv_proj
            ("eps", "gated", "norm", "norm_weight", "preload", "sumsq"),  # gate_up_proj
            (*norm, "preload", "sumsq"),  # lm_head after a decode step
            (*norm, "preload"),  # lm_head after a prefill's: its last row's sum not handed
            ("preload", "residual", "sumsq_out"),  # o_proj, down_proj
        }
    elif sums == "folded":  # the weights in the projections' (the tiny lm_head is not tied)
        assert fusions == {
            ("eps", "norm", "preload", "sumsq"),  # qkv_proj, lm_head after a decode step
            ("eps", "gated", "norm", "preload", "sumsq"),  # gate_up_proj
            ("eps", "norm", "preload"),  # lm_head after a prefill
            ("preload", "residual", "sumsq_out"),
        }
    elif sums == "summed":
        assert fusions == {norm, ("eps", "gated", "norm", "norm_weight"), ("residual",)}
    elif rope and preload:  # rotary and KV write in qkv_proj's epilogue, the norms apart
        assert fusions == {("preload", "rope"), ("preload",)}
    elif fuse_decode:  # qkv_proj and lm_head, gate_up_proj, o_proj and down_proj
        assert fusions == {
            (*norm, "sumsq"), norm, ("eps", "gated", "norm", "norm_weight", "sumsq"),
            ("residual", "sumsq_out"),
        }  # fmt: skip
    elif fuse_gate_silu:
        assert fusions == {(), ("gated",)}
    elif preload:  # every K of the tiny model is within ops.preload_max_k
        assert fusions == {("preload",)}
    else:
        assert fusions == {()}
    _assert_same_tokens_and_logits(results)


def test_triton_backend_rope_inside_decode_attention(tiny_llama_dir, monkeypatch):
    """fuse_rope_attention: decode steps of up to attn_early_kv_rows rows rotate and write the
    KV cache inside the attention launch (no rotary launch); prefill steps keep the rotary
    kernel; tokens and logits as the torch backend's, batch 1 and 3."""
    from lantau.kernels import paged_attention, rotary

    rotary_rows, rope_rows = [], []
    original_rotary = rotary.apply_rotary_and_write_kv
    original_attn = paged_attention.paged_decode_attention

    def counting_rotary(q, *args, **kwargs):
        rotary_rows.append(q.shape[0])
        return original_rotary(q, *args, **kwargs)

    def counting_attn(q, *args, **kwargs):
        if kwargs.get("rope") is not None:
            rope_rows.append(q.shape[0])
        return original_attn(q, *args, **kwargs)

    monkeypatch.setattr(rotary, "apply_rotary_and_write_kv", counting_rotary)
    monkeypatch.setattr(paged_attention, "paged_decode_attention", counting_attn)

    def configure(model):  # the torch ops ignore these
        model.ops.fuse_rope_attention, model.ops.attn_early_kv_rows = True, 8

    results = _small_batches_both_backends(tiny_llama_dir, configure, seed=6)
    assert set(rope_rows) == {1, 3}  # decode steps of one and three requests
    assert rotary_rows and all(rows > 3 for rows in rotary_rows)  # prefills only
    _assert_same_tokens_and_logits(results)


def _small_batches_both_backends(tiny_llama_dir, configure, seed: int) -> dict:
    """backend -> (greedy tokens, last logits) of one request alone, then three together, with
    configure(model) applied to each backend's model first."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 23, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
            attention_backend=backend,
        )  # fmt: skip
        configure(llm.engine.core.runner.model)
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


def test_gemv_register_cap_reaches_the_preloading_launches(monkeypatch):
    """ops.gemv_maxnreg goes to every preloading GEMV launch (and to no other); off, the launch
    takes no cap."""
    from lantau.kernels import gemv
    from lantau.model.ops import TritonOps

    caps = []
    original = gemv.gemv
    monkeypatch.setattr(
        gemv, "gemv", lambda *a, **k: (caps.append(k.get("maxnreg")), original(*a, **k))[1]
    )
    ops = TritonOps()
    layer = torch.nn.Linear(64, 16, bias=False)
    x = torch.randn(1, 64)
    expected = layer(x)
    for cap in (None, 168):
        ops.gemv_maxnreg = cap
        torch.testing.assert_close(ops.linear(x, layer), expected, rtol=1e-5, atol=1e-5)
    ops.gemv_preload = False  # the K-loop launch: never capped
    ops.linear(x, layer)
    assert caps == [None, 168, None]


@pytest.mark.parametrize("name", ["tiny_dir", "random:tiny"])
def test_fold_norm_weights_keeps_the_model(tiny_llama_dir, name):
    """The norms' weights multiplied into the projections after them (fold_norm_weights): the
    same greedy tokens and logits (fp32), through the triton backend's fused batch-1 path (the
    torch backend's for the tied model: its 49k-row lm_head is slow in the interpreter); a
    lm_head tied to the embedding keeps the final norm's weight; weights no longer load."""
    from lantau.errors import ModelLoadError

    llm = LLM(
        str(tiny_llama_dir) if name == "tiny_dir" else name, device="cpu", dtype="float32",
        num_kv_blocks=64, max_model_len=512,
        attention_backend="triton" if name == "tiny_dir" else "torch",
    )  # fmt: skip
    model = llm.engine.core.runner.model
    model.ops.fuse_decode = True
    prompt = {"prompt_token_ids": [5, 9, 33, 7, 100, 2]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run():
        llm.reset_prefix_cache()
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
        return tokens, list(llm.engine.core.runner.last_logits.values())

    norms = [
        n
        for layer in model.model.layers
        for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    with torch.no_grad():  # weights not all ones, so that folding them changes the projections
        for n in (*norms, model.model.norm):
            n.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    tokens, logits = run()
    model.fold_norm_weights()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (name == "random:tiny") and model.model.norm.folded != tied
    assert all(n.folded and torch.equal(n.weight, torch.ones_like(n.weight)) for n in norms)
    folded_tokens, folded_logits = run()
    assert folded_tokens == tokens
    assert logits and len(folded_logits) == len(logits)
    for out, ref in zip(folded_logits, logits, strict=True):
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ModelLoadError, match="folded"):
        model.load_weights([])


def test_norm_sums_left_clean(tiny_llama_dir):
    """The fused batch-1 path's sums of squares (NormSums): a step leaves only the final norm's
    slot set (the next step's embedding zeroes it), and a step cut short by an error, none."""
    from types import SimpleNamespace

    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
        attention_backend="triton",
    )  # fmt: skip
    model = llm.engine.core.runner.model
    model.ops.fuse_decode = True
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 9, 33]}, params)
    sums = model._norm_sums.sums
    assert sums.shape == (2 * len(model.model.layers) + 1,)
    assert not sums[:-1].any() and sums[-1].item() > 0
    with torch.inference_mode(), pytest.raises(AttributeError):  # a context without positions
        model(torch.tensor([7]), SimpleNamespace())
    assert not sums.any()
