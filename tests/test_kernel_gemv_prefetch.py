"""The batch-1 GEMV's L2 prefetch (gemv's `l2_prefetch_bytes`): which rows each program asks
for (its helper run through the Triton interpreter, against the row layouts the GEMV reads),
the plan's arithmetic, and, compiled for sm_90 in a subprocess, that the prefetch is issued
before the PDL wait and not at all when off. Whether it is faster is the H200's to say
(benchmarks/gpu_gemv.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lantau.kernels import gemv  # noqa: E402


@triton.jit
def _rows_probe(rows_ptr, bytes_ptr, N, first, stride, waves, row_bytes, LANES: tl.constexpr,
                BLOCK_N: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
                HEAD_DIM: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows, nbytes = gemv._prefetch_rows(
        pid, N, first, stride, waves, row_bytes, LANES, BLOCK_N, GATED, ROPE, HEAD_DIM
    )
    lane = tl.arange(0, LANES)
    tl.store(rows_ptr + pid * LANES + lane, rows)
    tl.store(bytes_ptr + pid * LANES + lane, nbytes)


def program_rows(q: int, n: int, block_n: int, layout: str, head_dim: int) -> list[int]:
    """The rows of W that GEMV program q reads, as gemv's docstring lays them out."""
    half = block_n // 2
    if layout == "plain":
        return [r for r in range(q * block_n, (q + 1) * block_n) if r < n]
    if layout == "gated":  # gate rows q*half.., then their up rows n/2 further
        gate = [r for r in range(q * half, (q + 1) * half) if r < n // 2]
        return gate + [r + n // 2 for r in gate]
    # rope: a head's dims d, then d + head_dim / 2
    head, d0 = divmod(q * half, head_dim // 2)
    dims = [head * head_dim + d0 + i for i in range(half)]
    return [r for r in dims + [r + head_dim // 2 for r in dims] if r < n]


@pytest.mark.parametrize(
    ("layout", "n", "block_n", "first", "stride", "waves"),
    [
        ("plain", 70, 4, 1, 5, 2),  # ragged N: the last program's rows past N ask for nothing
        ("plain", 64, 8, 0, 0, 1),  # own rows (no preload)
        ("gated", 40, 4, 1, 3, 3),
        ("rope", 3 * 16, 4, 1, 4, 2),  # q, k, v heads of 16 dims
    ],
)
def test_prefetch_rows_are_the_rows_later_programs_read(layout, n, block_n, first, stride, waves):
    lanes, head_dim, row_bytes = 32, 16, 96
    grid = triton.cdiv(n // 2, block_n // 2) if layout == "gated" else triton.cdiv(n, block_n)
    rows = torch.full((grid, lanes), -1, dtype=torch.int64)
    nbytes = torch.full((grid, lanes), -1, dtype=torch.int32)
    _rows_probe[(grid,)](
        rows, nbytes, n, first, stride, waves, row_bytes, LANES=lanes, BLOCK_N=block_n,
        GATED=layout == "gated", ROPE=layout == "rope", HEAD_DIM=head_dim,
    )  # fmt: skip
    for pid in range(grid):
        asked = [int(r) for r, b in zip(rows[pid], nbytes[pid], strict=True) if b > 0]
        assert all(b in (0, row_bytes) for b in nbytes[pid].tolist())
        expected = []
        for w in range(waves):
            q = pid + (w + first) * stride
            if q < grid:
                expected += program_rows(q, n, block_n, layout, head_dim)
        assert sorted(asked) == sorted(expected), pid


def test_prefetch_plan_after_preload_takes_the_next_waves_within_budget():
    # o_proj of an 8B model: 1024 programs of 4 rows of 8 KB, 264 resident (2 an SM)
    plan = gemv.prefetch_plan(1024, 264, 4, 4096, 8192, 24 << 20, preload=True, lanes=128)
    assert plan == gemv.L2Prefetch(programs=264, first=1, stride=264, waves=2, row_bytes=8192)
    assert plan.programs * plan.waves * 4 * 8192 <= 24 << 20
    # a budget past the matrix: every later wave, no more
    plan = gemv.prefetch_plan(1024, 264, 4, 4096, 8192, 1 << 30, preload=True, lanes=128)
    assert plan.waves == 3  # waves 2 to 4 of ceil(1024 / 264) = 4
    # one wave holds the whole grid, or the budget is under a wave: nothing to prefetch
    assert gemv.prefetch_plan(200, 264, 4, 800, 8192, 1 << 30, preload=True, lanes=128) is None
    assert gemv.prefetch_plan(1024, 264, 4, 4096, 8192, 1 << 20, preload=True, lanes=128) is None


def test_prefetch_plan_without_preload_takes_the_start_of_each_row():
    # down_proj: 128 programs of 32 rows of 28 KB, all resident; 24 MB over 4096 rows
    plan = gemv.prefetch_plan(128, 132, 32, 4096, 28672, 24 << 20, preload=False, lanes=256)
    assert plan == gemv.L2Prefetch(programs=128, first=0, stride=0, waves=1, row_bytes=6144)
    assert plan.row_bytes % 16 == 0
    plan = gemv.prefetch_plan(128, 132, 32, 4096, 28672, 1 << 30, preload=False, lanes=256)
    assert plan.row_bytes == 28672  # never past the row


def test_programs_per_sm_from_registers_threads_and_shared_memory():
    # ptxas on the preload tile (4 rows x 4096, 4 warps): 185 registers -> 2 an SM
    assert gemv.programs_per_sm(185, 4, 64) == 2
    assert gemv.programs_per_sm(94, 8, 128) == 2  # 8 warps at 94 registers
    assert gemv.programs_per_sm(32, 4, 0) == 16  # threads bound: 2048 / 128
    assert gemv.programs_per_sm(32, 1, 100_000) == 2  # shared memory bound
    assert gemv.programs_per_sm(255, 8, 1024) == 1


_PTX_PROBE = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lantau.kernels import gemv

    consts = dict(M=1, HAS_BIAS=False, NORM=False, SILU=False, RESIDUAL=False, GATED=False,
                  ROPE=False, HEAD_DIM=0, BLOCK_N=4, BLOCK_K=4096, M_PAD=16,
                  DOT_PRECISION="tf32", USE_PDL=True, PRELOAD=True,
                  PF_LANES=int(sys.argv[1]))
    pointers = {"x_ptr", "w_ptr", "b_ptr", "y_ptr", "nw_ptr", "cos_sin_ptr", "key_cache_ptr",
                "value_cache_ptr"}
    signature = {}
    for name in gemv._gemv_kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*fp32" if name == "cos_sin_ptr" else "*bf16"
        elif name in ("pos_ptr", "slot_ptr"):
            signature[name] = "*i64"
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    kernel = triton.compile(
        ASTSource(fn=gemv._gemv_kernel, signature=signature, constexprs=consts),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1),
    )
    ptx = kernel.asm["ptx"]
    print(json.dumps({key: ptx.find(key) for key in
                      ("cp.async.bulk.prefetch.L2", "griddepcontrol.wait", "ld.global")}))
    """
)


def _ptx_positions(lanes: int) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _PTX_PROBE, str(lanes)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prefetch_is_issued_before_the_pdl_wait_in_sm90_code():
    on = _ptx_positions(128)
    assert 0 <= on["cp.async.bulk.prefetch.L2"] < on["griddepcontrol.wait"]
    assert on["cp.async.bulk.prefetch.L2"] < on["ld.global"]  # before the preload too
    off = _ptx_positions(0)
    assert off["cp.async.bulk.prefetch.L2"] == -1 and off["griddepcontrol.wait"] > 0
