"""Token embedding lookup, optionally picking each row's token id on the device first.

A CUDA-graph decode step learns some of its input tokens only on the device: those the step
before sampled. Each row then names a source (`pick_src`): -1 takes the host's id, s >= 0 the
id in `prev_ids[s]`. Picking with torch and then embedding takes five launches (compare, clamp,
gather, where, index_select) at the start of every decode step; here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait

BLOCK = 1024  # hidden dims a program copies


@triton.jit
def _embedding_kernel(
    ids_ptr,  # [num_tokens] int64
    src_ptr,  # [num_tokens] int64, when PICK: -1 or a row of prev_ids
    prev_ptr,  # [*] int64, when PICK
    weight_ptr,  # [vocab_size, hidden]
    out_ptr,  # [num_tokens, hidden]
    hidden,
    stride_weight,
    stride_out,
    PICK: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    token = tl.load(ids_ptr + row)
    if PICK:
        src = tl.load(src_ptr + row)
        if src >= 0:
            token = tl.load(prev_ptr + src)
    x = tl.load(weight_ptr + token * stride_weight + offs, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, x, mask=mask)


def embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    pick_src: torch.Tensor | None = None,
    prev_ids: torch.Tensor | None = None,
    use_pdl: bool = True,
) -> torch.Tensor:
    """weight[ids] as [num_tokens, hidden], ids[i] = prev_ids[pick_src[i]] where pick_src[i] >= 0
    (both given), else input_ids[i]. Ids are not range-checked: callers validate them."""
    assert input_ids.dim() == 1 and input_ids.dtype == torch.int64, "input_ids: [n] int64"
    assert weight.dim() == 2 and weight.stride(1) == 1, f"weight {tuple(weight.shape)}"
    pick = pick_src is not None
    assert pick == (prev_ids is not None), "pick_src and prev_ids go together"
    if pick:
        assert pick_src.shape == input_ids.shape and pick_src.dtype == torch.int64, "pick_src"
        assert prev_ids.dim() == 1 and prev_ids.dtype == torch.int64, "prev_ids: [*] int64"
        for t in (input_ids, pick_src, prev_ids):
            assert t.device == weight.device and t.stride(0) == 1, "ids: contiguous, one device"
    num_tokens, hidden = input_ids.shape[0], weight.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    _embedding_kernel[(num_tokens, triton.cdiv(hidden, BLOCK))](
        input_ids, pick_src if pick else input_ids, prev_ids if pick else input_ids, weight,
        out, hidden, weight.stride(0), out.stride(0), PICK=pick, BLOCK=BLOCK,
        **pdl.launch_options(weight.device, use_pdl),
    )  # fmt: skip
    return out
