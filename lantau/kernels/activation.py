"""SiLU-and-multiply: the activation between LlamaMLP's fused gate_up_proj and down_proj;
optionally quantized by row as written too, for an fp8 down_proj (fp8_quant.quantize_rows'
bits, without its launch), and then, with `store=False`, only so where the row fits one
program's registers (the projection reads nothing else): up to 32,768 values, llama3-70b's
28,672 included.

NOTE: a row too long for registers is stored always: its second pass reads it back;
computing it again from x instead lost at 70B's widths (RESULTS.md 2026-12-06)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.device import num_sms
from lantau.kernels.fp8_quant import (
    MAX_BLOCK_K,
    check_quantized,
    check_unscaled,
    quantize_row,
    quantize_stored_row,
)
from lantau.kernels.pdl import pdl_wait

# widest column tile of one program: past this a row is split over several programs, so that
# decode batches of a few tokens still spread a wide MLP (d = 14336) over many SMs
MAX_BLOCK_SIZE = 4096
# widest row the quantizing kernel holds in registers, on 32 warps: 32 values a thread, 60
# registers on sm90 without spills (one program an SM), llama3-70b's 28,672 included; llama3-8b's
# 14,336 take 16 a thread, 32 registers unscaled (two programs an SM) and 44 with a tensor-wise
# product's scales (one, until _register_cap). A wider row takes two passes. 32 warps rather
# than 16: 287 against 302 us at 8,192 rows of 8B, level at decode batches (H100, RESULTS.md
# 2026-12-07)
MAX_QUANT_ROW = 32768
# the one-pass block whose scaled row _register_cap brings to 32 registers (8B's)
CAPPED_ROW = 16384


@triton.jit
def _silu_mul(x_row, cols, mask, d, row, row_scale_ptr, col_scale_ptr, SCALED: tl.constexpr):
    """silu(gate) * up of one row's columns `cols`, in fp32."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        rs = tl.load(row_scale_ptr + row)
        gate *= rs * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        up *= rs * tl.load(col_scale_ptr + d + cols, mask=mask, other=0.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    d,
    row_scale_ptr,  # [num_tokens] fp32, when SCALED
    col_scale_ptr,  # [2 * d] fp32, when SCALED
    BLOCK_SIZE: tl.constexpr,  # next power of 2 of d, at most MAX_BLOCK_SIZE
    USE_PDL: tl.constexpr,
    SCALED: tl.constexpr,  # x is an unscaled fp8 product: x[t, c] * row_scale[t] * col_scale[c]
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < d
    out = _silu_mul(x_ptr + row * x_row_stride, cols, mask, d, row, row_scale_ptr, col_scale_ptr,
                    SCALED)  # fmt: skip
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    out_ptr,
    q_ptr,  # [num_tokens, d] e4m3
    q_scale_ptr,  # [num_tokens] fp32
    x_row_stride,
    out_row_stride,
    d,
    row_scale_ptr,  # [num_tokens] fp32, when SCALED
    col_scale_ptr,  # [2 * d] fp32, when SCALED
    BLOCK_SIZE: tl.constexpr,  # columns a pass holds at once
    USE_PDL: tl.constexpr,
    SCALED: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_SIZE >= d: the whole row in registers
    STORE: tl.constexpr,  # the output stored (off, one pass only: just its quantized rows)
):
    """One program a row, the activation rounded to out's dtype and quantized from that, as
    quantize_rows would from out: a row that fits one block is held in registers; a longer
    one takes two passes, the first storing the activation and finding its largest
    magnitude, the second reading the stored row back (L1 / L2) and writing it in e4m3."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_SIZE)
    x_row, out_row = x_ptr + row * x_row_stride, out_ptr + row * out_row_stride
    out_ty = out_ptr.dtype.element_ty
    if ONE_PASS:
        mask = offs < d
        out = _silu_mul(x_row, offs, mask, d, row, row_scale_ptr, col_scale_ptr, SCALED).to(out_ty)
        if STORE:
            tl.store(out_row + offs, out, mask=mask)
        quantize_row(out.to(tl.float32), q_ptr + row * d, q_scale_ptr + row, offs, mask)
        return
    amax = tl.zeros([BLOCK_SIZE], tl.float32)
    for k in range(0, d, BLOCK_SIZE):
        cols = k + offs
        mask = cols < d
        out = _silu_mul(x_row, cols, mask, d, row, row_scale_ptr, col_scale_ptr, SCALED).to(out_ty)
        tl.store(out_row + cols, out, mask=mask)
        amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
    tl.debug_barrier()  # the row's stores seen by every thread of the program
    quantize_stored_row(out_row, q_ptr + row * d, q_scale_ptr + row, amax, d, BLOCK_SIZE)


def _register_cap(
    one_pass: bool, scaled: bool, width: int, num_tokens: int, device: torch.device
) -> dict:
    """The quantizing kernel's launch option capping its registers: a scaled one-pass row of
    up to CAPPED_ROW values (8B's) takes 44 registers a thread, one program an SM; capped at 32
    (8 bytes spilled) two fit, which pays once the rows outrun one wave of the SMs: 21.4
    against 23.9 us at 384 rows, 298 against 409 at 8,192, but 11.5 against 8.4 at 128 (H100,
    RESULTS.md 2026-12-07)."""
    if one_pass and scaled and width <= CAPPED_ROW and num_tokens > num_sms(device):
        return {"maxnreg": 32}
    return {}


def silu_and_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    use_pdl: bool = True,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    quant: tuple[torch.Tensor, torch.Tensor] | None = None,
    store: bool = True,
) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up], in fp32, rounded once to x's dtype.

    x: [num_tokens, 2 * d], any row stride, last dim contiguous; out: [num_tokens, d] (new if
    None), any row stride, last dim contiguous. row_scale [num_tokens] and col_scale [2 * d]
    (fp32, together): x is a product still to be scaled (a tensor-wise fp8 GEMM's), each
    value by its row's and its column's scale before the activation. quant (buffers of
    fp8_quant.empty_quantized): out's rows quantized into them too, as quantize_rows(out), in
    the same launch (a program a row); with store=False only there where a row fits one
    program (out left unwritten; rows wider than MAX_QUANT_ROW are stored still).
    """
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [num_tokens, 2 * d], {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert x.stride(1) == 1, f"x rows must be contiguous, strides {x.stride()}"
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, d), f"out {tuple(out.shape)} must be {(num_tokens, d)}"
    assert out.dtype == x.dtype, f"out {out.dtype} != x {x.dtype}"
    assert out.device == x.device, f"out on {out.device}, x on {x.device}"
    assert out.stride(1) == 1, f"out rows must be contiguous, strides {out.stride()}"
    scaled = check_unscaled(row_scale, col_scale, num_tokens, 2 * d, x.device)
    assert store or quant is not None, "store=False needs quant"
    if quant is not None:
        check_quantized(quant, num_tokens, d, x.device)
    if num_tokens == 0 or d == 0:
        return out
    scales = (row_scale, col_scale) if scaled else (x, x)
    if quant is not None:
        width = triton.next_power_of_2(d)
        one_pass = width <= MAX_QUANT_ROW
        block_size = width if one_pass else MAX_BLOCK_K
        _silu_and_mul_quant_kernel[(num_tokens,)](
            x, out, *quant, x.stride(0), out.stride(0), d, *scales, BLOCK_SIZE=block_size,
            SCALED=scaled, ONE_PASS=one_pass, STORE=store or not one_pass,
            **pdl.launch_options(x.device, use_pdl),
            num_warps=32 if one_pass else min(max(block_size // 512, 1), 8),
            **_register_cap(one_pass, scaled, width, num_tokens, x.device),
        )  # fmt: skip
        return out
    block_size = min(triton.next_power_of_2(d), MAX_BLOCK_SIZE)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block_size))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        d,
        *scales,
        BLOCK_SIZE=block_size,
        SCALED=scaled,
        **pdl.launch_options(x.device, use_pdl),
        # about 8 elements per thread: 16-byte fp16 loads
        num_warps=min(max(block_size // 256, 1), 16),
    )
    return out
