"""Greedy pick in one launch: each row's argmax (the first index among equal maxima).

torch's argmax gives a row to one program; the two-stage torch version in the sampler
(argmax_rows) spreads a row over the SMs but takes five launches. Here a row's
chunks run as separate programs; each packs its chunk's maximum and index into one int64
ordered like (value, -index) and folds it into the row's slot with an atomic max; the row's last
program (an atomic counter) unpacks the winner and leaves slot and counter reset for the next
launch (so CUDA graphs can replay it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

BLOCK = 4096  # logits a program reads
_MAX_ROWS = 4096
_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_EMPTY = -(2**63)  # a slot's value between launches: below every packed key


@triton.jit
def _argmax_kernel(
    logits_ptr,  # [R, V]
    out_ptr,  # [R] int64
    best_ptr,  # [>= R] int64 scratch, _EMPTY between launches
    count_ptr,  # [>= R] int32 scratch, 0 between launches
    V,
    stride_row,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # the logits are the kernel before's
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch
    top = tl.max(x, axis=0)
    index = tl.min(tl.where((x == top) & mask, offs, V), axis=0)  # the first of the maxima
    if index == V:  # none equals the maximum: it is NaN; the first NaN, as torch (in range)
        index = tl.min(tl.where((x != x) & mask, offs, V), axis=0)
    # float order as signed int32 order: negatives' magnitude bits flipped
    bits = top.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # high word the value, low word 2**32 - 1 - index: a larger packed key is a larger value,
    # or the same value at a smaller index
    low = tl.full([], 4294967295, tl.int64)  # 2**32 - 1
    packed = (key.to(tl.int64) << 32) | (low - index.to(tl.int64))
    tl.atomic_max(best_ptr + row, packed, sem="relaxed")
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        empty = tl.full([], -9223372036854775808, tl.int64)
        winner = tl.atomic_xchg(best_ptr + row, empty, sem="relaxed")
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")
        tl.store(out_ptr + row, low - (winner & low))


def _buffers(device: torch.device, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots and counters: one reset pair per device, allocated once (CUDA graphs keep
    their addresses) and left reset by every launch."""
    assert num_rows <= _MAX_ROWS, f"{num_rows} rows in one launch"
    if device not in _scratch:
        _scratch[device] = (
            torch.full((_MAX_ROWS,), _EMPTY, dtype=torch.int64, device=device),
            torch.zeros(_MAX_ROWS, dtype=torch.int32, device=device),
        )
    return _scratch[device]


def argmax(
    logits: torch.Tensor, out: torch.Tensor | None = None, use_pdl: bool = True
) -> torch.Tensor:
    """logits.argmax(-1) for [R, V] logits (fp32, fp16, bf16; last dim contiguous) in one
    launch: [R] int64, into `out` if given. A row holding NaN gives one of its indices (torch
    gives the first NaN's; so does this where the maximum a chunk reads is NaN), never one
    past the row: the next step embeds it."""
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)}"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), f"{logits.dtype}"
    num_rows, vocab_size = logits.shape
    assert 0 < vocab_size < 2**31, f"vocab_size {vocab_size}"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64, f"out {tuple(out.shape)}"
    assert out.device == logits.device and out.stride(0) == 1, "out: contiguous, logits' device"
    if num_rows == 0:
        return out
    best, count = _buffers(logits.device, num_rows)
    num_chunks = triton.cdiv(vocab_size, BLOCK)
    _argmax_kernel[(num_rows, num_chunks)](
        logits, out, best, count, vocab_size, logits.stride(0), num_chunks, BLOCK=BLOCK,
        num_warps=8, **pdl.launch_options(logits.device, use_pdl),
    )  # fmt: skip
    return out
