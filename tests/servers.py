"""Servers the tests start: `lantau serve` as a real process on loopback, or an app (a
scripted engine's) under uvicorn on a thread."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    base: str, proc: subprocess.Popen, timeout: float = 120.0, log: Callable[[], str] | None = None
) -> None:
    """Until /health answers 200; `log`: the server's output where it is not proc.stdout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = log() if log else proc.stdout.read()
            raise RuntimeError(f"server exited with {proc.returncode}: {output}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("server did not become ready")


def kserve_greedy_text(base: str, model: str, text: str, max_tokens: int) -> str:
    """KServe v2's generate for `model` (a model, or an adapter by its name): the greedy
    text_output of max_tokens tokens, EOS ignored."""
    reply = httpx.post(f"{base}/v2/models/{model}/generate", timeout=60, json={
        "text_input": text,
        "parameters": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    })  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()["text_output"]


@contextlib.contextmanager
def lantau_serve(
    model: str, *flags: str, max_model_len: int = 512, num_kv_blocks: int = 128
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`lantau serve MODEL` on CPU (no gRPC unless `flags` name a port), ready: its base URL
    and process; stopped at the end (SIGTERM, then SIGKILL), its output then in
    `proc.output`."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "lantau.cli", "serve", model, "--device", "cpu",
        "--port", str(port), "--grpc-port", "0", "--max-model-len", str(max_model_len),
        "--num-kv-blocks", str(num_kv_blocks), *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.output = proc.communicate(timeout=30)[0]


@contextlib.contextmanager
def app_server(app) -> Iterator[str]:
    """An ASGI app under uvicorn on a thread, started: its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
