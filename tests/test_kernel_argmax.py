"""The one-launch argmax kernel against torch.argmax on CPU through the Triton interpreter:
rows over several chunks (ragged last chunk), ties within and across chunks (the first index
wins), negative rows, -0.0 against +0.0, every dtype, and launches back to back (the scratch
left reset each time, as CUDA graph replays need)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from lantau.kernels import argmax as am  # noqa: E402
from lantau.kernels.reference import argmax_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 10000), (3, 4096), (5, 777), (2, 3 * 4096 + 1)])
def test_argmax_matches_torch(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    # row 0: its maximum twice, in different chunks when there are several: the first wins
    top = logits[0].float().max() + 1
    logits[0, vocab - 1] = logits[0, vocab // 3] = top
    if rows > 1:  # all negative
        logits[1] = -logits[1].abs() - 1
    if rows > 2:  # all equal: index 0
        logits[2] = 0.5
    for _ in range(2):  # the second launch finds the scratch reset by the first
        out = am.argmax(logits)
        assert out.dtype == torch.int64 and out.shape == (rows,)
        assert torch.equal(out, argmax_ref(logits)), (out, argmax_ref(logits))
    assert out[0] == vocab // 3
    best, count = am._scratch[logits.device]
    assert (best == am._EMPTY).all() and (count == 0).all()


def test_argmax_signed_zeros_tie_like_torch():
    logits = torch.full((2, 50), -1.0)
    logits[0, 7], logits[0, 3] = 0.0, -0.0  # equal maxima: the first index, 3
    logits[1, 40] = 2.0
    assert am.argmax(logits).tolist() == logits.argmax(-1).tolist() == [3, 40]


def test_argmax_of_a_strided_view_and_bad_inputs():
    base = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    view = base[:, :200]  # rows 300 apart
    assert torch.equal(am.argmax(view), view.argmax(-1))
    with pytest.raises(AssertionError, match="logits"):
        am.argmax(base.t())
    with pytest.raises(AssertionError, match="int"):
        am.argmax(torch.zeros(2, 5, dtype=torch.int32))


def test_argmax_into_out_view():
    """Into a view of a longer buffer (a decode graph's ids buffer): only those rows."""
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(2))
    buffer = torch.full((5,), -7, dtype=torch.int64)
    ids = am.argmax(logits, out=buffer[:3])
    assert ids.data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == [*logits.argmax(-1).tolist(), -7, -7]
    with pytest.raises(AssertionError, match="out"):
        am.argmax(logits, out=buffer[:2])
    with pytest.raises(AssertionError, match="out"):
        am.argmax(logits, out=torch.zeros(3, dtype=torch.int32))


def test_argmax_of_nan_rows_stays_in_range():
    """A row of NaN (a broken model, or weights not loaded yet) gives torch's index, the
    first NaN, not one past the row: the next decode step embeds the id it picks."""
    vocab = 2 * 4096 + 5
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    logits[0] = float("nan")
    logits[1, 4096:] = float("nan")  # a whole chunk (and the ragged last one) of NaN
    logits[2, 4100] = float("nan")
    out = am.argmax(logits)
    assert out[0] == 0 == logits[0].argmax()
    assert ((out >= 0) & (out < vocab)).all(), out
    assert out[1] in (logits[1, :4096].argmax(), 4096)  # the finite maximum, or the first NaN
    assert out[2] in (logits[2].nan_to_num(-1e9).argmax(), 4100)
    best, count = am._scratch[logits.device]
    assert (best == am._EMPTY).all() and (count == 0).all()
