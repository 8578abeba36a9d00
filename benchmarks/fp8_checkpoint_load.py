"""Loading an FP8 checkpoint as published (compressed-tensors, e4m3 weights with a scale a row)
against loading the bf16 checkpoint of the same weights with `--dtype fp8` (quantized as it
loads) and in bf16 (the bytes' ceiling: twice as many), one after the other, interleaved.

    python benchmarks/fp8_checkpoint_load.py [--device cpu|cuda] [--layers 16]
        [--work /tmp/fp8ckpt] [--rounds 3] [--cold]

The model is Llama 3.2 1B's shape (random weights, `--layers` of them), written once by HF
transformers in bf16 and re-written as a compressed-tensors FP8 checkpoint the way
llm-compressor writes its `*-FP8-dynamic` ones. Each load is lantau's `build_model` from the
folder on `--device`; `--cold` evicts the folder's files from the page cache first
(posix_fadvise, no root). Prints seconds, GB read and GB/s a load, best and median of the
rounds, and checks that the FP8 checkpoint's model holds the bytes stored.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import torch

PROJECTION = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
E4M3 = torch.float8_e4m3fn


def write_checkpoints(work: Path, layers: int) -> tuple[Path, Path]:
    """The bf16 HF checkpoint and its FP8 twin, made once under `work`."""
    import transformers
    from safetensors.torch import load_file, save_file

    wide, fp8 = work / "bf16", work / "fp8"
    if not (wide / "config.json").exists():
        config = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192,
            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
            head_dim=64, max_position_embeddings=4096, rope_theta=500000.0,
            tie_word_embeddings=True, torch_dtype="bfloat16",
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(wide, max_shard_size="1GB")
        del model
    if not (fp8 / "config.json").exists():
        fp8.mkdir(parents=True, exist_ok=True)
        for path in sorted(wide.glob("*.safetensors")):
            out = {}
            for name, w in load_file(path).items():
                if PROJECTION.match(name):
                    scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
                    out[name] = (w.float() / scale).clamp(-448, 448).to(E4M3)
                    out[name.removesuffix("weight") + "weight_scale"] = scale.to(torch.bfloat16)
                else:
                    out[name] = w
            save_file(out, fp8 / path.name, metadata={"format": "pt"})
        config = json.loads((wide / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}}},
        }  # fmt: skip
        (fp8 / "config.json").write_text(json.dumps(config))
        for extra in wide.iterdir():
            if (
                extra.suffix == ".json"
                and extra.name not in ("config.json",)
                and "index" in extra.name
            ):
                shutil.copy(extra, fp8 / extra.name)
    return wide, fp8


def evict(folder: Path) -> None:
    os.sync()
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(folder: Path, dtype: str, device: torch.device):
    """lantau's load of the folder, as `--dtype` would ask it: seconds and the model."""
    import dataclasses

    from lantau.model.loader import build_model, read_model_config, resolve_model_source

    source = resolve_model_source(str(folder))
    config = dataclasses.replace(
        read_model_config(source), quantization="fp8" if dtype == "fp8" else None
    )
    start = time.perf_counter()
    model = build_model(source, config, torch.bfloat16, device, seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--work", default="/tmp/fp8ckpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    wide, fp8 = write_checkpoints(Path(args.work), args.layers)
    arms = {
        "FP8 checkpoint (stored e4m3)": (fp8, "fp8"),
        "bf16 checkpoint, --dtype fp8": (wide, "fp8"),
        "bf16 checkpoint, bf16": (wide, "bf16"),
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (folder, dtype) in arms.items():
            if args.cold:
                evict(folder)
            took, model = load(folder, dtype, device)
            seconds[name].append(took)
            if folder == fp8 and dtype == "fp8":  # the bytes stored, copied as they are
                from safetensors import safe_open

                shard = sorted(fp8.glob("*.safetensors"))[0]
                with safe_open(str(shard), "pt") as f:
                    name_0 = next(n for n in f.keys() if "layers.0.mlp.down_proj.weight" in n)  # noqa: SIM118
                    stored = f.get_tensor(name_0)
                held = model.model.layers[0].mlp.down_proj.weight.cpu()
                assert torch.equal(held.view(torch.uint8), stored.view(torch.uint8))
            del model
    cold = " (cold page cache)" if args.cold else ""
    print(f"\n{args.layers} layers of Llama 3.2 1B's shape on {args.device}{cold}; "
          f"{args.rounds} rounds, interleaved")  # fmt: skip
    print(f"{'load':<32} {'best s':>8} {'median s':>9} {'GB read':>8} {'GB/s':>6}")
    for name, (folder, _) in arms.items():
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
        best, median = min(seconds[name]), statistics.median(seconds[name])
        print(f"{name:<32} {best:>8.2f} {median:>9.2f} {size:>8.2f} {size / best:>6.2f}")


if __name__ == "__main__":
    main()
