"""A llama.cpp GGUF file: config from its metadata, weights dequantized to float32, tokenizer.

The file is memory-mapped (gguf_file.GGUFFile) and tensors are dequantized one at a time, so peak
memory is the float32 model plus one tensor. Tensor names are mapped to HF's, and q/k projection
rows are put back in HF's rotate-half order (llama.cpp's converter interleaves them).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import dequantize

from lantau import envs
from lantau.config import ModelConfig, RopeScaling
from lantau.errors import ModelLoadError
from lantau.model.gguf_file import GGUFFile, GGUFTensor

if TYPE_CHECKING:  # NOTE: configs and tokenizers are read without torch (the frontend)
    import torch

# GGUF architecture -> ModelConfig.architecture. llama.cpp writes "llama" for Llama, Mistral and
# SmolLM2 alike; Mistral's sliding window is not in the file, so all of them load as "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# llama.cpp's defaults for Llama 3.1+ rope scaling; it stores only the resulting per-frequency
# factors (rope_freqs.weight), which are checked against these.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # consumed by read_gguf_config, not a model parameter


def _open(path: str | Path) -> GGUFFile:
    """A parsed, memory-mapped GGUF file, or ModelLoadError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    _check_magic(path)
    try:
        return GGUFFile(path)
    except (ValueError, OSError, OverflowError) as e:  # GGUFFormatError is a ValueError
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {e}") from e


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    if len(head) < 4 or int.from_bytes(head, "little") != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")


_REQUIRED = object()


