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
