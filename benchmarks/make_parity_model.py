"""Real weights for the GPU parity check, small enough to travel to the lent GPU (64 MiB).

The default model's GGUF (SmolLM2-135M-Instruct, Q4_1, 98 MB) does not fit; its embedding and
first --layers decoder layers do (tensors copied as stored, block_count rewritten). Writes
.parity/smollm2-<N>l.gguf and a copy of the pure-Python `gguf` reader (the GPU image has
none) next to it; run the check there with

    PYTHONPATH=.:.parity PARITY_MODEL=.parity/smollm2-12l.gguf \
        python3 benchmarks/gpu_h200.py --skip ceilings,kernels,peers,workloads

(`.parity` in the device call's carry).

    python benchmarks/make_parity_model.py [--layers 12]
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import gguf

from lantau.model.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default=".parity")
    args = parser.parse_args()
    src = gguf.GGUFReader(default_model_path())
    out_dir = Path(args.out)
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"smollm2-{args.layers}l.gguf"
    arch = src.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value = args.layers if key == f"{arch}.block_count" else field.contents()
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in src.tensors:
        layer = re.match(r"blk\.(\d+)\.", t.name)
        if layer and int(layer.group(1)) >= args.layers:
            continue
        # data as stored: quantized rows as bytes, whose shape the writer converts back
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    package = Path(gguf.__file__).parent
    shutil.copytree(package, out_dir / "gguf", dirs_exist_ok=True)
    for info in package.parent.glob("gguf-*.dist-info"):  # transformers checks its version
        shutil.copytree(info, out_dir / info.name, dirs_exist_ok=True)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, {args.layers} layers")


if __name__ == "__main__":
    main()
