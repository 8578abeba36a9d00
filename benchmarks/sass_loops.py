"""The attention and batch-1 GEMV kernels in Hopper SASS, without a GPU: each kernel is compiled
for sm90 with Triton's own ptxas (as the launcher would specialise it: pointers, strides and
the GEMV's N and K divisible by 16), disassembled with its nvdisasm, and every loop (a backward
branch) counted by opcode. Instructions a thread per KV tile is what an issue-bound kernel's
time follows (an fp8 decode tile of 128 keys is the bytes of a bf16 tile of 64).

    python benchmarks/sass_loops.py [--kernels decode-fp8,decode-bf16,unified-fp8,unified-bf16,
        gemv-fp8,gemv-bf16] [--decode-tiles 128,4,2;128,2,2] [--top 12]

Prints one line a loop: instructions, byte loads from shared memory (LDS.U8), and the most
frequent opcodes. The first loop of the decode kernel is the unmasked one (whole tiles). The
GEMV at llama3-8b's qkv (6,144 x 4,096, the preload: no loop, the whole kernel counted) and
down_proj (4,096 x 14,336, the K loop), with instructions a thread per byte of weights.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: this script needs no GPU

import torch  # noqa: E402
import triton  # noqa: E402
import triton.backends.nvidia  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
# llama3-8b's attention: 32 query heads over 8 kv heads, head_dim 128, 16-token cache blocks
DECODE = dict(
    GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, USE_SCRATCH=True, GROUP_P=4,
    MERGE_CHUNK=8, MERGE_SPLITS=1, DOT_PRECISION="tf32", USE_PDL=True, ROPE=False,
    USE_ASM=True,
)  # fmt: skip
UNIFIED = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, DOT_PRECISION="tf32")
POINTERS = {
    "q_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "counters_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32", "scale_log2": "fp32", "v_scale": "fp32",
    "k_inv_scale": "fp32", "v_inv_scale": "fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
    "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64",
}  # fmt: skip


def compile_sm90(
    fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, ints=(), **options
):
    """fn compiled for sm90 (Triton's CompiledKernel: .asm["ptx"], ["cubin"]): `types` of its
    pointer and float arguments (any other is i32), the pointers, strides and `ints` marked
    divisible by 16 as the launcher's specialisation marks them for real shapes (what lets
    loads vectorise and stage through shared memory); `options` more of the launch's compile
    options (e.g. maxnreg)."""
    types = {**POINTERS, **types}
    names = fn.arg_names
    constexprs = {n: v for n, v in constexprs.items() if n in names}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    values = {(i,): constexprs[n] for i, n in enumerate(names) if n in constexprs}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or n.startswith("stride") or n in ints
    }
    return triton.compile(
        ASTSource(fn, signature, values, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages, **options),
    )


def disassemble(kernel) -> str:
    """A compiled kernel's SASS (nvdisasm)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        done = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True)
    done.check_returncode()
    return done.stdout


PTXAS = os.path.join(os.path.dirname(NVDISASM), "ptxas")
PTXAS_USAGE = re.compile(r"(\d+) bytes spill stores.*?Used (\d+) registers", re.S)


