"""Shared fixtures: tiny random HF checkpoints saved to disk, loaded by lantau like any folder."""

from __future__ import annotations

import contextlib
import os
import time

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before any
# module that defines a kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402


def save_tiny_hf_model(folder, config) -> transformers.PreTrainedModel:
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
    return model


TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,  # wide logits: no greedy near-ties by chance
    eos_token_id=2,
    bos_token_id=1,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(folder, transformers.LlamaConfig(**TINY_LLAMA))
    return folder


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **extra):
    """HF `generate` greedy on one prompt: (new token ids, the last step's logits)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1][0]


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """The interpreter of Triton 3.6 multiplies bf16 tl.dot operands as their raw uint16 bits
    (numpy has no bf16); upcast them to fp32 first, as a GPU's bf16 MMA does with fp32
    accumulation. The kernels themselves are unchanged."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = self.cast_impl(a, tl.float32), self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def interpreter_fp8_cast(monkeypatch):
    """The interpreter of Triton 3.6 rounds to fp8 by adding the cut-off bit to the mantissa
    without carrying it into the exponent (31.9 -> 16, not 32), and with no ties to even;
    convert to and from e4m3 through torch's cast instead (round to nearest even, as a GPU's
    cvt.rn does). The kernels themselves are unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp
    torch_dtypes = {
        tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }  # fmt: skip
    ints = {1: (np.int8, torch.int8), 2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (src_ty, dst_ty):
            return original(self, src, dst_type, rounding_mode)
        data = np.ascontiguousarray(src.data)  # the raw bits (bf16 and fp8 as unsigned ints)
        x = torch.from_numpy(data.view(ints[data.itemsize][0])).view(torch_dtypes[src_ty])
        y = x.to(torch_dtypes[dst_ty])
        bits = y.view(ints[y.element_size()][1]).numpy()
        return interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(dst_type)), dst_ty)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


def _descendants() -> dict[int, str]:
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        # multiprocessing's resource tracker lives as long as the test process, by design
        if "resource_tracker" not in cmdline:
            found[child.pid] = cmdline
    return found


@pytest.fixture(autouse=True, scope="module")
def no_process_outlives_its_module():
    """Every process a test module starts (servers, engine cores, browsers) is gone when the
    module ends: one left behind is killed and fails the module's last test."""
    import psutil

    before = set(_descendants())
    yield
    deadline = time.monotonic() + 10
    while (left := {p: c for p, c in _descendants().items() if p not in before}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    assert not left, f"processes outlived their test module: {left}"
