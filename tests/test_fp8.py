"""FP8 (e4m3) weights: the quantize / dequantize math against its definition, the per-token
quantization kernel and the e4m3 GEMV against their torch references (Triton interpreter on
CPU), `_scaled_mm` against the fp32 emulation, loading and random drawing in e4m3, both
backends on an fp8 model, and `dtype="fp8"` from the edge to the engine."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from lantau import LLM, SamplingParams  # noqa: E402
from lantau.engine.args import build_engine_config  # noqa: E402
from lantau.kernels.fp8_quant import quantize_rows as quantize_rows_kernel  # noqa: E402
from lantau.kernels.gemv import gemv  # noqa: E402
from lantau.kernels.reference import gemv_ref  # noqa: E402
from lantau.model import fp8  # noqa: E402
from lantau.model.fp8 import E4M3, E4M3_MAX, Fp8Linear, dequantize_rows, quantize_rows  # noqa: E402
from lantau.model.loader import _default_dtype  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_quantize_rows_definition():
    """Each row's largest magnitude maps to +-448 exactly; every element is within half an
    e4m3 step (3 mantissa bits: 2^-4 relative) of its value; an all-zero row stays zero."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 100, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    t[3] = 0.0
    q, scale = quantize_rows(t)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert torch.all(q[3].float() == 0) and scale[3] == fp8.MIN_SCALE
    nonzero = [0, 1, 2, 4, 5]
    torch.testing.assert_close(scale[nonzero], t[nonzero].abs().amax(-1) / E4M3_MAX)
    assert torch.all(q[nonzero].float().abs().amax(-1) == E4M3_MAX)
    back = dequantize_rows(q, scale)
    # normal e4m3 values (|q| >= 2^-6): half a step is 2^-4 of the value
    normal = q.float().abs() >= 2**-6
    assert torch.all((back - t).abs()[normal] <= t.abs()[normal] * 2**-4 + 1e-30)
    assert rel_err(back, t) < 0.03
    assert dequantize_rows(q, scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.usefixtures("interpreter_fp8_cast")  # see tests/conftest.py
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k"), [(1, 7), (3, 100), (2, 5000)])
def test_quantize_rows_kernel_matches_reference(dtype, m, k):
    """The Triton kernel's e4m3 bits and scales equal the torch reference's (K past one tile:
    5,000 > 4,096 loops twice), also for a row slice of a wider buffer."""
    gen = torch.Generator().manual_seed(m * k)
    buf = (torch.randn(m, k + 3, generator=gen) * 5).to(dtype)
    x = buf[:, :k]
    q, scale = quantize_rows_kernel(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.shape == (m, k) and q.dtype == E4M3
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.usefixtures("interpreter_fp8_cast")
@pytest.mark.parametrize(("m", "k"), [(3, 96), (2, 5000), (1, 28672), (1, 33000)])
def test_kernels_quantize_their_output_as_written(m, k):
    """RMSNorm, the fused residual add + RMSNorm (also of an unscaled product) and SiLU-and-mul
    with `quant`: their outputs as without it, and the quantized rows' e4m3 bits and scales
    those of quantize_rows on that output (SiLU-and-mul's row held in registers up to 32,768
    values, 70B's 28,672 included, in two passes of 4,096-value tiles past that: 33,000). With
    store=False: the same quantized rows and nothing else written (but SiLU-and-mul's two-pass
    rows, read back)."""
    from lantau.kernels import activation, fp8_quant, rms_norm

    gen = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight = (1 + torch.randn(k, generator=gen) / 4).to(torch.bfloat16)
    row_scale, col_scale = torch.rand(m, generator=gen) + 0.5, torch.rand(k, generator=gen) + 0.5

    def check(out, quant):
        q_ref, s_ref = quantize_rows(out)
        torch.testing.assert_close(quant[1], s_ref, rtol=0, atol=0)
        assert torch.equal(quant[0].view(torch.uint8), q_ref.view(torch.uint8))

    def check_unstored(quant, op, *args, **kwargs):
        """op(*args, **kwargs) with store=False quantizes as it did into quant."""
        alone = fp8_quant.empty_quantized(m, k, "cpu")
        op(*args, **kwargs, quant=alone, store=False)
        assert torch.equal(alone[0].view(torch.uint8), quant[0].view(torch.uint8))
        assert torch.equal(alone[1], quant[1])

    quant = fp8_quant.empty_quantized(m, k, "cpu")
    out = rms_norm.rms_norm(x, weight, 1e-5, quant=quant)
    assert torch.equal(out, rms_norm.rms_norm(x, weight, 1e-5))
    check(out, quant)
    unwritten = torch.full_like(x, 7.0)
    check_unstored(quant, rms_norm.rms_norm, x, weight, 1e-5, out=unwritten)
    assert torch.equal(unwritten, torch.full_like(x, 7.0))
    for scales in ({}, dict(row_scale=row_scale, col_scale=col_scale)):
        plain, plain_res = x.clone(), residual.clone()
        rms_norm.fused_add_rms_norm(plain, plain_res, weight, 1e-5, **scales)
        fused, fused_res = x.clone(), residual.clone()
        quant = fp8_quant.empty_quantized(m, k, "cpu")
        rms_norm.fused_add_rms_norm(fused, fused_res, weight, 1e-5, **scales, quant=quant)
        assert torch.equal(fused, plain) and torch.equal(fused_res, plain_res)
        check(fused, quant)
        kept, kept_res = x.clone(), residual.clone()
        check_unstored(quant, rms_norm.fused_add_rms_norm, kept, kept_res, weight, 1e-5, **scales)
        assert torch.equal(kept, x) and torch.equal(kept_res, plain_res)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).to(torch.bfloat16)
    col_scale2 = torch.rand(2 * k, generator=gen) + 0.5
    for scales in ({}, dict(row_scale=row_scale, col_scale=col_scale2)):
        quant = fp8_quant.empty_quantized(m, k, "cpu")
        out = activation.silu_and_mul(gate_up, **scales, quant=quant)
        assert torch.equal(out, activation.silu_and_mul(gate_up, **scales))
        check(out, quant)
        unwritten = torch.full_like(out, 7.0)
        check_unstored(quant, activation.silu_and_mul, gate_up, **scales, out=unwritten)
        two_pass = 1 << (k - 1).bit_length() > activation.MAX_QUANT_ROW
        assert torch.equal(unwritten, out if two_pass else torch.full_like(out, 7.0))
    with pytest.raises(AssertionError, match="quantized rows must be"):
        rms_norm.rms_norm(x, weight, 1e-5, quant=fp8_quant.empty_quantized(m, k + 1, "cpu"))


def make_fp8_layer(
    n: int, k: int, bias: bool, gen: torch.Generator
) -> tuple[Fp8Linear, torch.Tensor]:
    with _default_dtype(torch.bfloat16):  # NOTE: not .to(bf16), which would widen the e4m3
        layer = Fp8Linear(k, n, bias)
    wide = torch.randn(n, k, generator=gen) / k**0.5
    layer.load_rows(slice(None), wide)
    if bias:
        layer.bias.data = torch.randn(n, generator=gen).to(torch.bfloat16)
    return layer, wide


@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_matches_the_fp32_emulation(bias):
    """What the triton backend runs (`_scaled_mm`, row-wise scales; CPU here, CUDA on a GPU)
    equals the torch backend's fp32 emulation up to bf16 rounding, and both are within fp8's
    error of the unquantized product."""
    gen = torch.Generator().manual_seed(1)
    layer, wide = make_fp8_layer(48, 64, bias, gen)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    emulated = fp8.fp8_linear_ref(x, layer)
    scaled_mm = fp8.fp8_linear_scaled_mm(x, layer)
    assert scaled_mm.dtype == emulated.dtype == torch.bfloat16
    assert rel_err(scaled_mm, emulated) < 8e-3
    exact = x.float() @ wide.T + (layer.bias.float() if bias else 0)
    assert rel_err(emulated, exact) < 0.06
    dense = x.float() @ dequantize_rows(layer.weight, layer.weight_scale).T
    dense = dense + (layer.bias.float() if bias else 0)
    assert rel_err(dense, exact) < 0.04  # the weights' error alone: less than both quantized


@pytest.mark.usefixtures("interpreter_bf16_dot")
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000), (6, 5000)])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_gemv_matches_reference(n, k, gated):
    """The batch-1 GEMV reading e4m3 weights and applying each row's scale after the sum:
    the K loop and the preload, with and without the SiLU-and-mul epilogue and a bias, ragged
    shapes masked, against the dequantized fp32 reference."""
    gen = torch.Generator().manual_seed(n + k)
    n -= n % 2 if gated else 0
    layer, _ = make_fp8_layer(n, k, not gated, gen)
    w, s, b = layer.weight, layer.weight_scale, layer.bias
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    ref = gemv_ref(x, w, b, gated=gated, weight_scale=s)
    for config, preload in [
        (None, False),
        ((8, 64, 4, 2), False),
        (None, True),
        ((2, 0, 2, 1), True),
    ]:
        out = gemv(x, w, b, config, gated=gated, preload=preload, weight_scale=s)
        assert out.shape == (1, n // 2 if gated else n) and out.dtype == torch.bfloat16
        assert rel_err(out, ref) < 2e-2, (config, preload)
    with pytest.raises(AssertionError, match="weight_scale"):
        gemv(x, w, b, weight_scale=s[:-1])
    with pytest.raises(AssertionError, match="dtype|float"):
        gemv(x, w, b)  # e4m3 without its scales


@pytest.mark.usefixtures("interpreter_bf16_dot")
def test_batch1_gemv_preloads_rows_of_up_to_8kb(monkeypatch):
    """The triton backend preloads a batch-1 GEMV's weights by a row's bytes: an e4m3 row of
    K = 8,192 (the 70B's projections) is 8 KB and preloads, as a bf16 row of 4,096 does; a bf16
    row of 8,192 loops over K. Each result against the reference."""
    from lantau.kernels import gemv as gemv_module
    from lantau.model.ops import TritonOps

    preloads = []
    original = gemv_module.gemv

    def spying_gemv(*args, **kwargs):
        preloads.append(kwargs.get("preload", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", spying_gemv)
    gen = torch.Generator().manual_seed(8)
    ops = TritonOps()
    fp8_layer, _ = make_fp8_layer(6, 8192, False, gen)
    with _default_dtype(torch.bfloat16):
        bf16_layers = [torch.nn.Linear(k, 6, bias=False) for k in (4096, 8192)]
    for layer in [fp8_layer, *bf16_layers]:
        x = torch.randn(1, layer.weight.shape[1], generator=gen).to(torch.bfloat16)
        scale = getattr(layer, "weight_scale", None)
        ref = gemv_ref(x, layer.weight.detach(), weight_scale=scale)
        assert rel_err(ops.linear(x, layer), ref) < 2e-2
    assert preloads == [True, True, False]


def test_load_quantizes_each_weight_and_random_draws_match_bf16(tiny_llama_dir):
    """A bf16 checkpoint read with dtype="fp8": every decoder projection is e4m3 with one scale
    a row, within fp8's error of the checkpoint's weight; embedding, norms and lm_head stay
    bf16. A random fp8 model is the same seed's bf16 model quantized (the same draws, one
    layer at a time)."""
    from lantau.model.hf_loader import iter_hf_weights

    llm = LLM(str(tiny_llama_dir), dtype="fp8", device="cpu", num_kv_blocks=64)
    model = llm.engine.core.runner.model
    hf = dict(iter_hf_weights(tiny_llama_dir))
    layer = model.model.layers[1]
    for fused, names in [
        (layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]),
        (layer.mlp.gate_up_proj, ["gate_proj", "up_proj"]),
    ]:
        assert isinstance(fused, Fp8Linear) and fused.weight.dtype == E4M3
        group = "self_attn" if "q_proj" in names else "mlp"
        wide = torch.cat([hf[f"model.layers.1.{group}.{name}.weight"] for name in names])
        assert rel_err(dequantize_rows(fused.weight, fused.weight_scale), wide) < 0.03
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16

    from lantau.model.loader import ModelSource, build_model, read_model_config

    source = ModelSource("random", None, "random:tiny")
    config = read_model_config(source)
    fp8_config = dataclasses.replace(config, quantization="fp8")
    dense = build_model(source, config, torch.bfloat16, torch.device("cpu"), seed=3)
    quant = dict(
        build_model(
            source, fp8_config, torch.bfloat16, torch.device("cpu"), seed=3
        ).named_parameters()
    )
    for name, p in dense.named_parameters():
        q = quant[name]
        if q.dtype == E4M3:
            want_q, want_s = quantize_rows(p)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), name
            assert torch.equal(quant[f"{name}_scale"], want_s), name
        else:
            assert torch.equal(p, q), name


@pytest.mark.usefixtures("interpreter_bf16_dot", "interpreter_fp8_cast")
def test_fp8_backends_agree(tiny_llama_dir, monkeypatch):
    """On an fp8 model the triton backend (the prefill's rows through the per-token
    quantization kernel and `_scaled_mm`, batch-1 decode through the e4m3 GEMV) gives the torch
    backend's greedy tokens, and logits close to them. NOTE: the two bf16 backends already
    differ by 1.8 % here (fused kernels round elsewhere); a difference that moves an activation
    across an e4m3 rounding boundary moves it by a whole step (up to 6 %), so fp8 widens that
    to about 8-11 %."""
    from lantau.kernels import gemv as gemv_module

    calls = {"gemv": [], "scaled_mm": 0}
    original_gemv, original_mm = gemv_module.gemv, fp8.fp8_linear_scaled_mm

    def spying_gemv(x, weight, *args, **kwargs):
        calls["gemv"].append(kwargs.get("weight_scale") is not None or weight.dtype != E4M3)
        return original_gemv(x, weight, *args, **kwargs)

    def spying_mm(x, *args, **kwargs):
        calls["scaled_mm"] += x.shape[0] > 1
        return original_mm(x, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", spying_gemv)
    monkeypatch.setattr(fp8, "fp8_linear_scaled_mm", spying_mm)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), dtype="fp8", device="cpu", num_kv_blocks=64,
            attention_backend=backend,
        )  # fmt: skip
        outputs = llm.generate({"prompt_token_ids": [5, 17, 300, 41, 9]}, params)
        logits = dict(llm.engine.core.runner.last_logits)  # the last decode step's
        results[backend] = (outputs[0].outputs[0].token_ids, logits)
    # the prefill's: 4 in the first layer, the last one's qkv (its other 3 take the GEMV on
    # the one row that samples: ForwardContext.keep)
    assert calls["gemv"] and all(calls["gemv"]) and calls["scaled_mm"] == 5
    assert results["triton"][0] == results["torch"][0]
    for key, ref in results["torch"][1].items():
        assert rel_err(results["triton"][1][key], ref) < 0.15


