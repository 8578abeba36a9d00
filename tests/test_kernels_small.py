"""Small Triton kernels vs their torch references and the lantau code they replace
(lantau/kernels/reference.py, which TorchOps runs; rope_inv_freq).

Runs on CPU through the Triton interpreter. NOTE: triton.jit picks interpreted or compiled mode
when a kernel module is imported, so TRITON_INTERPRET must be set before lantau.kernels loads.

bf16 runs too, at a looser tolerance: the interpreter rounds fp32 -> bf16 toward zero (a GPU
rounds to nearest), so its bf16 outputs can sit one or two bf16 ulps from torch's.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from lantau.config import RopeScaling  # noqa: E402
from lantau.kernels import activation  # noqa: E402
from lantau.kernels.activation import silu_and_mul  # noqa: E402
from lantau.kernels.embedding import embedding  # noqa: E402
from lantau.kernels.lora import add_lora  # noqa: E402
from lantau.kernels.reference import (  # noqa: E402
    add_rms_norm_ref,
    embedding_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
    write_kv_cache_ref,
)
from lantau.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from lantau.kernels.rotary import apply_rotary_and_write_kv  # noqa: E402
from lantau.model import ops  # noqa: E402
from lantau.model.llama import rope_inv_freq  # noqa: E402
from lantau.model.lora import LoRABatch, LoRAWeights  # noqa: E402
from lantau.model.lora import add_lora as add_lora_ref  # noqa: E402
from lantau.model.ops import build_cos_sin_cache  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) per dtype
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}
NAN = float("nan")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, equal_nan: bool = False) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=equal_nan)


def padded_rows(num_tokens: int, width: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """A [num_tokens, width] random view whose rows sit in a NaN-padded [.., width + pad] buffer.

    Row stride != width exercises the stride arguments; the NaN columns catch stray writes.
    """
    buf = torch.full((num_tokens, width + pad), NAN, dtype=dtype)
    buf[:, :width] = torch.randn(num_tokens, width, dtype=dtype)
    return buf[:, :width]


def assert_pad_untouched(view: torch.Tensor) -> None:
    # view: [num_tokens, width] slice of a wider NaN-padded buffer
    buf = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1))
    assert buf[:, view.shape[1] :].isnan().all(), "kernel wrote past the end of a row"


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [96, 576])
def test_rms_norm(dtype: torch.dtype, hidden_size: int) -> None:
    torch.manual_seed(1)
    num_tokens, eps = 5, 1e-5
    x = padded_rows(num_tokens, hidden_size, 16, dtype) * 3
    weight = (1 + 0.1 * torch.randn(hidden_size)).to(dtype)
    out = padded_rows(num_tokens, hidden_size, 16, dtype).fill_(NAN)

    assert rms_norm(x, weight, eps, out=out) is out
    assert not out.isnan().any(), "an output element was not written"
    assert_pad_untouched(out)
    assert_close(out, rms_norm_ref(x, weight, eps))
    assert_close(rms_norm(x, weight, eps), out)  # freshly allocated output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [96, 576])
def test_fused_add_rms_norm(dtype: torch.dtype, hidden_size: int) -> None:
    torch.manual_seed(2)
    num_tokens, eps = 5, 1e-6
    x = padded_rows(num_tokens, hidden_size, 16, dtype)
    residual = padded_rows(num_tokens, hidden_size, 8, dtype) * 4
    weight = (1 + 0.1 * torch.randn(hidden_size)).to(dtype)

    x_ref, residual_ref = add_rms_norm_ref(x, residual, weight, eps)

    fused_add_rms_norm(x, residual, weight, eps)
    assert_pad_untouched(x)
    assert_pad_untouched(residual)
    assert_close(residual, residual_ref)
    assert_close(x, x_ref)


def test_fused_add_rms_norm_scales_an_unscaled_product_first() -> None:
    """row_scale / col_scale: x as an unscaled fp8 product (o_proj's, down_proj's) is
    scaled before the residual add: the reference's result on the scaled product."""
    torch.manual_seed(3)
    num_tokens, hidden_size, eps = 4, 1000, 1e-6
    raw = torch.randn(num_tokens, hidden_size) * 300
    row_scale = (torch.rand(num_tokens) + 0.5) * 1e-2
    col_scale = (torch.rand(hidden_size) + 0.5) * 0.3
    residual = torch.randn(num_tokens, hidden_size)
    weight = 1 + 0.1 * torch.randn(hidden_size)
    x_ref, residual_ref = add_rms_norm_ref(
        raw * row_scale[:, None] * col_scale[None, :], residual, weight, eps
    )
    fused_add_rms_norm(raw, residual, weight, eps, row_scale=row_scale, col_scale=col_scale)
    assert_close(residual, residual_ref)
    assert_close(raw, x_ref)
    with pytest.raises(AssertionError, match="row_scale must be"):
        fused_add_rms_norm(raw, residual, weight, eps, row_scale=row_scale[:2], col_scale=col_scale)