def _meta(reader: GGUFFile, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """Metadata value `key` converted to `kind` (int, float, str)."""
    field = reader.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{reader.path}: metadata key {key!r} is missing")
        return default
    try:
        value = field.contents()
    except (UnicodeDecodeError, IndexError) as e:  # values are decoded only when asked for
        raise ModelLoadError(f"{reader.path}: metadata key {key!r} is unreadable: {e}") from e
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]  # a per-layer list with one value for every layer
    if kind is str:
        ok = isinstance(value, str)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ModelLoadError(
            f"{reader.path}: metadata key {key!r} is {value!r}, expected one {kind.__name__}"
        )
    return kind(value)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model shape stated by a GGUF file's llama.cpp metadata."""
    reader = _open(path)
    gguf_arch = _meta(reader, "general.architecture", str)
    if gguf_arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{reader.path}: unsupported GGUF architecture {gguf_arch!r} "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    a = gguf_arch + "."
    shape = {
        "hidden_size": _meta(reader, a + "embedding_length", int),
        "intermediate_size": _meta(reader, a + "feed_forward_length", int),
        "num_hidden_layers": _meta(reader, a + "block_count", int),
        "num_attention_heads": _meta(reader, a + "attention.head_count", int),
        "vocab_size": _vocab_size(reader, a, tensors),
    }
    heads = shape["num_attention_heads"]
    shape["num_key_value_heads"] = _meta(reader, a + "attention.head_count_kv", int, heads)
    # key_length states the head width; Llama-family files otherwise rotate the whole head
    head_dim = _meta(reader, a + "attention.key_length", int, None)
    if head_dim is None:
        head_dim = _meta(reader, a + "rope.dimension_count", int, shape["hidden_size"] // heads)
    shape["head_dim"] = head_dim
    if bad := [k for k, v in shape.items() if v <= 0]:
        raise ModelLoadError(f"{reader.path}: metadata gives non-positive {', '.join(bad)}")
    theta = _meta(reader, a + "rope.freq_base", float, 10000.0)
    try:
        return ModelConfig(
            architecture=_ARCHITECTURES[gguf_arch],
            **shape,
            rms_norm_eps=_meta(reader, a + "attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_theta=theta,
            rope_scaling=_rope_scaling(reader, a, tensors.get(_ROPE_FREQS), head_dim, theta),
            max_position_embeddings=_meta(reader, a + "context_length", int, 4096),
            # llama.cpp writes output.weight only when it is not the embedding matrix
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=gguf_arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
            bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", int, None),
            eos_token_ids=_eos_token_ids(reader),
        )
    except ValueError as e:
        raise ModelLoadError(f"{reader.path}: inconsistent model metadata: {e}") from e


def _vocab_size(reader: GGUFFile, a: str, tensors: dict[str, GGUFTensor]) -> int:
    # The embedding's row count is what the weights hold (it may be padded past the tokenizer's
    # vocabulary); the metadata only matters when the tensor is absent.
    embed = tensors.get("token_embd.weight")
    if embed is not None and len(embed.shape) == 2:
        return int(embed.shape[1])  # GGUF lists dims innermost first: [hidden, vocab]
    size = _meta(reader, a + "vocab_size", int, None)
    if size is not None:
        return size
    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{reader.path}: no token embedding and no vocabulary")
    return tokens.count


def _eos_token_ids(reader: GGUFFile) -> tuple[int, ...]:
    # llama.cpp stops generation on any of these (end of sequence, of turn, of message)
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = _meta(reader, "tokenizer.ggml." + key, int, None)
        if token is not None and token not in ids:
            ids.append(token)
    return tuple(ids)


def _rope_scaling(
    reader: GGUFFile, a: str, rope_freqs: GGUFTensor | None, head_dim: int, theta: float
) -> RopeScaling | None:
    if rope_freqs is not None:
        return _llama3_scaling(reader, rope_freqs, head_dim, theta)
    kind = _meta(reader, a + "rope.scaling.type", str, None)
    factor = _meta(reader, a + "rope.scaling.factor", float, None)
    if kind is None and (old_linear := _meta(reader, a + "rope.scale_linear", float, None)):
        kind, factor = "linear", old_linear  # the key older converters wrote
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{reader.path}: unsupported rope scaling type {kind!r}")
    if factor is None or factor == 1.0:
        return None
    return RopeScaling(rope_type="linear", factor=factor)


def _llama3_scaling(
    reader: GGUFFile, rope_freqs: GGUFTensor, head_dim: int, theta: float
) -> RopeScaling:
    """Llama 3.1+ scaling, recognised from the per-frequency divisors llama.cpp stores."""
    try:
        factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64).ravel()
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{reader.path}: unreadable {_ROPE_FREQS}: {e}") from e
    scaling = RopeScaling(
        rope_type="llama3",
        factor=float(factors.max()) if factors.size else 1.0,
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )
    from lantau.model.llama import rope_inv_freq  # torch: only for Llama 3 scaled GGUFs

    plain = rope_inv_freq(head_dim, theta, None).double()
    expected = (plain / rope_inv_freq(head_dim, theta, scaling).double()).numpy()
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ModelLoadError(
            f"{reader.path}: {_ROPE_FREQS} is not Llama 3 rope scaling with "
            f"low/high frequency factors {_LLAMA3_LOW_FREQ_FACTOR}/{_LLAMA3_HIGH_FREQ_FACTOR} and "
            f"original context {_LLAMA3_ORIGINAL_CONTEXT}; other rope factors are not supported"
        )
    return scaling


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _hf_shape(hf_name: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The shape HF gives `hf_name` under config `c`; None for a name HF does not have."""
    h, i = c.hidden_size, c.intermediate_size
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (c.vocab_size, h)
    if hf_name == "model.norm.weight" or hf_name.endswith("layernorm.weight"):
        return (h,)
    module, kind = hf_name.split(".")[-2:]
    matrices = {
        "q_proj": (c.q_size, h), "k_proj": (c.kv_size, h), "v_proj": (c.kv_size, h),
        "o_proj": (h, c.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }  # fmt: skip
    if kind == "weight":
        return matrices.get(module)
    if module in ("q_proj", "k_proj", "v_proj"):
        return matrices[module][:1]  # bias
    return None


def _plan(path: Path, reader: GGUFFile, config: ModelConfig) -> list[tuple[str, GGUFTensor]]:
    """(HF name, tensor) for every weight, checked before any is dequantized, so a bad file
    fails before the model is half loaded."""
    plan = []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(t.name)
        layer = _LAYER_TENSOR.fullmatch(t.name)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            hf_name = None
        shape = None if hf_name is None else _hf_shape(hf_name, config)
        if shape is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
        if tuple(int(d) for d in reversed(t.shape)) != shape:  # GGUF lists dims innermost first
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has shape {tuple(reversed(t.shape))}, "
                f"expected {shape} for {hf_name}"
            )
        if not _can_dequantize(t.tensor_type):
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}"
            )
        plan.append((hf_name, t))
    return plan


@functools.cache
def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    # Integer tensors (I8..I64) and F64 are not weights; gguf also lacks some exotic quants.
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if block_size == 1:
        return qtype == GGMLQuantizationType.BF16
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute: per head, llama.cpp interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...) for its paired rope; HF's rotate-half wants them back in halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor) for every weight, dequantized one tensor at a time.

    The file is opened and every tensor checked here, so a bad file raises at the call."""
    path = Path(path)
    plan = _plan(path, _open(path), config)
    return _dequantized(path, plan, config)


def _dequantized(
    path: Path, plan: list[tuple[str, GGUFTensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    # llama.cpp permutes q/k only for its "llama" architecture (Llama, Mistral, SmolLM2);
    # Qwen2 is converted as-is because llama.cpp runs it with rotate-half ("neox") rope.
    import torch

    permuted = config.architecture in ("llama", "mistral")
    for hf_name, t in plan:
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            if t.tensor_type in _TORCH_DEQUANT:
                w = _dequantize_blocks(t.data, t.tensor_type).reshape(shape).numpy()
            else:
                w = _dequantize_rows(t.data, t.tensor_type).reshape(shape)
        except (ValueError, NotImplementedError) as e:
            raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from e
        if permuted and ".q_proj." in hf_name:
            w = _unpermute_rope_rows(w, config.num_attention_heads)
        elif permuted and ".k_proj." in hf_name:
            w = _unpermute_rope_rows(w, config.num_key_value_heads)
        # a copy in any case: F32 tensors are read-only views of the memory map
        yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def _dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's dequantization of the whole tensor in one call (its `dequantize` splits it into
    row groups, at a numpy call each)."""
    if GGML_QUANT_SIZES[qtype][0] == 1:  # F32, F16, BF16
        return dequantize(data, qtype)
    import gguf.quants

    return getattr(gguf.quants, qtype.name).dequantize_rows(data.view(np.ndarray))


# The legacy 32-value block types, dequantized in torch (whole tensors, multi-threaded):
# type -> (bytes of f16 scales before the values, 4-bit values)
_TORCH_DEQUANT = {
    GGMLQuantizationType.Q8_0: (2, False),
    GGMLQuantizationType.Q4_0: (2, True),
    GGMLQuantizationType.Q4_1: (4, True),
}


def _dequantize_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Q8_0: d * q (int8); Q4_0: d * (q - 8); Q4_1: d * q + m, with q a 4-bit value: the low
    nibbles of a block's 16 bytes are its first 16 values, the high ones the last 16. The same
    float32 operations, in the same order, as gguf's numpy (and so as ggml's)."""
    import torch

    scales_bytes, nibbles = _TORCH_DEQUANT[qtype]
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, type_size))
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    packed = blocks[:, scales_bytes:]
    if not nibbles:
        return packed.contiguous().view(torch.int8).float() * d
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1)
    if qtype == GGMLQuantizationType.Q4_0:
        return d * (q.to(torch.int8) - 8).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return d * q.float() + m


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer (with its chat template) that transformers rebuilds from the metadata.
    Rebuilding it takes seconds (the default model's: ~5 s of a server's start), so it is saved
    once in the cache (lantau/envs.py: LANTAU_CACHE_DIR) and loaded from there after."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    _check_magic(path)
    from lantau.model.hf_loader import load_hf_tokenizer

    cached = _tokenizer_cache(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        with contextlib.suppress(Exception):  # a damaged cache entry: rebuild it
            return load_hf_tokenizer(cached)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:
        # transformers reads the file with gguf too, so any failure is a bad or unsupported file
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    if cached is not None:
        _save_tokenizer(tokenizer, cached)
    return tokenizer


def _tokenizer_cache(path: Path) -> Path | None:
    """The cache folder of this file's tokenizer: keyed by the file (path, size, mtime) and
    transformers' version; None when caching is off."""
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return envs.cache_entry("tokenizers", key)


def _save_tokenizer(tokenizer, folder: Path) -> None:
    """Write into a fresh folder, then rename: a reader never sees half an entry, and of two
    processes saving at once the second simply finds the first's."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-")
    except OSError:  # a read-only cache: go without
        return
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:  # another process saved it first (or the disk is full)
        shutil.rmtree(tmp, ignore_errors=True)
