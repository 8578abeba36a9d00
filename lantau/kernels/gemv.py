"""Skinny matrix product for decode: y = x @ W^T with a few rows of x (batch 1 to GEMV_MAX_M).

At batch 1 a decode step is a stream of weight reads; cuBLAS reaches 2.7 to 3.2 TB/s on the
small projections of an 8B model on an H200 (qkv, o), against about 4.4 for a plain read.
Here each program owns BLOCK_N rows of W and walks the whole K dimension in BLOCK_K chunks
(16-byte loads along K, fully coalesced), so W is read exactly once, with no split-K partials
to reduce. x (a few KB) stays in L1/L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

# rows of x this kernel serves. Batch 1 takes a 2-D accumulator (no per-chunk reduction);
# 2 to 8 rows one tensor-core product per weight tile. NOTE: the model (ops.gemv_max_m) uses it
# at batch 1 only until the 2-8-row path is measured on the GPU (an earlier version re-read W
# per row and ran at half and a quarter of cuBLAS's speed at 2 and 4 rows).
GEMV_MAX_M = 8


@triton.jit
def _x_chunk(x_ptr, nw_ptr, k, offs_k, k_mask, K, NORM: tl.constexpr, SILU: tl.constexpr):
    """x[k : k + BLOCK_K] in fp32 as the product sees it, and its squares (for NORM)."""
    x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    sq = x * x
    if NORM:  # x is the residual stream; the norm's weight now, its 1/rms at the end
        x = x * tl.load(nw_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if SILU:  # x is [gate | up], 2K wide
        up = tl.load(x_ptr + K + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * up
    return x, sq


@triton.jit
def _rope_epilogue(
    x1,  # [P] fp32: the pairs' first elements (dims d of the head)
    x2,  # [P]: their partners (dims d + HEAD_DIM / 2)
    d,  # [P] int: the pairs' dims within the head
    head,  # the program's head among q, k, v heads
    q_ptr,
    pos_ptr,
    cos_sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
):
    """Store one head's slice of a token's qkv: q and k rotated (rotate-half, as
    lantau/kernels/rotary.py), q to q_ptr, k and v to the token's cache slot (slot < 0 skips)."""
    HALF_DIM: tl.constexpr = HEAD_DIM // 2
    if head < num_q_heads + num_kv_heads:  # q or k: rotated
        row = cos_sin_ptr + tl.load(pos_ptr) * HEAD_DIM
        cos = tl.load(row + d)
        sin = tl.load(row + HALF_DIM + d)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < num_q_heads:
        dst = q_ptr + head * HEAD_DIM + d
        tl.store(dst, x1.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF_DIM, x2.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr)
        kv_head = (head - num_q_heads) % num_kv_heads
        offs = slot * (num_kv_heads * HEAD_DIM) + kv_head * HEAD_DIM + d
        keep = (d >= 0) & (slot >= 0)  # [P]: the padding row (slot -1) stores nothing
        out1 = x1.to(key_cache_ptr.dtype.element_ty)
        out2 = x2.to(key_cache_ptr.dtype.element_ty)
        if head < num_q_heads + num_kv_heads:
            tl.store(key_cache_ptr + offs, out1, mask=keep)
            tl.store(key_cache_ptr + offs + HALF_DIM, out2, mask=keep)
        else:
            tl.store(value_cache_ptr + offs, out1, mask=keep)
            tl.store(value_cache_ptr + offs + HALF_DIM, out2, mask=keep)


