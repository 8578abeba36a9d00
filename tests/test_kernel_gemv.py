"""The decode GEMV kernel vs an fp32 reference and F.linear, on CPU through the Triton
interpreter: every row count it serves, ragged N and K (masked tiles), bias, all dtypes, and
several tile configurations (batch 1 takes a 2-D accumulator, 2 to 8 rows a tensor-core
product). Inputs are random and nonzero, so an unwritten output element
(gemv allocates with torch.empty) shows up as a mismatch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lantau.kernels.gemv import GEMV_MAX_M, gemv, gemv_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")  # see tests/conftest.py

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000), (64, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, m, n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    for config in [(8, 64, 4, 2), (16, 256, 4, 3), (4, 512, 2, 2)]:
        out = gemv(x, w, b, config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        ref = gemv_ref(x, w, b)
        assert rel_err(out, ref) < TOLERANCES[dtype], config
        # and what the torch backend computes for the same layer
        assert rel_err(out, F.linear(x, w, b).float()) < 2 * TOLERANCES[dtype], config


def test_gemv_strided_rows_and_default_config():
    """x as a row slice of a wider buffer (as the model's views are); the default tiles."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(3, 200, generator=gen)
    x = buf[:, :100]
    w = torch.randn(70, 100, generator=gen)
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_rejects_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(AssertionError, match="rows"):
        gemv(torch.randn(GEMV_MAX_M + 1, 8), w)
    with pytest.raises(AssertionError, match="K="):
        gemv(x, torch.randn(4, 9))
    with pytest.raises(AssertionError, match="dtype|float"):
        gemv(x, w.half())
    with pytest.raises(AssertionError, match="contiguous"):
        gemv(x, torch.randn(8, 4).T)
    with pytest.raises(AssertionError, match="bias"):
        gemv(x, w, torch.randn(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000)])
@pytest.mark.parametrize("fusion", ["norm", "silu", "residual", "norm+residual", "silu+residual"])
def test_gemv_fusions_match_reference(dtype, n, k, fusion):
    """Batch 1 with the RMSNorm before it, the SiLU-and-mul before it, or the residual add
    after it folded in: against the fp32 reference and against the unfused torch ops."""
    from lantau.model.ops import TorchOps

    gen = torch.Generator().manual_seed(n + k + len(fusion))
    x = torch.randn(1, 2 * k if "silu" in fusion else k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype) if "norm" in fusion else None
    residual = torch.randn(1, n, generator=gen).to(dtype) if "residual" in fusion else None
    kwargs = dict(norm_weight=norm_weight, eps=1e-5, silu="silu" in fusion)
    ref = gemv_ref(x, w, residual=residual, **kwargs)
    # unfused, as the torch backend runs the layer
    h = TorchOps.rms_norm(x, norm_weight, 1e-5) if norm_weight is not None else x
    h = TorchOps.silu_and_mul(h) if "silu" in fusion else h
    unfused = F.linear(h, w)
    if residual is not None:
        unfused = unfused + residual
    for config in [(8, 64, 4, 2), (16, 256, 4, 3)]:
        dst = None if residual is None else residual.clone()
        out = gemv(x, w, config=config, residual=dst, **kwargs)
        if dst is not None:
            assert out is dst  # in place
        assert out.shape == (1, n) and out.dtype == dtype
        assert rel_err(out, ref) < TOLERANCES[dtype], config
        assert rel_err(out, unfused.float()) < 2 * TOLERANCES[dtype], config


def test_gemv_fusions_reject_bad_inputs():
    w = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="batch 1"):
        gemv(torch.randn(2, 8), w, norm_weight=torch.ones(8))
    with pytest.raises(AssertionError, match="norm_weight"):
        gemv(torch.randn(1, 8), w, norm_weight=torch.ones(9))
    with pytest.raises(AssertionError, match="K="):
        gemv(torch.randn(1, 8), w, silu=True)  # [gate | up] must be 2K wide
    with pytest.raises(AssertionError, match="residual"):
        gemv(torch.randn(1, 8), w, residual=torch.zeros(1, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (34, 1000)])
