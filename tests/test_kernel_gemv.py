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
