"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The math is lantau.kernels.reference.rms_norm_ref (HF's LlamaRMSNorm): normalise in fp32, round
to the input dtype, then multiply by the weight and round again, so outputs match the reference
bit for bit up to the order of the fp32 sum of squares. The weight is loaded before the PDL wait
(no kernel writes it). One program normalises one token row held whole in registers; with
`quant` it also stores the row quantized for an fp8 projection (fp8_quant.quantize_rows' bits,
without its launch), and with `store=False` only that (the projection reads nothing else).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.fp8_quant import check_quantized, check_unscaled, quantize_row
from lantau.kernels.pdl import pdl_wait


@triton.jit
def _normalize_row(x, weight, out_ptr, hidden_size, eps):
    # x: [BLOCK_SIZE] fp32, padding lanes 0 so they add nothing to the sum of squares; weight
    # in fp32 (loaded before the PDL wait); out_ptr only gives the dtype to round to (the caller
    # stores the result)
    out_dtype = out_ptr.dtype.element_ty
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    # round before the weight multiply, as rms_norm_ref does (`weight * xf.to(x.dtype)`)
    normed = (x * inv_rms).to(out_dtype).to(tl.float32)
    return (normed * weight).to(out_dtype)


@triton.jit
def _weight_and_wait(weight_ptr, offs, mask, USE_PDL: tl.constexpr):
    """The norm's weight in fp32, loaded before the PDL wait (no kernel writes it)."""
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    return weight


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    hidden_size,
    eps,
    q_ptr,  # [num_tokens, hidden_size] e4m3, when QUANT
    q_scale_ptr,  # [num_tokens] fp32, when QUANT
    BLOCK_SIZE: tl.constexpr,  # next power of 2 of hidden_size
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,  # the output quantized by row too (fp8_quant.quantize_row)
    STORE: tl.constexpr,  # the output stored (off: only its quantized rows, with QUANT)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    mask = offs < hidden_size
    weight = _weight_and_wait(weight_ptr, offs, mask, USE_PDL)
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    out = _normalize_row(x, weight, out_ptr, hidden_size, eps)
    if STORE:
        tl.store(out_ptr + row * out_row_stride + offs, out, mask=mask)
    if QUANT:
        quantize_row(out.to(tl.float32), q_ptr + row * hidden_size, q_scale_ptr + row, offs, mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    x_row_stride,
    residual_row_stride,
    hidden_size,
    eps,
    row_scale_ptr,  # [num_tokens] fp32, when SCALED
    col_scale_ptr,  # [hidden_size] fp32, when SCALED
    q_ptr,  # [num_tokens, hidden_size] e4m3, when QUANT
    q_scale_ptr,  # [num_tokens] fp32, when QUANT
    BLOCK_SIZE: tl.constexpr,  # next power of 2 of hidden_size
    USE_PDL: tl.constexpr,
    SCALED: tl.constexpr,  # x is an unscaled fp8 product: x[t, c] * row_scale[t] * col_scale[c]
    QUANT: tl.constexpr,  # the output quantized by row too (fp8_quant.quantize_row)
    STORE: tl.constexpr,  # the output stored to x (off: only its quantized rows, with QUANT)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    mask = offs < hidden_size
    weight = _weight_and_wait(weight_ptr, offs, mask, USE_PDL)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x *= tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + offs, mask=mask, other=0.0)
    residual = tl.load(residual_row + offs, mask=mask, other=0.0).to(tl.float32)
    # normalise the rounded sum, the value the next layer's residual add will read back
    total = (x + residual).to(residual_ptr.dtype.element_ty)
    tl.store(residual_row + offs, total, mask=mask)
    out = _normalize_row(total.to(tl.float32), weight, x_ptr, hidden_size, eps)
    if STORE:
        tl.store(x_row + offs, out, mask=mask)
    if QUANT:
        quantize_row(out.to(tl.float32), q_ptr + row * hidden_size, q_scale_ptr + row, offs, mask)


