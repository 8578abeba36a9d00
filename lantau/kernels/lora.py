"""LoRA adapter deltas of a step's tokens, each token through its own adapter's slot, in two
launches a projection (the torch reference, lantau.model.lora.add_lora, takes three GEMM and
elementwise launches and computes every slot's columns for every row whatever the batch):

    shrink:  xa[t, c] = (x[t] . A[c]) if column c belongs to token t's slot, else 0
    expand:  y[t, :] += xa[t] @ B^T                       (in place on the base product)

A holds every slot's rows side by side (`rank` rows a slot: a fused projection's parts times
the adapters' largest rank), B every slot's columns. A program whose tokens use none of its
columns' slots (the base model's rows, other adapters') skips its loop: a step without adapter
rows costs the two launches only, so the CUDA graphs capture these kernels whatever the batch
holds. The shrink writes fp32 partial sums, one a split of K (a decode batch has few programs
otherwise, each walking all of K); the expand adds them up and rounds xa to the activations'
dtype, as the reference's product is, before B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau import envs
from lantau.kernels import pdl
from lantau.kernels.attention_tiles import dot_precision
from lantau.kernels.pdl import pdl_wait


# NOTE: T (the step's tokens) is not specialized on: an eager prompt step of any length runs
# the variant the graphs' captures compiled, never a new compile while serving
@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(
    x_ptr,  # [T, K], rows contiguous
    a_ptr,  # [W, K] every slot's A rows
    index_ptr,  # [T] int64: each token's slot (-1: the base model)
    part_ptr,  # [SPLIT, T, W] fp32 out: split s's share of K
    T,
    K,
    W,
    stride_x,
    k_per_split,  # a multiple of BLOCK_K
    RANK: tl.constexpr,  # A's rows a slot
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter: see add_lora
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: exact, not TF32
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    split = tl.program_id(2)
    t_mask, w_mask = offs_t < T, offs_w < W
    slot = tl.load(index_ptr + offs_t, mask=t_mask, other=-1)
    keep = ((offs_w // RANK)[None, :] == slot[:, None]) & w_mask[None, :]  # [BLOCK_T, BLOCK_W]
    acc = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
    if tl.max(keep.to(tl.int32)) > 0:  # else: no token here uses these columns' slots
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x
        a_cols = a_ptr + offs_w.to(tl.int64)[None, :] * K  # A^T's columns
        for i in range(0, k_per_split, BLOCK_K):  # the last split's tail masked
            k = split * k_per_split + i
            k_mask = (k + offs_k) < K
            x = tl.load(x_rows + k + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            a = tl.load(a_cols + k + offs_k[:, None], mask=k_mask[:, None] & w_mask[None, :],
                        other=0.0)  # fmt: skip
            if UPCAST:
                x, a = x.to(tl.float32), a.to(tl.float32)
            acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    out = tl.where(keep, acc, 0.0)
    rows = (split * T + offs_t).to(tl.int64)
    tl.store(part_ptr + rows[:, None] * W + offs_w[None, :], out,
             mask=t_mask[:, None] & w_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(
    part_ptr,  # [SPLIT, T, W] fp32: the shrink's
    b_ptr,  # [N, W] every slot's B columns
    index_ptr,  # [T] int64
    y_ptr,  # [T, N] the base product, rows contiguous: added to in place
    T,
    N,
    W,
    stride_y,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    slot = tl.load(index_ptr + offs_t, mask=t_mask, other=-1)
    if tl.max(slot) < 0:  # the base model's rows only: y stays as it is
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for w in range(0, W, BLOCK_W):
        w_mask = (w + offs_w) < W
        xa = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
        for s in range(SPLIT):
            rows = (s * T + offs_t).to(tl.int64)
            xa += tl.load(part_ptr + rows[:, None] * W + w + offs_w[None, :],
                          mask=t_mask[:, None] & w_mask[None, :], other=0.0)  # fmt: skip
        b = tl.load(
            b_ptr + offs_n.to(tl.int64)[None, :] * W + w + offs_w[:, None],
            mask=w_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # B^T's tile
        # x A^T rounded to the activations' dtype, as the reference's product is
        xa = xa.to(b_ptr.dtype.element_ty)
        if UPCAST:
            xa, b = xa.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(xa, b, input_precision=DOT_PRECISION)
    ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    mask = t_mask[:, None] & n_mask[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block_t(num_tokens: int) -> int:
    """Tokens a program: 16 (the smallest dot) for decode batches, more for prompt chunks."""
    return 16 if num_tokens <= 64 else 64


def default_splits(num_tokens: int, k: int) -> int:
    """The shrink's K splits: a decode batch's few programs (tokens x A's columns) would each
    walk all of K, so K is cut in pieces of about 1,024; prompt chunks have programs enough."""
    return min(max(k // 1024, 1), 16) if num_tokens <= 64 else 1


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    rank: int,
    use_pdl: bool = True,
    splits: int | None = None,
) -> None:
    """y += each token's adapter delta, in place: y [T, N] (x's product), x [T, K], a [W, K],
    b [N, W] (W = slots x rank, slot s's columns s * rank onwards), index [T] int64 (-1: the
    base model, no delta). splits: the shrink's K splits (None: default_splits)."""
    assert x.dim() == 2 and y.dim() == 2 and y.shape[0] == x.shape[0], (x.shape, y.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    assert a.is_contiguous() and b.is_contiguous(), "adapter weights must be contiguous"
    num_tokens, k = x.shape
    width, n = a.shape[0], y.shape[1]
    assert a.shape == (width, k) and b.shape == (n, width), (a.shape, b.shape, x.shape, y.shape)
    assert index.shape == (num_tokens,) and index.dtype == torch.int64, (index.shape, index.dtype)
    if num_tokens == 0 or width == 0:
        return
    block_t, block_k = _block_t(num_tokens), 128
    splits = splits or default_splits(num_tokens, k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty((splits, num_tokens, width), dtype=torch.float32, device=x.device)
    # NOTE: Triton 3.6's interpreter multiplies bf16 tiles' bits as integers in tl.dot; there
    # the tiles go to fp32 first (each product exact either way, the sums in fp32)
    upcast = envs.triton_interpret() and x.dtype == torch.bfloat16
    options = dict(DOT_PRECISION=dot_precision(x.dtype), **pdl.launch_options(x.device, use_pdl))
    # decode batches: narrow column blocks, more programs; prompt chunks: x read fewer times
    block_w = min(max(triton.next_power_of_2(width), 16), 32 if num_tokens <= 64 else 64)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w), splits)
    _shrink_kernel[grid](
        x, a, index, parts, num_tokens, k, width, x.stride(0), k_per_split, RANK=rank,
        BLOCK_T=block_t, BLOCK_W=block_w, BLOCK_K=block_k, UPCAST=upcast, num_warps=4,
        **options,
    )  # fmt: skip
    block_n = 128
    _expand_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))](
        parts, b, index, y, num_tokens, n, width, y.stride(0), SPLIT=splits, BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_W=min(max(triton.next_power_of_2(width), 16), 64),
        UPCAST=upcast, num_warps=4, **options,
    )  # fmt: skip
