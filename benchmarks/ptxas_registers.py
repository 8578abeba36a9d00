"""Registers and spills a thread of W2's batch-1 decode kernels on an H200 (sm_90), on the CPU.

Each kernel is compiled for sm_90 by Triton and assembled by its ptxas (-v), so no GPU is
needed: registers set how many programs an SM holds (65,536 registers an SM), and spills are
local-memory round trips. Rows: decode attention with early KV loads at llama3-8b's heads
(64 keys over 4 warps with chunked merges, the old tiling; 64 x 8 with the unrolled merge, the
default; with rotary inside; capped at 168 and 128 registers), then the preloading GEMV (4 rows
over 4 warps) plain, gated and with the residual add, uncapped and at 168.

    PYTHONPATH=. python3 benchmarks/ptxas_registers.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from lantau.kernels import gemv, paged_attention

TARGET = GPUTarget("cuda", 90, 32)


def ptxas_info(fn, signature: dict, constants: dict, **options) -> tuple[int, int]:
    """(registers, spill store bytes) a thread of fn compiled with these constants."""
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    options = {k: v for k, v in options.items() if v is not None}
    ptx = triton.compile(ASTSource(fn, signature, constants), target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx.asm["ptx"])
        cmd = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


def attention(block_n: int, warps: int, chunk: int, rope: bool, maxnreg=None) -> tuple[int, int]:
    sig = dict.fromkeys(("q_ptr", "kv_ptr", "out_ptr"), "*bf16")
    sig |= dict.fromkeys(("part_out_ptr", "part_lse_ptr"), "*fp32")
    sig |= dict.fromkeys(("counters_ptr", "seq_lens_ptr", "block_tables_ptr"), "*i32")
    ints = (
        "num_heads num_kv_heads num_splits stride_q_req stride_q_head stride_out_req "
        "stride_out_head stride_kv_kv stride_kv_block stride_kv_slot stride_kv_head stride_bt_req"
    )
    sig |= dict.fromkeys(ints.split(), "i32") | {"scale_log2": "fp32"}
    const = dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_N=block_n, USE_SCRATCH=True,
        MERGE=True, GROUP_P=4, MERGE_CHUNK=chunk, MERGE_SPLITS=16 if chunk == 0 else 1,
        HEADS_FIRST=True, DOT_PRECISION="tf32", USE_PDL=True, EARLY_KV=True, ROPE=rope,
    )  # fmt: skip
    rope_ptrs, rope_ints = (
        ("k_ptr", "v_ptr", "pos_ptr", "cos_sin_ptr", "slot_ptr"),
        ("stride_k_req", "stride_k_head", "stride_v_req", "stride_v_head"),
    )
    if rope:
        sig |= {"k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32"}
        sig |= {"slot_ptr": "*i64"} | dict.fromkeys(rope_ints, "i32")
    else:
        const |= dict.fromkeys(rope_ptrs) | dict.fromkeys(rope_ints, 0)
    kernel = paged_attention._paged_decode_split_kernel
    return ptxas_info(kernel, sig, const, num_warps=warps, num_stages=2, maxnreg=maxnreg)


def preload_gemv(maxnreg=None, **fusions) -> tuple[int, int]:
    ptrs = "x_ptr w_ptr b_ptr y_ptr nw_ptr pos_ptr cos_sin_ptr key_cache_ptr value_cache_ptr"
    sig = dict.fromkeys([*ptrs.split(), "slot_ptr"], "*bf16")
    ints = "num_q_heads num_kv_heads N K stride_xm stride_wn stride_ym"
    sig |= dict.fromkeys(ints.split(), "i32") | {"eps": "fp32"}
    const = dict(
        M=1, HAS_BIAS=False, NORM=False, SILU=False, RESIDUAL=False, GATED=False, ROPE=False,
        HEAD_DIM=0, BLOCK_N=4, BLOCK_K=4096, M_PAD=16, DOT_PRECISION="tf32", USE_PDL=True,
        PRELOAD=True,
    )  # fmt: skip
    const |= fusions
    return ptxas_info(gemv._gemv_kernel, sig, const, num_warps=4, num_stages=1, maxnreg=maxnreg)


def main() -> None:
    rows = [
        (
            "attention 64 x 4, merge chunks of 16 (the old tiling; 1.8 KB spilled before 8b6d5c7)",
            attention(64, 4, 16, False),
        ),
        ("attention 64 x 8, unrolled merge", attention(64, 8, 0, False)),
        ("attention 64 x 8, unrolled merge, rope inside (default)", attention(64, 8, 0, True)),
        ("attention default at maxnreg 168", attention(64, 8, 0, True, 168)),
        ("attention default at maxnreg 128", attention(64, 8, 0, True, 128)),
        ("GEMV preload 4 x 4", preload_gemv()),
        ("GEMV preload 4 x 4 at maxnreg 168", preload_gemv(168)),
        ("GEMV preload 4 x 4, gated", preload_gemv(GATED=True)),
        ("GEMV preload 4 x 4, gated, at maxnreg 168", preload_gemv(168, GATED=True)),
        ("GEMV preload 4 x 4, residual, at maxnreg 168", preload_gemv(168, RESIDUAL=True)),
    ]
    print("| kernel (sm_90) | registers a thread | spill stores, bytes a thread |")
    print("| --- | --- | --- |")
    for label, (registers, spills) in rows:
        print(f"| {label} | {registers} | {spills} |")


if __name__ == "__main__":
    main()
