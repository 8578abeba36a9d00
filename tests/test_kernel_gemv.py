"""The batch-1 GEMV kernel vs an fp32 reference and F.linear, on CPU through the Triton
interpreter: ragged N and K (masked tiles), bias, all dtypes, several tile configurations, the
SiLU-and-mul epilogue and the preloading variant. Inputs are random and nonzero, so an
unwritten output element (gemv allocates with torch.empty) shows up as a mismatch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lantau.kernels.gemv import gemv  # noqa: E402
from lantau.kernels.reference import gemv_ref, silu_and_mul_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")  # see tests/conftest.py

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000), (64, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    for config in [(8, 64, 4, 2), (16, 256, 4, 3), (4, 512, 2, 2)]:
        out = gemv(x, w, b, config=config)
        assert out.shape == (1, n) and out.dtype == dtype
        assert torch.isfinite(out).all()
        ref = gemv_ref(x, w, b)
        assert rel_err(out, ref) < TOLERANCES[dtype], config
        # and what the torch backend computes for the same layer
        assert rel_err(out, F.linear(x, w, b).float()) < 2 * TOLERANCES[dtype], config


def test_gemv_strided_rows_and_default_config():
    """x as a row slice of a wider buffer (as the model's views are); the default tiles."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(1, 200, generator=gen)
    x = buf[:, :100]
    w = torch.randn(70, 100, generator=gen)
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_rejects_bad_inputs():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.randn(2, 8), w)
    with pytest.raises(AssertionError, match="K="):
        gemv(x, torch.randn(4, 9))
    with pytest.raises(AssertionError, match="dtype|float"):
        gemv(x, w.half())
    with pytest.raises(AssertionError, match="contiguous"):
        gemv(x, torch.randn(8, 4).T)
    with pytest.raises(AssertionError, match="bias"):
        gemv(x, w, torch.randn(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (34, 1000), (2, 64)])
def test_gemv_gated_matches_reference(dtype, n, k):
    """Batch 1 with the SiLU-and-mul after the product (gate_up_proj's output never written):
    each program pairs gate rows with their up rows; ragged halves (17 of 34) are masked."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 1000), (64, 4096), (6, 14336)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_preload_matches_the_loop(dtype, n, k, gated):
    """Each program's whole weight slice loaded at once (before the PDL wait): the fp32
    reference, and the K-loop kernel's result, with and without the SiLU-and-mul epilogue."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    if gated:
        w = w[: n - n % 2]  # [gate; up]
    ref = gemv_ref(x, w, gated=gated)
    looped = gemv(x, w, gated=gated)
    for config in [None, (2, 0, 2, 1), (8, 0, 4, 1)]:
        out = gemv(x, w, config=config, gated=gated, preload=True)
        assert out.shape == looped.shape and out.dtype == dtype
        assert rel_err(out, ref) < 2 * TOLERANCES[dtype], config
        assert rel_err(out, looped.float()) < TOLERANCES[dtype], config
    with pytest.raises(AssertionError, match="preload"):
        gemv(torch.randn(1, 16400).to(dtype), torch.randn(4, 16400).to(dtype), preload=True)
