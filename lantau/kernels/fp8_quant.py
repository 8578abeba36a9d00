"""Dynamic per-token FP8 (e4m3) quantization of activations, before `torch._scaled_mm`.

One program a row: a first pass over the row finds its largest magnitude, a second (the row
still in L1/L2) writes row / scale in e4m3. In torch the same takes five launches and a wide
fp32 copy of the row (a prefill's down_proj input is 65,536 x 14,336); here the row is read
twice and written once in one byte an element. NOTE: two passes even where the row would fit
in registers: holding o_proj's 4,096 values took 4.69 us a launch at 384 rows against 4.11 in
two passes (H100, RESULTS.md 2026-12-06). The reference is lantau.model.fp8.quantize_rows.

NOTE: a scale per row keeps each token's product independent of the other rows: the CUDA
graphs' padding rows (decode buckets, mixed-step token buckets) and a batch's make-up change
no row's result, as they would with one scale for the whole batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

E4M3_MAX = 448.0  # as lantau.model.fp8 (kernels import no model code)
MIN_SCALE = 1e-12
MAX_BLOCK_K = 4096  # columns a program holds at once


@triton.jit
def _row_scale(amax, scale_ptr):
    """A row's scale from its largest magnitudes ([BLOCK], a lane's each), stored to
    scale_ptr: the largest maps to E4M3_MAX."""
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(scale_ptr, scale)
    return scale


@triton.jit
def _store_quantized(x, scale, q_ptrs, mask):
    # NOTE: IEEE division, as torch's (Triton's `/` on fp32 is approximate on CUDA)
    q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def quantize_row(y, q_row_ptr, scale_ptr, offs, mask):
    """A whole row held in registers (y, fp32, [BLOCK] with 0 in its padding lanes) stored as
    quantize_rows stores it: its scale to scale_ptr, y / scale in e4m3 to q_row_ptr + offs.
    For kernels that produce a row and hand it to an fp8 projection (quantized as written,
    one launch fewer)."""
    _store_quantized(y, _row_scale(tl.abs(y), scale_ptr), q_row_ptr + offs, mask)


@triton.jit
def quantize_stored_row(x_row, q_row_ptr, scale_ptr, amax, K, BLOCK: tl.constexpr):
    """The second pass over a row too long for registers, already in memory (L1 / L2) and
    its lanes' largest magnitudes found (amax, [BLOCK]): its scale to scale_ptr, x / scale
    in e4m3 to q_row_ptr, as quantize_row would."""
    scale = _row_scale(amax, scale_ptr)
    offs = tl.arange(0, BLOCK)
    for k in range(0, K, BLOCK):
        mask = (k + offs) < K
        x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(x, scale, q_row_ptr + k + offs, mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] fp32 / fp16 / bf16
    q_ptr,  # [M, K] e4m3, contiguous
    scale_ptr,  # [M] fp32
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_row + k + offs, mask=(k + offs) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    quantize_stored_row(x_row, q_ptr + row * K, scale_ptr + row, amax, K, BLOCK_K)


def empty_quantized(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for `rows` quantized rows: (q [rows, cols] e4m3, scale [rows] fp32)."""
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty(rows, dtype=torch.float32, device=device)


def check_quantized(quant: tuple[torch.Tensor, torch.Tensor], rows: int, cols: int, device):
    """A kernel's quantized output buffers: (q [rows, cols] e4m3, contiguous; scale [rows]
    fp32), as empty_quantized makes them."""
    q, scale = quant
    assert q.shape == (rows, cols) and q.dtype == torch.float8_e4m3fn and q.is_contiguous(), (
        f"quantized rows must be [{rows}, {cols}] e4m3, contiguous: {tuple(q.shape)} {q.dtype}"
    )
    assert scale.shape == (rows,) and scale.dtype == torch.float32, (
        f"row scales must be [{rows}] fp32, got {tuple(scale.shape)} {scale.dtype}"
    )
    assert q.device == scale.device == device, f"quantized rows on {q.device}, not {device}"


def quantize_rows(x: torch.Tensor, use_pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous, any row stride) -> (q [M, K] e4m3, scale [M] fp32) with
    x ~ q * scale[:, None]: each row's largest magnitude maps to E4M3_MAX."""
    assert x.dim() == 2, f"x must be [M, K], {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert x.stride(1) == 1, f"x rows must be contiguous, strides {x.stride()}"
    m, k = x.shape
    q, scale = empty_quantized(m, k, x.device)
    if m == 0 or k == 0:
        return q, scale.fill_(MIN_SCALE)
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    _quantize_rows_kernel[(m,)](
        x, q, scale, k, x.stride(0), BLOCK_K=block_k,
        num_warps=min(max(block_k // 512, 1), 8),  # about 16 elements a thread a pass
        **pdl.launch_options(x.device, use_pdl),
    )  # fmt: skip
    return q, scale


def check_unscaled(
    row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, rows: int, cols: int, device
) -> bool:
    """Whether a kernel's input is an unscaled fp8 product (a tensor-wise GEMM's) to scale as
    it reads it: its scales given together, [rows] and [cols] fp32, contiguous, on `device`."""
    scaled = row_scale is not None
    assert scaled == (col_scale is not None), "row_scale and col_scale go together"
    if not scaled:
        return False
    for name, t, n in (("row_scale", row_scale, rows), ("col_scale", col_scale, cols)):
        assert t.shape == (n,) and t.dtype == torch.float32, (
            f"{name} must be [{n}] fp32, got {tuple(t.shape)} {t.dtype}"
        )
        assert t.is_contiguous() and t.device == device, f"{name}: contiguous, on {device}"
    return True
