"""Scatter this step's keys and values into the paged KV cache.

Cache layout (see lantau/kernels/reference.py): [2, num_blocks, block_size, num_kv_heads, head_dim],
so slot s of keys starts at element s * num_kv_heads * head_dim of kv_cache[0]. Each token's
num_kv_heads * head_dim values are contiguous on both sides, so one program copies one token as a
single vectorised row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantau.kernels import pdl
from lantau.kernels.pdl import pdl_wait


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_row_stride,
    value_row_stride,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_SIZE: tl.constexpr,  # next power of 2 of ROW_SIZE
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # int64: token * row_stride and slot * ROW_SIZE can pass 2**31 on large batches and caches
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, BLOCK_SIZE)
    # slot < 0 marks a padding row (CUDA-graph batches): the masks turn every access off
    mask = (offs < ROW_SIZE) & (slot >= 0)
    key = tl.load(key_ptr + token * key_row_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_row_stride + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW_SIZE + offs, key, mask=mask)
    tl.store(value_cache_ptr + slot * ROW_SIZE + offs, value, mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy key/value row t to cache slot slot_mapping[t]; rows with slot < 0 are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim], any row stride (views of a fused qkv
    output), last two dims contiguous. kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] contiguous. slot_mapping: [num_tokens] int64. Slots are not range-checked (that
    would need a device sync); a slot >= num_blocks * block_size writes out of bounds.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (
        f"kv_cache heads {tuple(kv_cache.shape[3:])} != key heads {(num_kv_heads, head_dim)}"
    )
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert key.dtype == value.dtype == kv_cache.dtype, (
        f"dtypes differ: key {key.dtype}, value {value.dtype}, cache {kv_cache.dtype}"
    )
    assert slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    assert key.device == value.device == kv_cache.device == slot_mapping.device
    for name, t in (("key", key), ("value", value)):
        # each token's heads must form one contiguous row; only the row stride may vary
        assert t.stride(2) == 1 and t.stride(1) == head_dim, f"{name} strides {t.stride()}"
    assert kv_cache.is_contiguous() and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    block_size = triton.next_power_of_2(row_size)
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW_SIZE=row_size,
        BLOCK_SIZE=block_size,
        **pdl.launch_options(key.device),
        # about 8 elements (16 bytes of fp16) per thread per access
        num_warps=min(max(block_size // 256, 1), 16),
    )
