"""Batch-1 matrix-vector product for decode: y = x @ W^T with one row of x.

At batch 1 a decode step is a stream of weight reads; cuBLAS reaches 2.7 to 3.2 TB/s on the
small projections of an 8B model on an H200 (qkv, o), against about 4.4 for a plain read.
Here each program owns BLOCK_N rows of W and walks the whole K dimension in BLOCK_K chunks
(16-byte loads along K, fully coalesced), so W is read exactly once, with no split-K partials
to reduce. x (a few KB) stays in L1/L2. At 2 rows and more cuBLAS wins: the model takes this
kernel at batch 1 only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait


@triton.jit
def _gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, K] row-major (nn.Linear's weight), x's dtype or e4m3
    scale_ptr,  # [N] fp32: row n of W is w[n] * scale[n] (e4m3 weights), or a dummy
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    y_ptr,  # [1, N] ([1, N / 2] when GATED)
    N,
    K,
    stride_wn,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # y = silu(g) * u for [g | u] = W x: W is [gate; up], y N/2 wide
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PRELOAD: tl.constexpr,  # BLOCK_K >= K: see gemv's `preload`
):
    pid = tl.program_id(0)
    HALF: tl.constexpr = BLOCK_N // 2
    if GATED:
        # paired rows: the program's BLOCK_N // 2 gate rows, then each one's up row
        local = tl.arange(0, BLOCK_N)
        first = pid * HALF
        offs_j = first + local % HALF  # [BLOCK_N]: the gate row of each row's pair
        offs_n = offs_j + (local // HALF) * (N // 2)
        n_mask = offs_j < N // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if PRELOAD:
        # the program's whole weight slice in one load, issued before the wait: it streams in
        # while the previous kernel finishes
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :])
        pdl_wait(USE_PDL)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
    else:
        pdl_wait(USE_PDL)
        # a 2-D accumulator, reduced once at the end: no cross-thread sum per chunk. NOTE: the
        # loop as written pipelines best; peeling the first weight tile out of it, to read it
        # before pdl_wait, was slower on the H200
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + offs_k) < K
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :])
            x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_SCALE:  # one scale a row: applied once, after the row's sum
        y *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if GATED:  # rounded as the unfused product, then silu_and_mul in fp32 of each pair
        lo, hi = tl.split(tl.trans(tl.reshape(y.to(tl.float32), (2, HALF))))  # gate, up
        offs_out = first + tl.arange(0, HALF)
        out = (lo * tl.sigmoid(lo) * hi).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_out, out, mask=offs_out < N // 2)
    else:
        tl.store(y_ptr + offs_n, y, mask=n_mask)


# preload: the longest row a program loads at once (BLOCK_N * 16384 over its threads); the
# model takes it up to KernelConfig.gemv_preload_max_bytes a row
PRELOAD_MAX_K = 16384


def preload_config(n: int, k: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the preload, from H200 sweeps of 5 tiles, by a
    row's bytes: up to 8 KB (bf16 K = 4096, e4m3 K = 8192: the 70B's) 4 rows a program, 8 warps
    for lm_head's 128k rows, 4 for the rest; longer rows 2 rows over 8 warps, the registers a
    thread holds as at 8 KB."""
    if k * itemsize > 8192:
        return 2, 8, 1
    return (4, 8, 1) if n >= 65536 else (4, 4, 1)


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the K loop, from an H200 sweep of 36
    tilings: long rows take wide K chunks, tall matrices taller tiles, the small projections
    8-row tiles (more programs in flight)."""
    if k >= 8192:
        # down_proj of an 8B model: 4 rows over 2 warps, 1,024 programs spread over every SM
        # (32 x 1024 over 8 warps took 255 registers: one program an SM)
        return 4, 1024, 2, 4
    if n >= 16384:  # gate_up, lm_head
        return 16, 256, 4, 4
    return 8, 512, 4, 4  # qkv, o


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    *,
    gated: bool = False,
    preload: bool = False,
    use_pdl: bool = True,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for one row of x; fp32 accumulation.

    weight_scale: [N] fp32 for an e4m3 weight (lantau.model.fp8): row n is weight[n] *
    weight_scale[n]; x stays in its dtype (not quantized), so a step reads half the bytes.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of default_config (tuning).
    `preload` (K up to PRELOAD_MAX_K): each program loads its whole weight slice (BLOCK_N rows,
    config's BLOCK_K ignored) at once, before waiting on the previous kernel.
    `gated`: weight is [gate; up] (N = 2d), and the result is silu(x gate^T) * (x up^T),
    [1, d] (the SiLU-and-mul after the product, each program owning matching gate and up rows).
    """
    # x: [1, K]; weight: [N, K]; bias: [N] -> [1, N]
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    m, k = x.shape
    n = weight.shape[0]
    assert m == 1, f"gemv serves one row, got {m}"
    assert weight.shape[1] == k, f"x has K={k}, weight {tuple(weight.shape)}"
    if weight_scale is None:
        assert x.dtype == weight.dtype, f"x {x.dtype}, weight {weight.dtype}"
    else:
        assert weight.dtype == torch.float8_e4m3fn, f"weight_scale with weight {weight.dtype}"
        assert weight_scale.shape == (n,) and weight_scale.dtype == torch.float32, (
            f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype}: must be [{n}] fp32"
        )
        assert weight_scale.device == weight.device and weight_scale.stride(0) == 1
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous along K"
    assert x.device == weight.device, f"x on {x.device}, weight on {weight.device}"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype, f"bias {tuple(bias.shape)}"
    assert not gated or n % 2 == 0, f"gated: N={n} must be even"
    y = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or default_config(n, k)
    if preload:
        assert k <= PRELOAD_MAX_K, f"preload serves K <= {PRELOAD_MAX_K}, got {k}"
        block_n, num_warps, num_stages = (
            (block_n, num_warps, 1) if config else preload_config(n, k, weight.element_size())
        )
        block_k = triton.next_power_of_2(k)
    if gated:
        block_n = max(block_n, 2)  # a gate row and its up row, at least
    grid = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    _gemv_kernel[(grid,)](
        x, weight, x if weight_scale is None else weight_scale, x if bias is None else bias, y,
        n, k, weight.stride(0), HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k,
        PRELOAD=preload, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(x.device, use_pdl),
    )  # fmt: skip
    return y