@triton.jit
def _after_wait(ss_in_ptr, y_ptr, offs_n, n_mask, SUMSQ_IN: tl.constexpr, RESIDUAL: tl.constexpr):
    """The loads that must follow the PDL wait but not the product, issued with x's: x's sum
    of squares (fp32; SUMSQ_IN) and the residual's rows (fp32; RESIDUAL). Zeros when off."""
    ss_in = 0.0
    if SUMSQ_IN:
        ss_in = tl.load(ss_in_ptr).to(tl.float32)
    residual = tl.zeros(offs_n.shape, tl.float32)
    if RESIDUAL:
        residual = tl.load(y_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return ss_in, residual


@triton.jit
def _add_sumsq(h, mask, ss_out_ptr, ss_zero_ptr, pid):
    """Add the sum of squares of h (the residual rows a program wrote, as rounded) to
    ss_out_ptr, in fp64: the programs' fp32 partial sums add exactly (or to ~1e-16, far below
    the fp32 the norm reads) in whatever order they come, so the norm is the same from run to
    run. Program 0 zeroes ss_zero_ptr (lantau.model.ops.NormSums)."""
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    tl.atomic_add(ss_out_ptr, tl.sum(hf * hf, axis=0).to(tl.float64), sem="relaxed")
    if pid == 0:
        tl.store(ss_zero_ptr, 0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] ([1, 2K] when SILU)
    w_ptr,  # [N, K] row-major (nn.Linear's weight)
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    y_ptr,  # [M, N]; the residual [1, N], updated in place, when RESIDUAL
    nw_ptr,  # [K] the RMSNorm weight when NORM and NORM_WEIGHT, else a dummy
    # sums of squares (fp64 [1] each, dummies unless SUMSQ_IN / SUMSQ_OUT): x's, read by NORM;
    # the new residual's, added to; a slot zeroed (lantau.model.ops.NormSums)
    ss_in_ptr,
    ss_out_ptr,
    ss_zero_ptr,
    # ROPE: the token's position [1], cos/sin cache [max_pos, HEAD_DIM] fp32, key and value
    # caches [num_slots, num_kv_heads, HEAD_DIM], its slot [1] (dummies when not ROPE)
    pos_ptr,
    cos_sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_q_heads,
    num_kv_heads,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_ym,
    M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,  # y = W rmsnorm(x): x is the residual stream (M == 1)
    NORM_WEIGHT: tl.constexpr,  # NORM's weight multiplied in (else folded into W: all ones)
    SUMSQ_IN: tl.constexpr,  # NORM: x's sum of squares read from ss_in_ptr, not summed here
    SUMSQ_OUT: tl.constexpr,  # RESIDUAL: the new residual's sum of squares added to ss_out_ptr
    SILU: tl.constexpr,  # y = W (silu(gate) * up) for x = [gate | up] (M == 1)
    RESIDUAL: tl.constexpr,  # y_ptr += W x, rounded as the unfused add (M == 1)
    GATED: tl.constexpr,  # y = silu(g) * u for [g | u] = W x: W is [gate; up], y N/2 wide
    # W is qkv_proj: rotary on q and k, q stored to y ([1, q_size]), k and v to their cache slot
    ROPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,  # M padded to a tensor-core tile (M > 1 only)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32: exact, not TF32
    USE_PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False,  # batch 1, BLOCK_K >= K: see gemv's `preload`
):
    pid = tl.program_id(0)
    HALF: tl.constexpr = BLOCK_N // 2
    if GATED or ROPE:
        # paired rows: the program's BLOCK_N // 2 rows, then each one's partner: a gate row's up
        # row, or a rotary dim d's d + HEAD_DIM / 2 (all in one head: HEAD_DIM % BLOCK_N == 0)
        local = tl.arange(0, BLOCK_N)
        if ROPE:
            head = pid * HALF // (HEAD_DIM // 2)
            first = head * HEAD_DIM + pid * HALF % (HEAD_DIM // 2)  # the program's first row
            partner = HEAD_DIM // 2
        else:
            first = pid * HALF
            partner = N // 2
        offs_j = first + local % HALF  # [BLOCK_N]: the first row of each row's pair
        offs_n = offs_j + (local // HALF) * partner
        n_mask = offs_n < N if ROPE else offs_j < N // 2
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if M == 1 and PRELOAD:
        # the program's whole weight slice (BLOCK_K >= K) in one load, issued before the wait:
        # it streams in while the previous kernel finishes
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :])
        if NORM and NORM_WEIGHT:  # no kernel writes it either
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        ss_in, residual = _after_wait(ss_in_ptr, y_ptr, offs_n, n_mask, SUMSQ_IN, RESIDUAL)
        x, sq = _x_chunk(x_ptr, nw_ptr, 0, offs_k, k_mask, K, False, SILU)
        if NORM and NORM_WEIGHT:
            x = x * nw
        acc = w.to(tl.float32) * x[None, :]
    elif M == 1:
        pdl_wait(USE_PDL)
        ss_in, residual = _after_wait(ss_in_ptr, y_ptr, offs_n, n_mask, SUMSQ_IN, RESIDUAL)
        # a 2-D accumulator, reduced once at the end: no cross-thread sum per chunk. NOTE: the
        # loop as written pipelines best; peeling the first weight tile out of it, to read it
        # before pdl_wait, cost 10-20% on the H200 (runs/2026-12-03-gpu_gemv-sweep-peeled.log)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + offs_k) < K
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :])
            x, sq_k = _x_chunk(x_ptr, nw_ptr, k, offs_k, k_mask, K, NORM and NORM_WEIGHT, SILU)
            acc += w.to(tl.float32) * x[None, :]
            if NORM and not SUMSQ_IN:
                sq += sq_k
    if M == 1:
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if NORM:
            total = ss_in if SUMSQ_IN else tl.sum(sq, axis=0)
            y *= tl.math.rsqrt(total / K + eps)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)
        if GATED or ROPE:  # rounded as the unfused product, then as the unfused kernel reads it
            lo, hi = tl.split(tl.trans(tl.reshape(y.to(tl.float32), (2, HALF))))  # pairs' halves
        if ROPE:
            d = first % HEAD_DIM + tl.arange(0, HALF)  # the pairs' dims within the head
            _rope_epilogue(
                lo, hi, d, head, y_ptr, pos_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr,
                slot_ptr, num_q_heads, num_kv_heads, HEAD_DIM,
            )  # fmt: skip
        elif GATED:  # silu_and_mul in fp32 of the gate (lo) and up (hi) rows
            offs_out = first + tl.arange(0, HALF)
            out = (lo * tl.sigmoid(lo) * hi).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + offs_out, out, mask=offs_out < N // 2)
        else:
            if RESIDUAL:  # the projection rounded, then the sum rounded: as x + residual
                y = (residual + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
                if SUMSQ_OUT:
                    _add_sumsq(y, n_mask, ss_out_ptr, ss_zero_ptr, pid)
            tl.store(y_ptr + offs_n, y, mask=n_mask)
    else:
        pdl_wait(USE_PDL)
        # several rows: one [M_PAD, BLOCK_K] x [BLOCK_K, BLOCK_N] tensor-core product per chunk,
        # so each weight tile is still read once whatever M is
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < M
        acc2 = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + offs_k) < K
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :])
            x_offs = offs_m[:, None] * stride_xm + (k + offs_k)[None, :]
            x = tl.load(x_ptr + x_offs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc2 += tl.dot(x, tl.trans(w).to(x.dtype), input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc2 += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_offs = offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(
            y_ptr + y_offs, acc2.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :]
        )


class Rope(NamedTuple):
    """What gemv's `rope` epilogue needs besides the product: one token's position [1] (int64),
    the cos/sin cache [max_position, head_dim] (fp32, lantau.model.ops.build_cos_sin_cache), the
    layer's paged cache [2, num_blocks, block_size, num_kv_heads, head_dim] and the token's slot
    [1] (int64; -1: nothing stored)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self, dtype: torch.dtype) -> None:
        head_dim = self.kv_cache.shape[-1]
        assert self.positions.shape == (1,) and self.positions.dtype == torch.int64, "positions"
        assert self.slot_mapping.shape == (1,) and self.slot_mapping.dtype == torch.int64, "slot"
        assert self.cos_sin_cache.dim() == 2 and self.cos_sin_cache.shape[1] == head_dim
        assert self.cos_sin_cache.dtype == torch.float32 and self.cos_sin_cache.is_contiguous()
        assert self.kv_cache.dim() == 5 and self.kv_cache.shape[0] == 2, "kv_cache layout"
        assert self.kv_cache.is_contiguous() and self.kv_cache.dtype == dtype, "kv_cache"

    def pointers(self) -> tuple[torch.Tensor, ...]:
        return (
            self.positions, self.cos_sin_cache, self.kv_cache[0], self.kv_cache[1],
            self.slot_mapping,
        )  # fmt: skip


# preload: the longest row a program loads at once (BLOCK_N * 16384 over its threads); the
# model takes it up to ops.preload_max_k, K <= 4096 as measured
PRELOAD_MAX_K = 16384


def preload_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the preload, from the H200 sweep of 5 tiles
    (benchmarks/runs/2026-12-03e-gemv_preload.log): 4 rows a program; 8 warps for lm_head's
    128k rows (4.50 TB/s vs 4.16 at 4 warps), 4 for the rest (o 3.43, qkv 3.74, gate_up 4.37).
    Rows past 4096 (down_proj's 14336): 2 rows over 8 warps, 64 registers of weights a thread
    as at K = 4096 (in W2's graph slower than the K loop, runs/2026-12-03zj-w2_chain.log)."""
    if k > 4096:
        return 2, 8, 1
    return (4, 8, 1) if n >= 65536 else (4, 4, 1)


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from a sweep of 36 tilings at batch 1 on an
    H200 (benchmarks/runs/2026-12-02-gpu_gemv-sweep.log): long rows take wide K chunks, tall
    matrices taller tiles, the small projections 8-row tiles (more programs in flight); long
    rows (down_proj) from W2's decode graph since (runs/2026-12-03zn)."""
    if k >= 8192:
        # down_proj of an 8B model: 4 rows over 2 warps, 1,024 programs spread over every SM
        # (32 x 1024 over 8 warps took 255 registers, one program an SM: 128 SMs of 132). In
        # W2's decode graph 3.776 / 3.778 (3 stages) vs 3.798 / 3.799 ms; W2 3.783 / 3.783 /
        # 3.784 / 3.785 vs 3.800 / 3.801 / 3.800 / 3.800 ms/token, same runs, alternated
        # (runs/2026-12-03zn-w2_knobs*.log; the old tiling alone ran at 4.02 TB/s, cuBLAS 3.87);
        # the CLI's W2 then 3.780 on that machine class (runs/2026-12-03zo-w2_cli.log)
        return 4, 1024, 2, 4
    if n >= 16384:  # gate_up 4.34 TB/s (cuBLAS 4.27), lm_head 4.5 (cuBLAS 3.94)
        return 16, 256, 4, 4
    return 8, 512, 4, 4  # qkv 3.58 TB/s (cuBLAS 3.32), o 3.1 (cuBLAS 2.69)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    rope: Rope | None = None,
    preload: bool = False,
    maxnreg: int | None = None,
    norm: bool = False,
    sumsq: torch.Tensor | None = None,
    sumsq_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for 1 to GEMV_MAX_M rows of x; fp32 accumulation.

    `preload` (batch 1, K up to PRELOAD_MAX_K): each program loads its whole weight slice
    (BLOCK_N rows, config's BLOCK_K ignored) at once, before waiting on the previous kernel.
    `maxnreg`: registers a thread may use at most (ptxas): fewer registers a program, more
    programs (and weight slices in flight) an SM. The preload's 4 rows over 4 warps take 185
    registers (2 programs an SM); at 168 they fit 3 with no spills (ptxas for sm_90).

    Batch 1 can also fold in the decoder layer's neighbours (one launch instead of two or three):
    - `norm_weight`: x is the residual stream, and the product is with rmsnorm(x) (eps); `norm`
      alone: the same with the norm's weight folded into `weight` (all ones);
    - `sumsq` (fp64 [1], with a norm): x's sum of squares, as a `sumsq_out` left it, read
      instead of summed by every program;
    - `silu`: x is [gate | up] (2K wide), and the product is with silu(gate) * up;
    - `residual` ([1, N]): the result is added to it in place, and it is returned;
      `sumsq_out` (fp64 [1] views (total, stale)): the new residual's sum of squares is added
      to `total` (zeroed beforehand), and `stale` zeroed;
    - `gated`: weight is [gate; up] (N = 2d), and the result is silu(x gate^T) * (x up^T),
      [1, d] (the SiLU-and-mul after the product, each program owning matching gate and up rows);
    - `rope`: weight is qkv_proj ([q; k; v] heads), and the product's q and k are rotated
      (rotate-half) at the token's position, k and v stored to the token's cache slot, and q
      returned, [1, q_size] (each program owning a head's dims d and d + head_dim / 2).
    """
    # x: [M, K]; weight: [N, K]; bias: [N] -> [M, N]
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    m, k = x.shape
    n = weight.shape[0]
    if silu:
        assert k % 2 == 0, f"silu: x must be [gate | up], got {tuple(x.shape)}"
        k //= 2
    assert 1 <= m <= GEMV_MAX_M, f"gemv serves 1 to {GEMV_MAX_M} rows, got {m}"
    assert weight.shape[1] == k, f"x has K={k}, weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype, f"x {x.dtype}, weight {weight.dtype}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous along K"
    assert x.device == weight.device, f"x on {x.device}, weight on {weight.device}"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype, f"bias {tuple(bias.shape)}"
    norm = norm or norm_weight is not None
    fused = norm or silu or residual is not None or gated or rope is not None
    assert m == 1 or not fused, f"the fusions serve batch 1, got {m} rows"
    assert not gated or (residual is None and n % 2 == 0), f"gated: N={n} must be even, no residual"
    assert not (norm and silu), "a norm and silu do not combine"
    assert sumsq is None or norm, "sumsq is a norm's input"
    assert sumsq_out is None or residual is not None, "sumsq_out is a residual's output"
    for t in (sumsq, *(sumsq_out or ())):
        assert t is None or (t.shape == (1,) and t.dtype == torch.float64), "sums: fp64 [1]"
    if norm_weight is not None:
        assert norm_weight.shape == (k,), f"norm_weight {tuple(norm_weight.shape)}, K={k}"
        assert norm_weight.dtype == x.dtype, f"norm_weight {norm_weight.dtype}, x {x.dtype}"
    head_dim = num_q_heads = num_kv_heads = 0
    if rope is not None:
        assert not gated and residual is None, "rope does not combine with gated or residual"
        num_kv_heads, head_dim = rope.kv_cache.shape[3:]
        num_q_heads = n // head_dim - 2 * num_kv_heads
        assert n % head_dim == 0 and num_q_heads > 0, f"rope: N={n} is not q, k and v heads"
        rope.check(x.dtype)
    if residual is not None:
        assert residual.shape == (1, n), f"residual {tuple(residual.shape)}, expected (1, {n})"
        assert residual.dtype == x.dtype and residual.stride(1) == 1, "residual dtype/stride"
        y = residual
    else:
        width = num_q_heads * head_dim if rope else n // 2 if gated else n
        y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or default_config(n, k)
    if preload:
        assert m == 1 and k <= PRELOAD_MAX_K, f"preload serves 1 row, K <= {PRELOAD_MAX_K}"
        block_n, num_warps, num_stages = (block_n, num_warps, 1) if config else preload_config(n, k)
        block_k = triton.next_power_of_2(k)
    if m > 1:
        block_n = max(block_n, 16)  # a tensor-core tile's N
    if gated or rope:
        block_n = max(block_n, 2)  # a gate row and its up row, or a rotary pair, at least
    if rope:
        block_n = min(block_n, head_dim)
        assert head_dim % block_n == 0, f"rope: BLOCK_N={block_n} must divide head_dim {head_dim}"
    grid = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    _gemv_kernel[(grid,)](
        x, weight, weight if bias is None else bias, y,
        weight if norm_weight is None else norm_weight,
        weight if sumsq is None else sumsq, *(sumsq_out or (weight, weight)),
        *(rope.pointers() if rope else (weight,) * 5), num_q_heads, num_kv_heads, n, k, eps,
        x.stride(0), weight.stride(0), y.stride(0),
        M=m, HAS_BIAS=bias is not None, NORM=norm, NORM_WEIGHT=norm_weight is not None,
        SUMSQ_IN=sumsq is not None, SUMSQ_OUT=sumsq_out is not None, SILU=silu,
        RESIDUAL=residual is not None, GATED=gated, ROPE=rope is not None, HEAD_DIM=head_dim,
        PRELOAD=preload, BLOCK_N=block_n,
        BLOCK_K=block_k,
        M_PAD=max(16, triton.next_power_of_2(m)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(x.device),
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    return y


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    norm: bool = False,
) -> torch.Tensor:
    """fp32 reference of gemv, fusions included (residual is not modified)."""
    x = x.float()
    if norm or norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if norm_weight is not None:
        x = x * norm_weight.float()
    if silu:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    y = x @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else y + residual.float()
