"""An HF checkpoint's own quantization (`quantization_config` in config.json), read without
torch: which FP8 checkpoints lantau reads, and a clear error for the rest.

lantau reads the FP8 (e4m3) checkpoints published for vLLM and TensorRT-LLM users:

- `compressed-tensors` (llm-compressor's, e.g. RedHatAI's `*-FP8-dynamic` and `*-FP8`):
  config groups of 8-bit float weights by channel, by tensor or by block;
- `fp8` (transformers' fine-grained FP8, e.g. Qwen's `*-FP8`): e4m3 weights with
  `weight_scale_inv` by block (`weight_block_size`) or `weight_scale` by tensor;
- `fbgemm_fp8` (Meta's `*-FP8`): e4m3 weights by channel;
- `modelopt` FP8 (NVIDIA's `nvidia/*-FP8`, TensorRT-LLM's own): e4m3 weights by tensor,
  described in config.json or in the older `hf_quant_config.json` beside it.

The tensors themselves say which layers are e4m3 (a scale beside each); `hf_loader` pairs them
and `lantau.model.fp8.checkpoint_weight` reads each scale's layout. Activations are quantized
by token on the fly whatever the checkpoint's activation scheme says (static `input_scale`s and
calibrated KV scales are not used: docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8", "modelopt")
MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")  # the quant_algo values that are e4m3 weights
# the per-tensor extras a checkpoint may carry beside its e4m3 weights, which lantau does not
# use: static activation scales, and the KV cache's or attention's calibrated scales
UNUSED_SCALES = frozenset({
    "input_scale", "output_scale", "input_scale_ub", "k_scale", "v_scale", "kv_scale",
    "q_scale", "prob_scale",
})  # fmt: skip
_WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class CheckpointQuantization:
    """An FP8 checkpoint's scheme, as far as loading needs it."""

    method: str  # one of FP8_METHODS
    block: tuple[int, int] | None = None  # [rows, columns] of a block-wise scale's blocks


def checkpoint_quantization(
    config: dict[str, Any], hf_quant: dict[str, Any] | None = None
) -> CheckpointQuantization | None:
    """The checkpoint's FP8 scheme from its config.json dict (or ModelOpt's older
    hf_quant_config.json, `hf_quant`); None for an unquantized one. ValueError naming the
    field for a quantization lantau does not read."""
    q = config.get("quantization_config")
    if q is None and hf_quant is not None:
        section = hf_quant.get("quantization") if isinstance(hf_quant, dict) else None
        if not isinstance(section, dict):
            raise ValueError("hf_quant_config.json: no quantization object")
        q = {"quant_method": "modelopt", **section}
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError("quantization_config: not an object")
    method = q.get("quant_method")
    if method not in FP8_METHODS:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported; lantau reads FP8 "
            f"checkpoints ({', '.join(FP8_METHODS)}): use one, or the unquantized checkpoint "
            "(with --dtype fp8 to quantize it as it loads)"
        )
    if method == "compressed-tensors":
        return CheckpointQuantization(method, _compressed_tensors_block(q))
    if method == "modelopt":
        algo = str(q.get("quant_algo")).upper()
        if algo not in MODELOPT_FP8:
            raise ValueError(
                f"quantization_config.quant_algo: {q.get('quant_algo')!r} is not supported "
                f"(ModelOpt's {', '.join(MODELOPT_FP8)} are)"
            )
        return CheckpointQuantization(method)
    if method == "fp8":
        block = q.get("weight_block_size")
        return CheckpointQuantization(method, _block(block, "weight_block_size") if block else None)
    return CheckpointQuantization(method)


def _compressed_tensors_block(q: dict[str, Any]) -> tuple[int, int] | None:
    """Every config group's weights must be 8-bit floats; the block shape of block-wise ones."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: missing or empty")
    blocks = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where}: not an object")
        fmt = group.get("format", q.get("format"))
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise ValueError(f"{where}.format: {fmt!r} is not supported (only float-quantized)")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(f"{where}.weights: missing")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"{where}.weights: {weights.get('num_bits')}-bit {weights.get('type')} is not "
                "supported (only 8-bit float: e4m3)"
            )
        strategy = weights.get("strategy")
        if strategy not in _WEIGHT_STRATEGIES:
            raise ValueError(
                f"{where}.weights.strategy: {strategy!r} is not one of "
                f"{', '.join(_WEIGHT_STRATEGIES)}"
            )
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"{where}.weights.block_structure"))
    if len(blocks) > 1:
        raise ValueError("quantization_config.config_groups: differing block_structure")
    return blocks.pop() if blocks else None


def _block(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"{where}: {value!r} is not two positive integers")
    return int(value[0]), int(value[1])
