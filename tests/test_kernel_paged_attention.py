"""Paged attention kernels vs lantau.kernels.reference (paged_attention_ref, per-request refs).

Runs on CPU through the Triton interpreter. NOTE: triton.jit picks interpreted or compiled mode
when a kernel module is imported, so TRITON_INTERPRET must be set before lantau.kernels loads.

Caches are built adversarially: block ids shuffled, every slot no request owns (the tails of
last blocks, spare blocks, block 0 that pads the tables) holds NaN, and `out` starts as NaN,
so a read past seq_len or an unwritten row shows up as NaN in the result.

bf16: the interpreter of Triton 3.6 multiplies bf16 tl.dot operands as their raw uint16 bits
(numpy has no bf16); the `interpreter_bf16_dot` fixture upcasts them to fp32 first, as a GPU's
bf16 MMA does with fp32 accumulation. The kernels themselves are unchanged.
"""

from __future__ import annotations

import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402, F401  (fail, don't skip, when triton is missing)

from lantau.config import AttnMerge  # noqa: E402
from lantau.kernels import decode_attention as da  # noqa: E402
from lantau.kernels import reference  # noqa: E402
from lantau.kernels import unified_attention as ua  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) against fp32 references: fp32 is exact up to summation order; half precision
# rounds q, K, V, the probabilities fed to the PV dot and the output
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (2e-2, 3e-2),
}
# (num_heads, num_kv_heads, head_dim): plain multi-head, and GQA 3 (not a power of 2: a tile
# holds whole groups and leaves padding rows)
HEAD_CONFIGS = [(4, 4, 32), (6, 2, 64)]
# (seq_len, num_q) per request: decode at 17, a 37-token prefill, decode at 1, a 9-token chunk
# after a 40-token cached prefix, decode at 70
MIXED_BATCH = [(17, 1), (37, 37), (1, 1), (49, 9), (70, 1)]


pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")  # see tests/conftest.py


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    """Random q and a NaN-poisoned paged cache holding each request's first seq_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [seq_len for seq_len, _ in requests]
    query_lens = [num_q for _, num_q in requests]
    num_blocks_per_req = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(num_blocks_per_req) + 3  # spare blocks stay NaN
    # block 0 pads the tables (as in the engine) and stays NaN: a masked block-table load that
    # falls back to block 0 must not reach the output either
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(num_blocks_per_req) + 1  # a padding column past every request's blocks
    block_tables = torch.zeros((len(requests), max_blocks), dtype=torch.int32)
    kv_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(kv_shape, float("nan"), dtype=dtype)
    flat_kv = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    for i, seq_len in enumerate(seq_lens):
        ids = [block_ids.pop() for _ in range(num_blocks_per_req[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slots = torch.tensor(ids, dtype=torch.long)[pos // block_size] * block_size
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen)
        flat_kv[:, slots + pos % block_size] = kv.to(dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    num_tokens = sum(query_lens)
    return dict(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype),
        kv_cache=kv_cache,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def engine_ref(b: dict) -> torch.Tensor:
    """paged_attention_ref in fp32, on the cache with NaN zeroed.

    Its padded gather reads every slot of a request's blocks (and the padding block), and SDPA
    turns a NaN key under the mask into a NaN row, so it needs finite unused slots.
    """
    kv_cache = torch.nan_to_num(b["kv_cache"].float(), nan=0.0)
    return reference.paged_attention_ref(
        b["q"].float(), kv_cache, b["query_start_loc"], b["seq_lens"], b["block_tables"],
        b["max_query_len"], b["max_seq_len"], b["scale"],
    )  # fmt: skip


def run_unified(b: dict) -> torch.Tensor:
    out = torch.full_like(b["q"], float("nan"))  # poisoned: every element must be written
    ua.unified_attention(
        b["q"],
        b["kv_cache"],
        out,
        b["query_start_loc"],
        b["seq_lens"],
        b["block_tables"],
        b["max_query_len"],
        b["max_seq_len"],
        b["scale"],
    )
    return out


def run_decode(
    b: dict,
    num_splits: int | None,
    merge: AttnMerge = AttnMerge.CHUNKED,
) -> torch.Tensor:
    out = torch.full_like(b["q"], float("nan"))
    da.paged_decode_attention(
        b["q"],
        b["kv_cache"],
        out,
        b["seq_lens"],
        b["block_tables"],
        b["max_seq_len"],
        b["scale"],
        num_splits=num_splits,
        merge=merge,
    )
    # the in-launch merge leaves its counters zeroed for the next launch (and graph replay)
    assert not da._counters or not da._counters[b["q"].device].any()
    return out


def unified_ref(b: dict) -> torch.Tensor:
    return reference.unified_attention_ref(
        b["q"], b["kv_cache"], b["query_start_loc"], b["seq_lens"], b["block_tables"], b["scale"]
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "unwritten rows or NaN leaked from unused cache slots"
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_CONFIGS)
def test_unified_attention_mixed_batch(dtype, num_heads, num_kv_heads, head_dim):
    b = make_batch(MIXED_BATCH, num_heads, num_kv_heads, head_dim, dtype)
    out = run_unified(b)
    ref = unified_ref(b)
    assert_matches(out, ref, dtype)
    assert_matches(out, engine_ref(b), dtype)
    # the two references agree with each other to fp32 rounding
    torch.testing.assert_close(ref, engine_ref(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
def test_unified_attention_small_tiles(monkeypatch, num_heads, num_kv_heads):
    """16-row query tiles and 16-key tiles inside 32-token blocks: prefills span many tiles,
    tile edges fall mid-block, and a request with no query rows sits mid-batch."""
    monkeypatch.setattr(ua, "_PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(ua, "_BLOCK_N", 16)
    requests = [(37, 37), (5, 0), (49, 9), (70, 1), (33, 20)]
    b = make_batch(requests, num_heads, num_kv_heads, 32, torch.float32, block_size=32, seed=1)
    out = run_unified(b)
    assert_matches(out, unified_ref(b), torch.float32)
    assert_matches(out, engine_ref(b), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_attention_decode_only_matches_decode_kernel(dtype):
    # max_query_len 1 picks 16-row tiles: one token's query heads of a kv head per tile
    b = make_batch([(17, 1), (1, 1), (70, 1), (33, 1)], 6, 2, 32, dtype, seed=2)
    out = run_unified(b)
    assert_matches(out, engine_ref(b), dtype)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(run_decode(b, num_splits=2), out, rtol=rtol, atol=atol)


# decodes first (as the scheduler orders a step: running requests, then new prompts), then a
# prompt, a chunk after a cached prefix and a decode after them (not leading: stays unified)
DECODES_FIRST = [(17, 1), (1, 1), (70, 1), (37, 37), (49, 9), (33, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_attention_on_a_batch_tail(dtype):
    """q[r:] with query_start_loc[k:] (r = query_start_loc[k]): the tail's requests, rows as
    the whole batch's launch writes them."""
    b = make_batch(DECODES_FIRST, 6, 2, 32, dtype, seed=4)
    whole = run_unified(b)
    k = 3
    r = int(b["query_start_loc"][k])
    tail = dict(b, q=b["q"][r:], query_start_loc=b["query_start_loc"][k:])
    tail.update(seq_lens=b["seq_lens"][k:], block_tables=b["block_tables"][k:])
    out = run_unified(tail)
    torch.testing.assert_close(out, whole[r:], rtol=0, atol=0)
    assert_matches(out, engine_ref(b)[r:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_attend_leading_decodes_apart(dtype):
    """TritonOps.attention with meta.num_decodes: the leading decodes through the decode
    kernel, the rest in one unified launch, against the single launch and the reference."""
    from lantau.model.forward_context import AttentionMetadata
    from lantau.model.ops import TritonOps
    from lantau.runner.step_inputs import StepInputs

    b = make_batch(DECODES_FIRST, 6, 2, 32, dtype, seed=4)
    qsl = b["query_start_loc"]
    host = dict.fromkeys(["input_ids", "positions", "slot_mapping", "block_tables"])
    step = StepInputs(**host, query_start_loc=qsl.numpy(), seq_lens=b["seq_lens"].numpy(),
                      sample_ids=[], logits_indices=None)  # fmt: skip
    num_decodes = step.num_leading_decodes
    assert num_decodes == 3
    for lens, leading in (([5, 1], 0), ([1, 1], 2)):
        step.query_start_loc = np.cumsum([0, *lens], dtype=np.int32)
        step.seq_lens = np.full(len(lens), 9, dtype=np.int32)
        assert step.num_leading_decodes == leading

    def attend(n: int) -> torch.Tensor:
        meta = AttentionMetadata(
            None, qsl, b["seq_lens"], b["block_tables"], b["max_query_len"], b["max_seq_len"], n
        )
        return TritonOps().attention(b["q"], b["kv_cache"], meta, b["scale"])

    apart, together = attend(num_decodes), attend(0)
    assert_matches(apart, engine_ref(b), dtype)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(apart, together, rtol=rtol, atol=atol)
    # the unified launch's rows are the same launch's as before, bit for bit
    r = int(qsl[num_decodes])
    torch.testing.assert_close(apart[r:], together[r:], rtol=0, atol=0)


# decodes first, then fresh prompts (no keys before the step: 37, 70, 1, 5 tokens) beside a
# chunk after a cached prefix (9 after 40)
WITH_FRESH = [(17, 1), (70, 1), (37, 37), (49, 9), (70, 70), (1, 1), (5, 5)]
# ((num_heads, num_kv_heads, head_dim), tile): plain multi-head, GQA 4 with 1, 2 or 4 heads a
# tile; the default tile, and small ones that cross their edges
FRESH_CASES = [
    ((4, 4, 32), None), ((4, 4, 32), (32, 16, 4, 1, 1)), ((4, 4, 32), (16, 32, 4, 1, 1)),
    ((8, 2, 64), None), ((8, 2, 64), (32, 16, 4, 1, 1)), ((8, 2, 64), (32, 16, 4, 1, 2)),
    ((8, 2, 64), (32, 16, 4, 1, 4)),
]  # fmt: skip


def step_kv(b: dict, requests: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own k and v rows [num_tokens, num_kv_heads, head_dim], read from the cache
    make_batch filled (each request's last num_q positions)."""
    kv, block_size = b["kv_cache"], b["kv_cache"].shape[2]
    ks, vs = [], []
    for i, (seq_len, num_q) in enumerate(requests):
        pos = torch.arange(seq_len - num_q, seq_len)
        blocks = b["block_tables"][i].long()[pos // block_size]
        ks.append(kv[0][blocks, pos % block_size])
        vs.append(kv[1][blocks, pos % block_size])
    return torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "tile"), FRESH_CASES)
def test_fresh_attention_and_unified_skip_split_a_batch(dtype, heads, tile):
    """fresh_attention writes exactly the fresh prompts' rows (seq_len == query rows), over the
    step's own k and v, and unified_attention(skip_fresh=True) exactly the others: together
    the reference's output. Tiles small enough to cross their edges, HEADS of a GQA group
    packed in a tile (1, 2, 4 of 4); the whole batch and a tail of it (after the decodes)."""
    from lantau.kernels.fresh_attention import fresh_attention

    b = make_batch(WITH_FRESH, *heads, dtype, seed=7)
    k, v = step_kv(b, WITH_FRESH)
    ref, qsl = engine_ref(b), b["query_start_loc"]
    fresh_rows = torch.zeros(b["q"].shape[0], dtype=torch.bool)
    for i, (seq_len, num_q) in enumerate(WITH_FRESH):
        fresh_rows[qsl[i] : qsl[i + 1]] = seq_len == num_q
    for first in (0, 2):  # the batch, and its tail after the two decodes
        r = int(qsl[first])
        q, seq_lens, tail_qsl = b["q"][r:], b["seq_lens"][first:], qsl[first:]
        out = torch.full_like(q, float("nan"))
        fresh_attention(q, k[r:], v[r:], out, tail_qsl, seq_lens, b["scale"], tile=tile)
        mine = fresh_rows[r:]
        assert out[~mine].isnan().all(), "fresh_attention wrote a row with keys before the step"
        assert_matches(out[mine], ref[r:][mine], dtype)
        out = torch.full_like(q, float("nan"))
        ua.unified_attention(
            q, b["kv_cache"], out, tail_qsl, seq_lens, b["block_tables"][first:],
            b["max_query_len"], b["max_seq_len"], b["scale"], skip_fresh=True,
        )  # fmt: skip
        assert out[mine].isnan().all(), "unified_attention wrote a fresh prompt's row"
        assert_matches(out[~mine], ref[r:][~mine], dtype)


def test_fresh_attention_rejects_bad_inputs():
    from lantau.kernels.fresh_attention import fresh_attention

    b = make_batch(WITH_FRESH, 8, 2, 32, torch.float32)
    k, v = step_kv(b, WITH_FRESH)
    out = torch.empty_like(b["q"])
    args = (b["query_start_loc"], b["seq_lens"], b["scale"])
    with pytest.raises(AssertionError, match="against q"):
        fresh_attention(b["q"], k[1:], v[1:], out, *args)
    with pytest.raises(AssertionError, match="dtypes differ"):
        fresh_attention(b["q"], k.half(), v.half(), out, *args)
    with pytest.raises(AssertionError, match="heads a tile"):
        fresh_attention(b["q"], k, v, out, *args, tile=(32, 16, 4, 1, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEAD_CONFIGS)
def test_paged_decode_attention_splits_agree(dtype, num_heads, num_kv_heads, head_dim):
    # 300 over 4 splits: 75 rounds up to 128-key splits (two 64-key tiles), the last one holds
    # 44 keys and split 3 is empty; seq_len 1 leaves splits 1..3 empty
    requests = [(1, 1), (17, 1), (70, 1), (300, 1), (129, 1)]
    b = make_batch(requests, num_heads, num_kv_heads, head_dim, dtype, seed=3)
    ref = reference.paged_decode_attention_ref(
        b["q"], b["kv_cache"], b["seq_lens"], b["block_tables"], b["scale"]
    )
    assert_matches(ref, engine_ref(b), torch.float32)
    outs = {n: run_decode(b, n) for n in (None, 1, 2, 3, 4)}
    for out in outs.values():
        assert_matches(out, ref, dtype)
    if dtype == torch.float32:  # splitting changes only the order of fp32 sums
        for out in outs.values():
            torch.testing.assert_close(out, outs[1], rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_short_splits(monkeypatch):
    """16-key tiles: splits of 16 or 32 keys that end mid-block and mid-context."""
    monkeypatch.setattr(da, "_DECODE_BLOCK_N", 16)
    b = make_batch([(70, 1), (45, 1), (16, 1), (3, 1)], 6, 2, 32, torch.float32, seed=4)
    ref = reference.paged_decode_attention_ref(
        b["q"], b["kv_cache"], b["seq_lens"], b["block_tables"], b["scale"]
    )
    for num_splits in (1, 2, 3, 4, 8):
        out = run_decode(b, num_splits)
        assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 1), (4, 4)])
def test_in_launch_merge_folds_chunks_of_splits(monkeypatch, num_heads, num_kv_heads):
    """16-key tiles over 8 splits: the merge loading all partials at once (chunked, the
    default) or unrolled (a load per split) agree with the reference and each other (fp32 sums
    in other orders); a request filling 3 of 8 splits leaves chunks part-masked."""
    monkeypatch.setattr(da, "_DECODE_BLOCK_N", 16)
    b = make_batch([(128, 1), (45, 1), (3, 1)], num_heads, num_kv_heads, 32, torch.float32, seed=6)
    ref = reference.paged_decode_attention_ref(
        b["q"], b["kv_cache"], b["seq_lens"], b["block_tables"], b["scale"]
    )
    group = num_heads // num_kv_heads
    assert da.default_merge_chunk(8, group, 32) == 8  # all 8 at once
    outs = {m: run_decode(b, 8, merge=m) for m in AttnMerge}
    for out in outs.values():
        assert_matches(out, ref, torch.float32)
        torch.testing.assert_close(out, outs[AttnMerge.CHUNKED], rtol=1e-5, atol=1e-6)


def test_default_merge_chunk_caps_the_partials_held():
    assert da.default_merge_chunk(16, 4, 128) == 16  # llama3-8b: 16 x 4 x 128 = 8,192 values
    assert da.default_merge_chunk(64, 4, 128) == 16
    assert da.default_merge_chunk(64, 8, 128) == 8  # 70B's 8 query heads a kv head
    assert da.default_merge_chunk(3, 3, 64) == 4
    assert da.default_merge_chunk(2, 64, 256) == 1


def test_empty_context_writes_zeros():
    """seq_len 0 (a padding request in a captured graph) gives zeros, not 0 / 0."""
    b = make_batch([(20, 1), (1, 1)], 4, 2, 32, torch.float32, seed=5)
    b["seq_lens"][1] = 0
    ref = reference.paged_decode_attention_ref(
        b["q"], b["kv_cache"], b["seq_lens"], b["block_tables"], b["scale"]
    )
    assert ref[1].eq(0).all()
    for num_splits in (1, 4):
        for merge in AttnMerge:
            out = run_decode(b, num_splits, merge)
            assert out[1].eq(0).all()
            assert_matches(out, ref, torch.float32)


def test_default_num_splits():
    cpu = torch.device("cpu")  # counts as a 132-SM H200: about 528 programs wanted
    assert da.default_num_splits(1, 8, 32768, cpu) == 64  # 8 programs a split
    assert da.default_num_splits(4, 8, 16384, cpu) == 16
    assert da.default_num_splits(8, 8, 8192, cpu) == 8
    assert da.default_num_splits(1, 8, 1000, cpu) == 2  # but no split under 256 keys
    assert da.default_num_splits(64, 8, 32768, cpu) == 1  # the batch alone fills the GPU
    assert da.default_num_splits(1, 1, 1 << 20, cpu) == da._MAX_SPLITS
    assert da.default_num_splits(3, 2, 100, cpu) == 1


def test_launchers_reject_bad_inputs():
    b = make_batch([(17, 1), (37, 3)], 6, 2, 32, torch.float16)

    def unified(**changes) -> None:
        args = {**b, **changes}
        out = changes.get("out", torch.empty_like(args["q"]))
        ua.unified_attention(
            args["q"],
            args["kv_cache"],
            out,
            args["query_start_loc"],
            args["seq_lens"],
            args["block_tables"],
            args["max_query_len"],
            args["max_seq_len"],
            args["scale"],
        )

    bad_inputs = [
        dict(q=b["q"].float()),  # dtype differs from the cache
        dict(out=torch.empty_like(b["q"], dtype=torch.float32)),
        dict(seq_lens=b["seq_lens"].long()),
        dict(query_start_loc=b["query_start_loc"].long()),
        dict(block_tables=b["block_tables"].long()),
        dict(query_start_loc=b["query_start_loc"][:-1]),
        dict(q=b["q"][:, :5]),  # 5 query heads over 2 kv heads
        dict(q=b["q"][:, :, :24]),  # head_dim differs from the cache (and is not a power of 2)
        dict(q=b["q"].repeat_interleave(2, dim=2)[:, :, ::2]),  # head_dim not contiguous
        dict(kv_cache=b["kv_cache"][0]),
        dict(max_seq_len=10_000),  # more than the block table holds
    ]
    for changes in bad_inputs:
        with pytest.raises(AssertionError):
            unified(**changes)
    with pytest.raises(AssertionError):  # decode wants exactly one query row per request
        da.paged_decode_attention(
            b["q"], b["kv_cache"], torch.empty_like(b["q"]), b["seq_lens"],
            b["block_tables"], b["max_seq_len"], b["scale"],
        )  # fmt: skip
    with pytest.raises(AssertionError):
        q = b["q"][:2]
        da.paged_decode_attention(
            q, b["kv_cache"], torch.empty_like(q), b["seq_lens"], b["block_tables"],
            b["max_seq_len"], b["scale"], num_splits=0,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [64, 16])
def test_decode_attention_with_rope_matches_rotary_then_attention(monkeypatch, dtype, block_n):
    """`rope`: q, key and value straight from the projection, rotated and the key and value
    stored inside the attention launch, as apply_rotary_and_write_kv then attention do: the
    same outputs and the same cache, bit for bit. With 16-key tiles the step's own key often
    lies past a split's first tile (stored, then read back by the same program); a padding row
    (slot -1) stores nothing."""
    from lantau.kernels.rotary import apply_rotary_and_write_kv
    from lantau.model.llama import rope_inv_freq
    from lantau.model.ops import build_cos_sin_cache

    monkeypatch.setattr(da, "_DECODE_BLOCK_N", block_n)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    b = make_batch([(70, 1), (45, 1), (1, 1), (129, 1)], num_heads, num_kv_heads, head_dim, dtype)
    seq_lens = b["seq_lens"].long()
    positions = seq_lens - 1
    block = b["block_tables"].long().gather(1, (positions // 16)[:, None])[:, 0]
    slot_mapping = block * 16 + positions % 16
    slot_mapping[2] = -1  # a padding row
    cache = b["kv_cache"].clone()
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    flat[:, slot_mapping[slot_mapping >= 0]] = float("nan")  # the step's slots: not yet written
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = torch.split(qkv, [num_heads * head_dim] + [num_kv_heads * head_dim] * 2, dim=1)
    q = q.view(4, num_heads, head_dim)
    k, v = (t.view(4, num_kv_heads, head_dim) for t in (k, v))
    cos_sin = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0, None), 256)
    qkv_before = qkv.clone()

    def attend(query, kv_cache, num_splits, rope=None):
        out = torch.full_like(query, float("nan")).contiguous()
        da.paged_decode_attention(
            query, kv_cache, out, b["seq_lens"], b["block_tables"], b["max_seq_len"],
            b["scale"], num_splits=num_splits, rope=rope,
        )  # fmt: skip
        return out

    for num_splits in (1, 2, 4):
        ref_cache, ref_q = cache.clone(), q.clone()
        apply_rotary_and_write_kv(ref_q, k, v, positions, cos_sin, ref_cache, slot_mapping)
        ref = attend(ref_q, ref_cache, num_splits)
        fused_cache = cache.clone()
        rope = da.DecodeRope(k, v, positions, cos_sin, slot_mapping)
        out = attend(q, fused_cache, num_splits, rope)
        real = [0, 1, 3]
        torch.testing.assert_close(out[real], ref[real], rtol=0, atol=0)
        torch.testing.assert_close(fused_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(qkv, qkv_before), "the projection's output was modified"
        assert_matches(ref[real], engine_ref({**b, "q": ref_q, "kv_cache": ref_cache})[real], dtype)


def test_decode_rope_rejects_bad_inputs():
    b = make_batch([(20, 1)], 4, 2, 32, torch.float32)
    kv = torch.zeros(1, 2, 32)
    pos = torch.zeros(1, dtype=torch.int64)
    cos_sin = torch.zeros(64, 32)
    out = torch.empty_like(b["q"])
    args = (b["q"], b["kv_cache"], out, b["seq_lens"], b["block_tables"], 20, 1.0)
    bad = da.DecodeRope(kv, kv, pos.int(), cos_sin, pos)
    with pytest.raises(AssertionError, match="positions"):
        da.paged_decode_attention(*args, rope=bad)


@contextlib.contextmanager
def launch_keys(*kernels):
    """Each launch of these (interpreted) kernels as the compiled JIT keys its cache on an sm90
    GPU: every argument's specialization (an int's 1 or multiple of 16, a pointer's 16-byte
    alignment) and the constexprs. A key the cache has not seen is a compile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys: dict = {kernel: [] for kernel in kernels}
    hooks = []
    for kernel in kernels:
        jit = JITFunction(kernel.fn, **kernel.kwargs)
        binder = create_function_from_signature(jit.signature, jit.params, backend)

        def hook(*args, _bind=binder, _keys=keys[kernel], **kwargs):
            _keys.append(str(_bind(*args, **kwargs)[1]))

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield keys
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def test_attention_kernels_compile_once_for_every_step_shape():
    """What changes from step to step (how many decodes lead the batch, so where its tail's
    arrays start; the block tables' width, the step's longest context) picks no new variant of
    either attention kernel: a serving step never waits on a compile (the CUDA graphs compile
    the variants at start-up, with whole arrays and tables as wide as max_model_len allows)."""
    from lantau.config import KernelConfig
    from lantau.model.forward_context import AttentionMetadata
    from lantau.model.ops import TritonOps

    b = make_batch(DECODES_FIRST * 2, 6, 2, 32, torch.float32, seed=5)
    qsl = b["query_start_loc"]
    ops = TritonOps(KernelConfig(attn_num_splits=2))  # the split count is chosen, not the shape
    with launch_keys(ua._unified_attention_kernel, da._paged_decode_split_kernel) as keys:
        for width in (16, 17, 21):  # pads the tables: strides of 16, 17 and 21 ints
            pad = torch.zeros(len(b["seq_lens"]), width - b["block_tables"].shape[1])
            tables = torch.cat([b["block_tables"], pad.to(torch.int32)], dim=1)
            for n in (0, 1, 2, 3):  # 1-3: the tail's int32 arrays 4-12 bytes past 16
                meta = AttentionMetadata(
                    None, qsl, b["seq_lens"], tables, b["max_query_len"], b["max_seq_len"], n
                )
                out = ops.attention(b["q"], b["kv_cache"], meta, b["scale"])
                assert_matches(out, engine_ref(b), torch.float32)
    unified, decode = keys.values()
    assert len(unified) == 12 and len(decode) == 9
    assert len(set(unified)) == 1, "the unified kernel compiles a variant for a step's shape"
    assert len(set(decode)) == 1, "the decode kernel compiles a variant for a step's shape"
