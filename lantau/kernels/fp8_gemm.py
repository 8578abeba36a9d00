"""FP8 (e4m3) GEMM with row-wise scales for decode-sized batches:

    y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k]   (+ bias[n])

the product `torch._scaled_mm` computes with [M, 1] and [1, N] scales (lantau.model.fp8), fp32
accumulation (fast, as the model's `_scaled_mm` runs: Triton's default on Hopper), the scales
applied in the epilogue, rounded once to the output dtype.

Why a kernel of its own: at a few hundred rows (W3-fp8-128's and W4's decode steps) torch's
row-wise `_scaled_mm` picks tiles that leave much of an H200 idle (8B o_proj at 256 rows: 566
TFLOP/s against 830 for the same product tensor-wise scaled, RESULTS.md); here the tile is
chosen by the row count (`default_tile`, measured per band), and a program's row tiles of one
weight tile run side by side, so each weight tile comes from DRAM once and from L2 after.
Prefill-sized products keep `_scaled_mm`, faster there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau import envs
from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the largest row count it serves
_TILES = (
    (64, (64, 64, 128, 4, 4)),
    (256, (64, 128, 128, 4, 4)),
    (1 << 62, (128, 128, 128, 8, 4)),
)


def default_tile(m: int) -> tuple[int, int, int, int, int]:
    """The tile for an m-row product: a band's, so a CUDA graph bucket's tile is its band's."""
    return next(tile for bound, tile in _TILES if m <= bound)


MIN_BLOCK_K = 32  # an e4m3 MMA's K


def supports(m: int, k: int, max_rows: int) -> bool:
    """Whether an m x k input's product runs here under KernelConfig.fp8_gemm_max_rows."""
    return 0 < m <= max_rows and k % MIN_BLOCK_K == 0


def _block_k(block_k: int, k: int) -> int:
    """The tile's BLOCK_K, halved until it divides K (a small model's, a tensor-parallel
    rank's slice)."""
    while k % block_k:
        block_k //= 2
    return block_k


# NOTE: M is not specialized on: an eager step of any row count in a band runs the variant
# the band's graph captures compiled
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] e4m3, rows contiguous (stride_am)
    b_ptr,  # [N, K] e4m3, contiguous
    c_ptr,  # [M, N] out, rows contiguous (stride_cm)
    a_scale_ptr,  # [M] fp32
    b_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] or None
    M,
    N,
    K,  # a multiple of BLOCK_K
    stride_am,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter: dot in fp32 (its e4m3 dot is not exact)
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # a weight tile's row tiles are neighbours in launch order: they run at once, the tile
    # read from DRAM by the first and from L2 by the rest
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tile: tuple[int, ...] | None = None,
    use_pdl: bool = True,
) -> torch.Tensor:
    """xq [M, K] e4m3 with its row scales xs [M] (fp32), wq [N, K] e4m3 with ws [N] -> [M, N]
    in out_dtype: xs[m] * ws[n] * (xq @ wq^T) (+ bias). tile: (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages) instead of default_tile(M), its BLOCK_K halved until it divides K
    (a multiple of MIN_BLOCK_K)."""
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn, f"e4m3 operands, {xq.dtype} {wq.dtype}"
    assert xq.dim() == wq.dim() == 2 and xq.shape[1] == wq.shape[1], (
        f"xq {tuple(xq.shape)} and wq {tuple(wq.shape)} must be [M, K] and [N, K]"
    )
    assert xq.stride(1) == 1 and wq.is_contiguous(), "xq rows and wq contiguous"
    assert xs.dtype == ws.dtype == torch.float32, f"fp32 scales, {xs.dtype} {ws.dtype}"
    (m, k), n = xq.shape, wq.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tile or default_tile(m)
    block_k = _block_k(block_k, k)
    assert block_k >= MIN_BLOCK_K, f"K {k} must be a multiple of {MIN_BLOCK_K}"
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        xq, wq, out, xs, ws, bias, m, n, k, xq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=envs.triton_interpret(), num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(xq.device, use_pdl),
    )  # fmt: skip
    return out