def _check_rows(name: str, t: torch.Tensor, weight: torch.Tensor) -> None:
    """A [num_tokens, hidden_size] tensor with contiguous rows, matching weight."""
    assert t.dim() == 2, f"{name} must be [num_tokens, hidden_size], got {tuple(t.shape)}"
    assert t.shape[1] == weight.shape[0], f"{name} {tuple(t.shape)} vs weight {weight.shape[0]}"
    assert t.dtype in (torch.float32, torch.float16, torch.bfloat16), f"{name} dtype {t.dtype}"
    assert t.dtype == weight.dtype, f"{name} {t.dtype} != weight {weight.dtype}"
    assert t.device == weight.device, f"{name} on {t.device}, weight on {weight.device}"
    assert t.stride(1) == 1, f"{name} rows must be contiguous, strides {t.stride()}"


def _num_warps(block_size: int) -> int:
    # about 8 elements per thread: 16-byte fp16 loads without spilling the row
    return min(max(block_size // 256, 1), 16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    use_pdl: bool = True, quant: tuple[torch.Tensor, torch.Tensor] | None = None,
    store: bool = True,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm of each row of x (any row stride) into out (new if None); quant (buffers of
    fp8_quant.empty_quantized): out's rows quantized into them too, as quantize_rows(out),
    and with store=False only there (out left unwritten)."""
    # x, out: [num_tokens, hidden_size]; weight: [hidden_size]
    assert weight.dim() == 1 and weight.is_contiguous(), f"weight {tuple(weight.shape)}"
    _check_rows("x", x, weight)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape, f"out {tuple(out.shape)} != x {tuple(x.shape)}"
    _check_rows("out", out, weight)
    num_tokens, hidden_size = x.shape
    if quant is not None:
        check_quantized(quant, num_tokens, hidden_size, x.device)
    assert store or quant is not None, "store=False needs quant"
    if num_tokens == 0:
        return out
    block_size = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        weight,
        out,
        x.stride(0),
        out.stride(0),
        hidden_size,
        eps,
        *(quant or (x, x)),
        BLOCK_SIZE=block_size,
        QUANT=quant is not None,
        STORE=store,
        **pdl.launch_options(x.device, use_pdl),
        num_warps=_num_warps(block_size),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    use_pdl: bool = True,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    quant: tuple[torch.Tensor, torch.Tensor] | None = None,
    store: bool = True,
) -> None:
    """In place: residual = x + residual (rounded to its dtype); x = RMSNorm(residual).
    row_scale [num_tokens] and col_scale [hidden_size] (fp32, together): x is an unscaled fp8
    product (a tensor-wise GEMM's), each value multiplied by its row's and its column's scale
    before the add. quant (buffers of fp8_quant.empty_quantized): the new x quantized into them
    too, as quantize_rows(x), and with store=False only there (x left as it was)."""
    # x, residual: [num_tokens, hidden_size], any row strides; weight: [hidden_size]
    assert weight.dim() == 1 and weight.is_contiguous(), f"weight {tuple(weight.shape)}"
    _check_rows("x", x, weight)
    _check_rows("residual", residual, weight)
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
    num_tokens, hidden_size = x.shape
    scaled = check_unscaled(row_scale, col_scale, num_tokens, hidden_size, x.device)
    if quant is not None:
        check_quantized(quant, num_tokens, hidden_size, x.device)
    assert store or quant is not None, "store=False needs quant"
    if num_tokens == 0:
        return
    block_size = triton.next_power_of_2(hidden_size)
    _fused_add_rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        x.stride(0),
        residual.stride(0),
        hidden_size,
        eps,
        row_scale if scaled else x,
        col_scale if scaled else x,
        *(quant or (x, x)),
        BLOCK_SIZE=block_size,
        SCALED=scaled,
        QUANT=quant is not None,
        STORE=store,
        **pdl.launch_options(x.device, use_pdl),
        num_warps=_num_warps(block_size),
    )