@pytest.mark.parametrize("preload", [False, True])
def test_gemv_sum_of_squares_handoff(dtype, n, k, preload):
    """A residual GEMV leaves the new residual's sum of squares (fp64) for the norm of the next
    GEMV, which reads it instead of summing x itself: the residual as without, the sum as
    torch's, and the next GEMV (norm weight multiplied in, or folded into W) as the fp32
    reference and as the one that sums for itself."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, n, generator=gen).to(dtype)
    w_o = (torch.randn(k, n, generator=gen) / n**0.5).to(dtype)  # writes the residual [1, k]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)  # reads it
    w = w[: n - n % 2]
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(1, k, generator=gen).to(dtype)
    sums = torch.tensor([0.0, 7.0], dtype=torch.float64)  # [total, stale]
    for config in [None, (8, 64, 4, 2)]:
        plain = gemv(x, w_o, config=config, residual=residual.clone(), preload=preload)
        h = residual.clone()
        sums.copy_(torch.tensor([0.0, 7.0]))
        gemv(x, w_o, config=config, residual=h, preload=preload, sumsq_out=(sums[:1], sums[1:]))
        assert torch.equal(h, plain)  # the residual itself is unchanged
        expected = h.double().pow(2).sum().item()
        assert sums[0].item() == pytest.approx(expected, rel=1e-6) and sums[1].item() == 0.0
        for gated in (False, True):
            kwargs = dict(eps=1e-5, gated=gated, config=config, preload=preload)
            ref = gemv_ref(h, w, norm_weight=norm_weight, eps=1e-5, gated=gated)
            summed = gemv(h, w, norm_weight=norm_weight, **kwargs)
            out = gemv(h, w, norm_weight=norm_weight, sumsq=sums[:1], **kwargs)
            assert rel_err(out, ref) < 2 * TOLERANCES[dtype], (config, gated)
            assert rel_err(out, summed.float()) < TOLERANCES[dtype], (config, gated)
            # the weight folded into W: y = (W diag(norm_weight)) rmsnorm(h), no weight loaded
            folded = (w.float() * norm_weight.float()).to(dtype)
            out = gemv(h, folded, norm=True, sumsq=sums[:1], **kwargs)
            ref = gemv_ref(h, folded, norm=True, eps=1e-5, gated=gated)
            assert rel_err(out, ref) < 2 * TOLERANCES[dtype], (config, gated)
    with pytest.raises(AssertionError, match="norm's input"):
        gemv(h, w, sumsq=sums[:1])
    with pytest.raises(AssertionError, match="residual's output"):
        gemv(x, w_o, sumsq_out=(sums[:1], sums[1:]))
    with pytest.raises(AssertionError, match="fp64"):
        gemv(h, w, norm=True, sumsq=sums[:1].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (34, 1000), (2, 64)])
def test_gemv_gated_matches_reference(dtype, n, k):
    """Batch 1 with the SiLU-and-mul after the product (gate_up_proj's output never written):
    each program pairs gate rows with their up rows; ragged halves (17 of 34) are masked."""
    from lantau.kernels.reference import silu_and_mul_ref

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    ref = gemv_ref(x, w, gated=True)
    unfused = silu_and_mul_ref(gemv(x, w))  # the unfused launches, as the model ran them
    for config in [(8, 64, 4, 2), (16, 256, 4, 3), (2, 128, 2, 2)]:
        out = gemv(x, w, config=config, gated=True)
        assert out.shape == (1, n // 2) and out.dtype == dtype
        # two roundings (the product's, the activation's), as the unfused launches
        assert rel_err(out, ref) < 2 * TOLERANCES[dtype], config
        assert rel_err(out, unfused.float()) < TOLERANCES[dtype], config
        if dtype == torch.float32:  # same sums, same order: equal up to the fp32 rounding
            torch.testing.assert_close(out, unfused, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="gated"):
        gemv(x, w[:-1], gated=True)
    with pytest.raises(AssertionError, match="batch 1"):
        gemv(torch.randn(2, k).to(dtype), w, gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000), (64, 4096), (6, 14336)])
@pytest.mark.parametrize("fusion", ["", "norm", "residual", "gated", "norm+gated"])
def test_gemv_preload_matches_the_loop(dtype, n, k, fusion):
    """Batch 1 with each program's whole weight slice loaded at once (before the PDL wait):
    the fp32 reference, and the K-loop kernel's result, with the fusions it combines with."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    kwargs = {}
    if "norm" in fusion:
        kwargs = dict(norm_weight=(torch.rand(k, generator=gen) + 0.5).to(dtype), eps=1e-5)
    if "gated" in fusion:
        kwargs["gated"] = True
        w = w[: n - n % 2]  # [gate; up]
    residual = torch.randn(1, n, generator=gen).to(dtype) if fusion == "residual" else None
    ref = gemv_ref(x, w, residual=residual, **kwargs)
    looped = gemv(x, w, residual=None if residual is None else residual.clone(), **kwargs)
    for config, maxnreg in [(None, None), (None, 168), ((2, 0, 2, 1), None), ((8, 0, 4, 1), None)]:
        dst = None if residual is None else residual.clone()
        out = gemv(x, w, config=config, residual=dst, preload=True, maxnreg=maxnreg, **kwargs)
        assert out.shape == looped.shape and out.dtype == dtype
        assert rel_err(out, ref) < 2 * TOLERANCES[dtype], config
        assert rel_err(out, looped.float()) < TOLERANCES[dtype], config
    with pytest.raises(AssertionError, match="preload"):
        gemv(torch.randn(1, 16400).to(dtype), torch.randn(4, 16400).to(dtype), preload=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "k"), [(4, 2, 16, 96), (3, 1, 64, 200)]
)
@pytest.mark.parametrize("norm", [False, True])
def test_gemv_rope_epilogue_matches_the_unfused_path(
    dtype, num_q_heads, num_kv_heads, head_dim, k, norm
):
    """qkv_proj with rotary and the KV-cache write in its epilogue: q, and the cache after it,
    against the unfused launches (GEMV, then the fused rotary + KV-write kernel) and the torch
    reference; nothing else in the cache changes, and slot -1 stores nothing."""
    from lantau.kernels.gemv import Rope
    from lantau.kernels.reference import write_kv_cache_ref as write_kv_cache
    from lantau.kernels.rotary import apply_rotary_and_write_kv
    from lantau.model.ops import build_cos_sin_cache

    gen = torch.Generator().manual_seed(head_dim + k)
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    kwargs = (
        dict(norm_weight=(torch.rand(k, generator=gen) + 0.5).to(dtype), eps=1e-5) if norm else {}
    )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 64)
    positions, slot = torch.tensor([37]), torch.tensor([13])
    cache0 = torch.randn(2, 4, 8, num_kv_heads, head_dim, generator=gen).to(dtype)

    qkv = gemv(x, w, **kwargs)  # the unfused launches
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, kk, v = (t.view(1, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    unfused_cache = cache0.clone()
    apply_rotary_and_write_kv(q, kk, v, positions, cos_sin, unfused_cache, slot)
    # the torch reference from the fp32 product, rounded where the model rounds
    ref = gemv_ref(x, w, **kwargs).to(dtype)
    rq, rk, rv = (t.view(1, -1, head_dim) for t in ref.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = cos_sin[positions][:, None, :].chunk(2, dim=-1)

    def rotate(t):
        t1, t2 = t.float().chunk(2, dim=-1)
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).to(dtype)

    ref_cache = cache0.clone()
    write_kv_cache(rotate(rk), rv, ref_cache, slot)
    for config in [None, (2, 64, 2, 2), (32, 64, 4, 2)]:
        for preload in (False, True):
            cache = cache0.clone()
            out = gemv(
                x,
                w,
                config=config,
                rope=Rope(positions, cos_sin, cache, slot),
                preload=preload,
                **kwargs,
            )
            assert out.shape == (1, q_size) and out.dtype == dtype
            torch.testing.assert_close(out, q.reshape(1, q_size), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache, unfused_cache, rtol=1e-5, atol=1e-5)
            assert rel_err(out, rotate(rq).reshape(1, q_size).float()) < 2 * TOLERANCES[dtype]
            assert rel_err(cache[:, 1, 5], ref_cache[:, 1, 5].float()) < 2 * TOLERANCES[dtype]
            changed = (cache != cache0).view(2, 32, -1).any(-1)  # [2, slots]
            assert changed[:, 13].all() and changed.sum() == 2, (config, preload)
    cache = cache0.clone()
    gemv(x, w, rope=Rope(positions, cos_sin, cache, torch.tensor([-1])), **kwargs)
    assert torch.equal(cache, cache0)  # a padding row's slot: nothing stored
    with pytest.raises(AssertionError, match="rope"):
        gemv(x, w[: -head_dim // 2], rope=Rope(positions, cos_sin, cache, slot))
