"""The frontend starts light: the server, AsyncLLM and the echo engine import no torch (the
engine core process is the only one that needs it), and building a server's config neither."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
{imports}
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch loaded: {{loaded[:5]}}"
print("ok")
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import lantau.server.app",
        "import lantau.engine.async_llm",
        "import lantau.bench.echo_engine",
        "import lantau.bench.serve, lantau.bench.report, lantau.bench.monitor",
        "import lantau.server.kserve_grpc, lantau.server.kserve_http, lantau.cli",
        "import lantau.gateway.proxy, lantau.gateway.metrics",
        "from lantau.engine.args import build_engine_config\n"
        "config, _ = build_engine_config('random:tiny', max_model_len=256)\n"
        "assert config.device == 'auto' and config.dtype == 'auto'",
    ],
)
def test_frontend_imports_no_torch(imports):
    code = CHECK.format(imports=imports)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_engine_core_resolves_auto():
    from lantau.engine.args import build_engine_config, resolve_device

    config, _ = build_engine_config("random:tiny")
    assert resolve_device(config, cuda_available=False).device == "cpu"
    assert resolve_device(config, cuda_available=False).dtype == "float32"
    on_gpu = resolve_device(config, cuda_available=True)
    assert (on_gpu.device, on_gpu.dtype, on_gpu.attention_backend) == ("cuda", "bfloat16", "triton")
    pinned, _ = build_engine_config("random:tiny", device="cpu", dtype="bfloat16")
    assert resolve_device(pinned, cuda_available=True).device == "cpu"
    assert pinned.attention_backend == "torch" and pinned.dtype == "bfloat16"


def test_tokenizer_json_loads_without_torch_and_as_autotokenizer(tmp_path):
    """A tokenizer.json of transformers' generic class (engine folders, the default model's
    cached GGUF tokenizer) loads in the frontend without torch, and tokenizes, decodes and
    renders the chat template as AutoTokenizer's does."""
    from transformers import AutoTokenizer

    from lantau.model.hf_loader import load_hf_tokenizer
    from lantau.model.source import load_tokenizer, resolve_model_source

    default = load_tokenizer(resolve_model_source("random:tiny"))  # the default model's
    default.save_pretrained(tmp_path)
    imports = (
        "from pathlib import Path\n"
        "from lantau.model.hf_loader import load_hf_tokenizer\n"
        f"assert len(load_hf_tokenizer(Path({str(tmp_path)!r}))) == 49152\n"
        "from lantau.model.source import load_tokenizer, resolve_model_source\n"
        "assert load_tokenizer(resolve_model_source('random:tiny')) is not None"
    )
    code = CHECK.format(imports=imports)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    fast, auto = load_hf_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["Hello world", " leading space", "héllo 日本語 🙂\n\ttabs", "<|im_start|>hi"]:
        ids = auto(text)["input_ids"]
        assert fast(text)["input_ids"] == ids and fast.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "Hi"}]
    assert fast.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False
    )
    assert fast.all_special_ids == auto.all_special_ids