# ---------------------------------------------------------------- rotary

LLAMA3_SCALING = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,  # small, so the ramp covers some frequencies
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
def test_apply_rotary_and_write_kv(
    dtype: torch.dtype, head_dim: int, scaling: RopeScaling | None
) -> None:
    """q rotated in place as rotary_ref rotates it, and the cache as write_kv_cache_ref leaves
    it with the rotated keys; padding rows (slot -1) and foreign slots untouched, k and v not
    modified, unless store_kv: then k rotated in place. Head counts are not powers of 2, so the
    head masks matter."""
    torch.manual_seed(4)
    num_tokens, num_heads, num_kv_heads, num_blocks, block_size = 7, 6, 3, 4, 4
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = padded_rows(num_tokens, q_size + 2 * kv_size, 8, dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([700, 3, 0, 1023, 3, 41, 9])  # out of order, repeated, both ends
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[[2, 5]] = -1  # padding rows
    inv_freq = rope_inv_freq(head_dim, 500000.0, scaling)
    cos_sin_cache = build_cos_sin_cache(inv_freq, 1024)
    # the cache the model builds, against the angles computed directly
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    torch.testing.assert_close(cos_sin_cache[positions], torch.cat((freqs.cos(), freqs.sin()), -1))
    poisoned = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)

    cache_ref = poisoned.clone()
    q_ref, k_ref = rotary_ref(q, k, positions, cos_sin_cache)
    write_kv_cache_ref(k_ref, v, cache_ref, slot_mapping)
    k_before, v_before, cache = k.clone(), v.clone(), poisoned.clone()
    apply_rotary_and_write_kv(q, k, v, positions, cos_sin_cache, cache, slot_mapping)
    assert_close(q, q_ref)
    assert_close(cache, cache_ref, equal_nan=True)  # NaN exactly where no real row wrote
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    assert_pad_untouched(qkv)
    # store_kv (a step with prompt rows, for fresh_attention): k rotated in place, padding
    # rows too; v, a scaled product already, unchanged; the cache as before
    cache = poisoned.clone()
    q_twice = q.clone()
    apply_rotary_and_write_kv(q_twice, k, v, positions, cos_sin_cache, cache, slot_mapping,
                              store_kv=True)  # fmt: skip
    assert_close(k, k_ref)
    assert torch.equal(v, v_before)
    assert_close(cache, cache_ref, equal_nan=True)
    assert_pad_untouched(qkv)