def test_dtype_fp8_config_and_errors(monkeypatch):
    """dtype="fp8": bf16 activations and e4m3 weights in the frozen config (no torch needed);
    a GPU without row-wise FP8 matmuls is refused by name."""
    config, _ = build_engine_config("random:tiny", dtype="fp8", device="cpu")
    assert config.dtype == "bfloat16" and config.model_config.quantization == "fp8"
    config, _ = build_engine_config("random:tiny", dtype="auto", device="cpu")
    assert config.dtype == "float32" and config.model_config.quantization is None
    with pytest.raises(ValueError, match="fp8"):
        build_engine_config("random:tiny", dtype="fp4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"8\.9 or newer.*A100 is 8\.0"):
        fp8.check_device(torch.device("cuda"))
    fp8.check_device(torch.device("cpu"))


def test_cli_takes_dtype_fp8(monkeypatch):
    """`lantau serve` and `lantau bench offline` list fp8 among their dtypes and pass it on;
    anything else is refused before an engine starts."""
    from lantau import cli

    seen = {}
    monkeypatch.setattr(cli, "serve", lambda args: seen.setdefault("serve", args.dtype) and 0)
    monkeypatch.setattr(cli, "bench", lambda args: seen.setdefault("bench", args.dtype) and 0)
    cli.main(["serve", "--dtype", "fp8"])
    cli.main(["bench", "offline", "--dtype", "fp8"])
    assert seen == {"serve": "fp8", "bench": "fp8"}
    for argv in (["serve", "--dtype", "fp4"], ["bench", "offline", "--dtype", "int8"]):
        with pytest.raises(SystemExit):
            cli.main(argv)


def test_fp8_qwen2_biases_and_tied_embeddings(tmp_path):
    """A Qwen2-shaped checkpoint (q/k/v biases, which stay in the activation dtype beside the
    e4m3 weights) and a tied lm_head load with dtype="fp8", and stay near the fp32 model."""
    import transformers

    from lantau.bench import accuracy
    from tests.conftest import TINY_LLAMA, save_tiny_hf_model

    common = {k: v for k, v in TINY_LLAMA.items() if not k.endswith("_token_id")}
    config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    save_tiny_hf_model(tmp_path, config)
    ids = list(range(3, 40))
    logits = {}
    for dtype in ("float32", "fp8"):
        llm = LLM(str(tmp_path), dtype=dtype, device="cpu", num_kv_blocks=64)
        model = llm.engine.core.runner.model
        logits[dtype] = accuracy.sequence_logits(model, ids)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.bias.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert rel_err(logits["fp8"], logits["float32"]) < 0.3  # measured 0.20 (chaotic: init 0.2)


def test_fp8_load_streams_one_tensor_at_a_time(tiny_llama_dir):
    """Loading with dtype="fp8" keeps no checkpoint tensor once the next is read: host memory
    stays within one tensor (a 70B checkpoint streams through, quantized on the device)."""
    import weakref

    from lantau.model.hf_loader import iter_hf_weights
    from lantau.model.loader import ModelSource, build_model, read_model_config

    source = ModelSource("hf", tiny_llama_dir, str(tiny_llama_dir))
    config = dataclasses.replace(read_model_config(source), quantization="fp8")
    with _default_dtype(torch.bfloat16):
        model = build_model(source, config, torch.bfloat16, torch.device("cpu"), seed=0)
    seen: list[weakref.ref] = []

    def watched():
        for name, tensor in iter_hf_weights(tiny_llama_dir):
            # the loop variable may hold the one before; none older may be alive
            assert all(ref() is None for ref in seen[:-1]), name
            seen.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    model.load_weights(watched())
    assert len(seen) > 10


def test_bench_offline_fp8_cli(tmp_path):
    """`lantau bench offline --dtype fp8` end to end on CPU: the run, and its dtype recorded."""
    import json
    import subprocess
    import sys

    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "lantau.cli", "bench", "offline", "--model", "random:tiny",
        "--dtype", "fp8", "--workload", "in:24/out:6", "--num-prompts", "3", "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["dtype"] == "fp8" and result["lantau"]["output_tokens"] == 18


@pytest.mark.usefixtures("interpreter_bf16_dot", "interpreter_fp8_cast")
def test_tensorwise_products_scaled_by_their_readers(tiny_llama_dir, monkeypatch):
    """KernelConfig.fp8_tensorwise_rows: every projection's product of 2 rows and more left
    unscaled (a tensor-wise `_scaled_mm`), its row and column scales applied by its reader:
    rotary and the KV write (qkv), SiLU-and-mul (gate_up), the residual add + norm (o_proj,
    down_proj; the last layer's by the final norm, or before the residual add where the
    forward returns the stream unnormalised). Teacher-forced (the prompts' logprobs, every
    prompt row through it), they stay as close to the torch backend's fp32 emulation as the
    row-wise products do (the raw product is rounded to bf16 before its scales, the row-wise
    one after: random weights put tokens at near-ties, so sampled tokens are not compared)."""
    from lantau.config import KernelConfig

    calls = []
    original = fp8.unscaled_mm

    def spying(xq, wq, out_dtype=torch.bfloat16):
        calls.append((xq.shape[0], *wq.shape))  # rows, N, K
        return original(xq, wq, out_dtype)

    monkeypatch.setattr(fp8, "unscaled_mm", spying)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    # 3 tokens: decode steps of 3 rows run it too (the last layer's product scaled by the
    # final norm), though only the prompts' logprobs are compared
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)
    logprobs = {}
    for name, backend, rows in (
        ("torch", "torch", (0, 0)), ("rowwise", "triton", (0, 0)),
        ("tensorwise", "triton", (2, 1 << 20)),
    ):  # fmt: skip
        llm = LLM(
            str(tiny_llama_dir), dtype="fp8", device="cpu", num_kv_blocks=64,
            attention_backend=backend, kernels=KernelConfig(fp8_tensorwise_rows=rows),
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        logprobs[name] = torch.tensor(
            [
                lp[token].logprob
                for out, prompt in zip(outputs, prompts, strict=True)
                for lp, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
            ]
        )
        assert bool(calls) == (name == "tensorwise")
    config = llm.engine.core.runner.model.config
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    assert {(n, k) for _, n, k in calls} == {
        (qkv_rows, hidden), (2 * inter, hidden), (hidden, q_size), (hidden, inter),
    }  # fmt: skip
    assert min(m for m, _, _ in calls) >= 2
    rowwise = (logprobs["rowwise"] - logprobs["torch"]).abs().mean().item()
    tensorwise = (logprobs["tensorwise"] - logprobs["torch"]).abs().mean().item()
    assert tensorwise <= 1.5 * rowwise + 1e-3


@pytest.mark.usefixtures("interpreter_bf16_dot", "interpreter_fp8_cast")
def test_projection_inputs_quantized_by_their_writers(tiny_llama_dir, monkeypatch):
    """KernelConfig.fuse_fp8_quant (the default): the inputs of qkv, gate_up and down_proj
    come quantized from the RMSNorms and SiLU-and-mul, so quantize_rows runs for o_proj's
    alone (steps of more than one row; batch-1 decode reads bf16 through the GEMV), and the
    tokens and the prompts' logprobs are those of the launch-a-projection path exactly (the
    same e4m3 bits), with the tensor-wise products too."""
    from lantau.config import KernelConfig
    from lantau.kernels import fp8_quant

    widths = []
    original = fp8_quant.quantize_rows

    def spying(x, use_pdl=True):
        widths.append(x.shape[1])
        return original(x, use_pdl)

    monkeypatch.setattr(fp8_quant, "quantize_rows", spying)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (11, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    for rows in ((0, 0), (2, 1 << 20)):
        results, counts = {}, {}
        for fuse in (False, True):
            widths.clear()
            llm = LLM(
                str(tiny_llama_dir), dtype="fp8", device="cpu", num_kv_blocks=64,
                attention_backend="triton",
                kernels=KernelConfig(fuse_fp8_quant=fuse, fp8_tensorwise_rows=rows),
            )  # fmt: skip
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            results[fuse] = [
                (o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(
                    o.prompt_logprobs[1:], p[1:], strict=True)])
                for o, p in zip(outputs, prompts, strict=True)
            ]  # fmt: skip
            config = llm.engine.core.runner.model.config
            counts[fuse] = len(widths)
        q_size = config.num_attention_heads * config.head_dim
        assert set(widths) == {q_size}  # the fused run's: o_proj's input
        assert counts[False] == 4 * counts[True] > 0  # 4 projections a layer, 1 left
        assert results[True] == results[False]


def test_silu_quant_row_fits_registers_on_hopper():
    """The quantizing SiLU-and-mul's one-pass rows as the launcher builds them (32 warps):
    llama3-70b's 28,672 values (a 32,768 block, MAX_QUANT_ROW) compile for sm90 without
    spilling, in at most 64 registers a thread (one program an SM), stored or not, scaled or
    not; llama3-8b's 16,384 block in at most 32 (two programs an SM), scaled with the launch's
    register cap (a few bytes spilled), which applies past one wave of SMs only."""
    from lantau.kernels import activation
    from tests.compiled import run_compiled

    cpu = torch.device("cpu")  # the interpreter's SM count: 132
    assert activation._register_cap(True, True, 16384, 384, cpu) == {"maxnreg": 32}
    assert activation._register_cap(True, True, 16384, 128, cpu) == {}
    assert activation._register_cap(True, False, 16384, 384, cpu) == {}
    assert activation._register_cap(True, True, 32768, 384, cpu) == {}

    block = activation.MAX_QUANT_ROW
    code = f"""
from sass_loops import compile_sm90, register_use
from lantau.kernels.activation import _silu_and_mul_quant_kernel
types = dict(x_ptr="*bf16", out_ptr="*bf16", row_scale_ptr="*fp32", col_scale_ptr="*fp32",
             q_ptr="*fp8e4nv", q_scale_ptr="*fp32")
for block, scaled, store, cap in [({block}, False, False, {{}}), ({block}, True, False, {{}}),
                                  ({block}, True, True, {{}}), (16384, False, False, {{}}),
                                  (16384, True, False, dict(maxnreg=32))]:
    kernel = compile_sm90(_silu_and_mul_quant_kernel, types, dict(BLOCK_SIZE=block, USE_PDL=True,
        SCALED=scaled, ONE_PASS=True, STORE=store), num_warps=32, num_stages=3,
        ints=("x_row_stride", "out_row_stride", "d"), **cap)
    print(block, *register_use(kernel))
"""
    rows = [[int(v) for v in line.split()] for line in run_compiled(code).splitlines()]
    assert len(rows) == 5 and activation.MAX_QUANT_ROW >= 28672
    for block, registers, spills in rows[:4]:
        assert spills == 0, rows
        assert registers <= (32 if block <= 16384 else 64), rows
    assert rows[4][1] <= 32 and rows[4][2] <= 16, rows  # the capped scaled row


def test_scaled_readers_compile_for_hopper():
    """The readers of an unscaled fp8 product (fp8_tensorwise_rows): SiLU-and-mul and the
    fused residual add + RMSNorm with their row and column scales, and the writers of an fp8
    projection's quantized input (fuse_fp8_quant: both RMSNorms and SiLU-and-mul with
    `quant`; quantize_rows), compile to sm90 cubin with Triton's own ptxas (no
    GPU needed; the rotary kernel's both ways are in tests/test_fp8_kv_cache.py's compile
    test)."""
    from tests.compiled import run_compiled

    quant = dict(q_ptr="*fp8e4nv", q_scale_ptr="*fp32")
    silu = dict(x_ptr="*bf16", out_ptr="*bf16", row_scale_ptr="*fp32", col_scale_ptr="*fp32")
    kernels = [  # (kernel, argument types, constexprs)
        ("activation._silu_and_mul_kernel", silu,
         dict(BLOCK_SIZE=4096, USE_PDL=True, SCALED=True)),
        ("activation._silu_and_mul_quant_kernel", {**silu, **quant},
         dict(BLOCK_SIZE=4096, USE_PDL=True, SCALED=False, ONE_PASS=False, STORE=True)),
        ("activation._silu_and_mul_quant_kernel", {**silu, **quant},  # 8B's row in registers
         dict(BLOCK_SIZE=16384, USE_PDL=True, SCALED=True, ONE_PASS=True, STORE=False)),
        ("fp8_quant._quantize_rows_kernel",
         dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
         dict(BLOCK_K=4096, USE_PDL=True)),
        ("rms_norm._fused_add_rms_norm_kernel",
         dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", eps="fp32",
              row_scale_ptr="*fp32", col_scale_ptr="*fp32", **quant),
         dict(BLOCK_SIZE=4096, USE_PDL=True, SCALED=True, QUANT=True, STORE=False)),
        ("rms_norm._rms_norm_kernel",
         dict(x_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", eps="fp32", **quant),
         dict(BLOCK_SIZE=4096, USE_PDL=True, QUANT=True, STORE=False)),
    ]  # fmt: skip
    code = f"""
import importlib
from sass_loops import compile_sm90
for name, types, constexprs in {kernels!r}:
    module, fn_name = name.split(".")
    fn = getattr(importlib.import_module("lantau.kernels." + module), fn_name)
    print(name, "cubin" in compile_sm90(fn, types, constexprs, num_warps=8, num_stages=3).asm)
"""
    expected = [word for name, _, _ in kernels for word in (name, "True")]
    assert run_compiled(code).split() == expected
