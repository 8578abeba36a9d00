"""A CPU install has no Triton (the CPU torch wheel brings none): the torch backend must import
none, offline and served, and the triton backend must fail at start-up naming the package.

Every Python process of these tests starts with `sys.modules["triton"] = None` (a
sitecustomize.py on PYTHONPATH), the engine core process that `lantau serve` spawns included."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.servers import free_port, wait_ready


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-triton")
    (folder / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    path = os.pathsep.join([str(folder), os.getcwd(), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_python(code: str, env: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_offline_generate_imports_no_triton(env):
    out = run_python(
        "import sys\n"
        "from lantau import LLM, SamplingParams\n"
        "llm = LLM('random:tiny', device='cpu', max_model_len=128, num_kv_blocks=32)\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "assert sys.modules['triton'] is None\n"
        "print(len(out[0].outputs[0].token_ids))\n",
        env,
    )
    assert out.split() == ["4"]


def test_triton_backend_fails_at_start_naming_the_package(env):
    out = run_python(
        "from lantau.model.ops import make_ops\n"
        "try:\n"
        "    make_ops('triton')\n"
        "except ImportError as e:\n"
        "    print(e)\n",
        env,
    )
    assert "`triton` package" in out


def test_serve_answers_without_triton(env):
    port = free_port()
    cmd = [
        sys.executable, "-m", "lantau.cli", "serve", "random:tiny", "--device", "cpu",
        "--port", str(port), "--grpc-port", "0", "--max-model-len", "128",
        "--num-kv-blocks", "32",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        body = {"model": "random:tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