@pytest.mark.usefixtures("interpreter_fp8_cast")
@pytest.mark.parametrize("kv_dtype", ["model", torch.float8_e4m3fn])
def test_rotary_scales_an_unscaled_product_first(kv_dtype) -> None:
    """row_scale / col_scale: q, k and v as an unscaled fp8 product (a tensor-wise GEMM's)
    give what the scaled product would: q rotated in place, the rotated keys and the values in
    the cache (an fp8 cache's quantized from the scaled values), and with store_kv k and v in
    place, rotated and scaled. bf16, head 128 (llama's)."""
    torch.manual_seed(6)
    dtype, head_dim, num_tokens, num_heads, num_kv_heads = torch.bfloat16, 128, 5, 4, 2
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    raw = torch.randn(num_tokens, q_size + 2 * kv_size) * 300  # an e4m3 product's magnitudes
    row_scale = (torch.rand(num_tokens) + 0.5) * 1e-2  # scaled values of about 1
    col_scale = (torch.rand(q_size + 2 * kv_size) + 0.5) * 0.3
    scaled = (raw * row_scale[:, None] * col_scale[None, :]).to(dtype)
    raw = raw.to(dtype)
    positions = torch.tensor([3, 0, 99, 7, 12])
    slots = torch.tensor([5, 0, -1, 9, 2])
    cos_sin = build_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, None), 128)
    cache_dtype = dtype if kv_dtype == "model" else kv_dtype
    caches = [torch.zeros(2, 4, 4, num_kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    qs, ks, vs = [], [], []
    for qkv, cache, scales in ((scaled, caches[0], {}), (raw, caches[1], None)):
        qkv = qkv.clone()
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        if scales is None:
            scales = dict(row_scale=row_scale, col_scale=col_scale)
        apply_rotary_and_write_kv(
            q, k, v, positions, cos_sin, cache, slots, store_kv=True, **scales
        )
        qs.append(q)
        ks.append(k)
        vs.append(v)
    # store_kv: k rotated and v scaled in place, as the scaled product's
    torch.testing.assert_close(ks[1], ks[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(vs[1], vs[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(vs[0], scaled[:, q_size + kv_size :].view_as(vs[0]))
    # the scaled product was rounded to bf16 before its rotation, the raw one only after: a
    # bf16 step apart (values of about 1), an fp8 cache's values an e4m3 step (1/8 at most)
    torch.testing.assert_close(qs[1], qs[0], rtol=2e-2, atol=2e-2)
    step = 0.13 if cache_dtype == torch.float8_e4m3fn else 2e-2
    torch.testing.assert_close(caches[1].float(), caches[0].float(), rtol=step, atol=2e-2)
    assert caches[1].float().abs().sum() > 0
    with pytest.raises(AssertionError, match="go together"):
        apply_rotary_and_write_kv(q, k, v, positions, cos_sin, cache, slots, row_scale=row_scale)


def test_rope_linear_scaling_cache() -> None:
    # linear scaling reaches the cache only through rope_inv_freq
    scaling = RopeScaling(rope_type="linear", factor=4.0)
    plain = build_cos_sin_cache(rope_inv_freq(64, 10000.0, None), 64)
    scaled = build_cos_sin_cache(rope_inv_freq(64, 10000.0, scaling), 256)
    torch.testing.assert_close(scaled[::4], plain)


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,max_block_size", [(96, 4096), (576, 4096), (576, 128)])
def test_silu_and_mul(
    dtype: torch.dtype, d: int, max_block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_block_size 128 splits each row over 5 programs, the last one partial
    monkeypatch.setattr(activation, "MAX_BLOCK_SIZE", max_block_size)
    torch.manual_seed(4)
    num_tokens = 5
    x = padded_rows(num_tokens, 2 * d, 16, dtype) * 3
    out = padded_rows(num_tokens, d, 8, dtype).fill_(NAN)

    assert silu_and_mul(x, out=out) is out
    assert not out.isnan().any(), "an output element was not written"
    assert_pad_untouched(out)
    assert_close(out, silu_and_mul_ref(x))
    assert_close(silu_and_mul(x), out)  # freshly allocated output


def test_silu_and_mul_scales_an_unscaled_product_first() -> None:
    """row_scale / col_scale: x as an unscaled fp8 product gives silu_and_mul of the scaled
    one (both halves by their own columns' scales); misshapen scales are refused."""
    torch.manual_seed(7)
    num_tokens, d = 6, 300
    raw = torch.randn(num_tokens, 2 * d) * 200
    row_scale = torch.rand(num_tokens) * 1e-2 + 1e-3
    col_scale = torch.rand(2 * d) * 1e-2 + 1e-3
    expected = silu_and_mul_ref(raw * row_scale[:, None] * col_scale[None, :])
    assert_close(silu_and_mul(raw, row_scale=row_scale, col_scale=col_scale), expected)
    with pytest.raises(AssertionError, match="col_scale must be"):
        silu_and_mul(raw, row_scale=row_scale, col_scale=col_scale[:d])
    with pytest.raises(AssertionError, match="go together"):
        silu_and_mul(raw, col_scale=col_scale)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 2500])  # one, one partial, three programs a row
def test_embedding_with_device_picked_ids(dtype: torch.dtype, hidden: int) -> None:
    """Plain lookups, and rows whose id comes from prev_ids (the previous step's samples), as
    torch's where + embedding do; the weight rows copied exactly."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(300, hidden, generator=gen).to(dtype)
    ids = torch.tensor([5, 299, 0, 17, 42], dtype=torch.int64)
    assert torch.equal(embedding(ids, weight), torch.nn.functional.embedding(ids, weight))
    prev = torch.tensor([250, 7, 123], dtype=torch.int64)
    src = torch.tensor([-1, 2, -1, 0, 1], dtype=torch.int64)
    out = embedding(ids, weight, src, prev)
    assert torch.equal(out, embedding_ref(ids, weight, src, prev))
    assert torch.equal(out[1], weight[123]) and torch.equal(out[3], weight[250])
    assert torch.equal(out[0], weight[5]) and torch.equal(out[4], weight[7])
    # a strided weight view (rows of a wider table)
    wide = torch.randn(300, hidden + 8, generator=gen).to(dtype)
    assert torch.equal(embedding(ids, wide[:, :hidden]), wide[ids, :hidden])
    # TorchOps and TritonOps agree
    triton_out = ops.TritonOps().embed(ids, weight, src, prev)
    assert torch.equal(triton_out, ops.TorchOps.embed(ids, weight, src, prev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,k,splits", [(1, 96, None), (5, 300, 3), (20, 300, None),
                                                 (20, 300, 2), (70, 96, None)])  # fmt: skip
def test_lora_deltas(dtype: torch.dtype, num_tokens: int, k: int, splits: int | None) -> None:
    """Each token's adapter delta in two launches equals the masked reference's (every slot's
    columns computed, the others masked), with shapes off the tiles (K 96 < 128 or 300 over
    128-wide splits, 3 slots of 12 rows: 36 columns, N 80); the base model's rows (slot -1)
    keep y's bits."""
    torch.manual_seed(num_tokens)
    n, slots, rank = 80, 3, 12
    x = padded_rows(num_tokens, k, 8, dtype)
    a = torch.randn(slots * rank, k, dtype=dtype) * 0.3
    b = torch.randn(n, slots * rank, dtype=dtype) * 0.3
    index = torch.arange(num_tokens) % (slots + 1) - 1  # every slot and the base model
    y = torch.randn(num_tokens, n, dtype=dtype)
    expected, before = y.clone(), y.clone()
    add_lora_ref(expected, x, LoRAWeights(a, b, rank), LoRABatch(index))
    add_lora(y, x, a, b, index, rank, splits=splits)
    # bf16: both round x A^T (values up to ~8, an ulp of 1/32) before B, the interpreter toward 0
    tolerance = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 6e-2)
    torch.testing.assert_close(y, expected, rtol=tolerance[0], atol=tolerance[1])
    base = index < 0
    assert torch.equal(y[base], before[base])
    if num_tokens > 1:
        assert not torch.equal(y[~base], before[~base])  # the adapters' rows moved
    with_deltas = y.clone()
    add_lora(y, x, a, b, torch.full_like(index, -1), rank)  # no adapter rows: y as it was
    assert torch.equal(y, with_deltas)


def test_launchers_reject_bad_inputs() -> None:
    f32, f16 = torch.float32, torch.float16

    x, weight = torch.randn(3, 96), torch.ones(96)
    with pytest.raises(AssertionError):  # weight dtype differs
        rms_norm(x, weight.to(f16), 1e-6)
    with pytest.raises(AssertionError):  # hidden size mismatch
        rms_norm(x, torch.ones(95), 1e-6)
    with pytest.raises(AssertionError):  # 3-D input
        rms_norm(x[None], weight, 1e-6)
    with pytest.raises(AssertionError):  # integer input
        rms_norm(x.long(), weight.long(), 1e-6)
    with pytest.raises(AssertionError):  # strided last dim
        fused_add_rms_norm(x, torch.randn(96, 3).t(), weight, 1e-6)

    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cos_sin_cache, positions = torch.zeros(16, 64), torch.arange(3)
    kv_cache, slots = torch.zeros(2, 2, 4, 2, 64), torch.arange(3)

    def rotary(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
               slots=slots):  # fmt: skip
        apply_rotary_and_write_kv(q, k, k, positions, cos_sin_cache, kv_cache, slots)

    for bad in (
        dict(cos_sin_cache=cos_sin_cache.to(f16)),  # fp16 angles
        dict(k=k.to(f16)),  # q and k dtypes differ
        dict(positions=positions.int()),  # int32 positions
        dict(cos_sin_cache=torch.zeros(16, 32, dtype=f32)),  # width != head_dim
        dict(positions=torch.arange(4)),  # wrong number of positions
        dict(kv_cache=kv_cache.half()),  # cache dtype differs from k
        dict(slots=slots.int()),  # int32 slot mapping
        dict(kv_cache=torch.zeros(2, 2, 4, 2, 32)),  # head_dim mismatch
    ):
        with pytest.raises(AssertionError):
            rotary(**bad)

    ids, table = torch.arange(3), torch.randn(10, 16)
    with pytest.raises(AssertionError, match="input_ids"):  # int32 ids
        embedding(ids.int(), table)
    with pytest.raises(AssertionError, match="go together"):  # a source without prev_ids
        embedding(ids, table, pick_src=ids)
    with pytest.raises(AssertionError, match="pick_src"):  # one source short
        embedding(ids, table, ids[:2], ids)
    with pytest.raises(AssertionError, match="weight"):  # transposed table
        embedding(ids, table.t())

    with pytest.raises(AssertionError):  # odd width
        silu_and_mul(torch.randn(3, 97))
    with pytest.raises(AssertionError):  # out of the wrong width
        silu_and_mul(torch.randn(3, 96), out=torch.empty(3, 96))
    with pytest.raises(AssertionError):  # out of another dtype
        silu_and_mul(torch.randn(3, 96), out=torch.empty(3, 48, dtype=f16))