def register_use(kernel) -> tuple[int, int]:
    """(registers a thread, bytes spilled a thread) of a compiled kernel, as sm90a's ptxas
    reports them for its PTX: what decides how many programs an SM holds."""
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        done = subprocess.run(
            [PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    done.check_returncode()
    spills, registers = PTXAS_USAGE.search(done.stderr).groups()
    return int(registers), int(spills)


def compile_sass(
    fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, ints=()
) -> str:
    """SASS of fn for sm90 (compile_sm90's arguments)."""
    return disassemble(compile_sm90(fn, types, constexprs, num_warps, num_stages, ints))


OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")  # after the address comment


def opcodes(sass: str) -> collections.Counter:
    """Opcode counts of SASS lines (a predicate @P0 / @!P0 skipped)."""
    return collections.Counter(op.group(1) for op in OPCODE.finditer(sass))


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (label to its backward branch), in code order."""
    lines = sass.splitlines()
    labels = {}
    found = []
    for i, line in enumerate(lines):
        label = re.match(r"^\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if branch and labels.get(branch.group(1), i) < i:
            ops = opcodes("\n".join(lines[labels[branch.group(1)] : i + 1]))
            if sum(ops.values()) > 40:  # not a spin or search loop
                found.append(ops)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kernels", default="decode-fp8,decode-bf16,unified-fp8,unified-bf16,gemv-fp8,gemv-bf16"
    )
    parser.add_argument(
        "--decode-tiles",
        default="",
        help="BLOCK_N,num_warps,num_stages ';'-separated (default: the launcher's per dtype)",
    )
    parser.add_argument("--top", type=int, default=12, help="opcodes shown a loop")
    args = parser.parse_args()
    from lantau.kernels import decode_attention as da
    from lantau.kernels import unified_attention as ua

    for name in args.kernels.split(","):
        kind, dtype = name.split("-")
        kv_type = "fp8e4nv" if dtype == "fp8" else "bf16"
        if kind == "decode":
            default = da.default_tile(torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
            tiles = [tuple(map(int, t.split(","))) for t in args.decode_tiles.split(";") if t]
            for block_n, warps, stages in tiles or [default]:
                consts = {**DECODE, "BLOCK_N": block_n, "V_PAIRS": dtype == "fp8"}
                types = {"kv_ptr": f"*{kv_type}"}
                sass = compile_sass(da._paged_decode_split_kernel, types, consts, warps, stages)
                report(f"decode {dtype} ({block_n}, {warps}, {stages})", sass, args.top)
        elif kind == "gemv":
            gemv_report(dtype, args.top)
        else:
            consts = {**UNIFIED, "BLOCK_M": ua._PREFILL_BLOCK_M, "BLOCK_N": ua._BLOCK_N}
            consts["BLOCK_Q"] = consts["BLOCK_M"] // consts["GROUP"]
            types = {"kv_ptr": f"*{kv_type}"}
            sass = compile_sass(ua._unified_attention_kernel, types, consts, 4, 2)
            report(f"unified {dtype} ({ua._PREFILL_BLOCK_M} rows, {ua._BLOCK_N} keys)", sass, 8)


def gemv_report(dtype: str, top: int) -> None:
    """The batch-1 GEMV's two paths at llama3-8b's shapes, as gemv() configures them."""
    from lantau.kernels import gemv

    fp8 = dtype == "fp8"
    itemsize = 1 if fp8 else 2
    types = {
        "x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "scale_ptr": "*fp32" if fp8 else "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
    }  # fmt: skip
    flags = dict(HAS_SCALE=fp8, HAS_BIAS=False, GATED=False, USE_PDL=True)
    n, k = 6144, 4096  # qkv: the preload, one load of the program's rows
    block_n, warps, stages = gemv.preload_config(n, k, itemsize)
    consts = {**flags, "BLOCK_N": block_n, "BLOCK_K": k, "PRELOAD": True}
    ops = opcodes(compile_sass(gemv._gemv_kernel, types, consts, warps, stages, ints=("N", "K")))
    per_byte = sum(ops.values()) / (block_n * k * itemsize / (32 * warps))
    common = ", ".join(f"{op} {c}" for op, c in ops.most_common(top))
    print(
        f"gemv {dtype} qkv {n} x {k} preload ({block_n} rows, {warps} warps): "
        f"{sum(ops.values())} instructions a thread, {per_byte:.2f} a weight byte; {common}",
        flush=True,
    )
    n, k = 4096, 14336  # down_proj: the K loop
    block_n, block_k, warps, stages = gemv.default_config(n, k)
    consts = {**flags, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRELOAD": False}
    sass = compile_sass(gemv._gemv_kernel, types, consts, warps, stages, ints=("N", "K"))
    for body in loops(sass):
        per_byte = sum(body.values()) / (block_n * block_k * itemsize / (32 * warps))
        common = ", ".join(f"{op} {c}" for op, c in body.most_common(top))
        print(
            f"gemv {dtype} down {n} x {k} K loop ({block_n} x {block_k}, {warps} warps): "
            f"{sum(body.values())} instructions a thread an iteration, {per_byte:.2f} a weight "
            f"byte; {common}",
            flush=True,
        )


def report(label: str, sass: str, top: int) -> None:
    for i, ops in enumerate(loops(sass)):
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(top))
        print(
            f"{label} loop {i}: {sum(ops.values())} instructions, "
            f"{ops['LDS.U8']} byte loads from shared memory; {common}",
            flush=True,
        )


if __name__ == "__main__":
    main()
