"""EchoEngine behind the real app, driven by the official `openai` client: max_tokens N streams
exactly N chunks, and a client leaving early takes its request out of `engine.queues`."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from lantau.bench.echo_engine import EchoEngine
from lantau.errors import InvalidRequestError
from lantau.server.app import ServerConfig, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture(scope="module")
def served():
    """(engine, base URL) of the app served by uvicorn in a thread."""
    engine = EchoEngine()
    port = free_port()
    app = build_app(engine, ServerConfig(port=port, grpc_port=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started), "uvicorn did not start"
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture()
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("max_tokens", [1, 7, 200])
def test_streams_one_chunk_per_token(client, max_tokens):
    stream = client.completions.create(
        model="lantau", prompt="hello there", max_tokens=max_tokens, stream=True
    )
    chunks = list(stream)
    assert len(chunks) == max_tokens
    assert all(c.choices[0].text == " tok" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_not_streamed_and_n(client):
    completion = client.completions.create(model="lantau", prompt="hi", max_tokens=3, n=2)
    assert [c.text for c in completion.choices] == [" tok tok tok"] * 2
    assert completion.usage.completion_tokens == 6


def test_client_leaving_early_is_dropped_from_queues(served, client):
    engine, base = served
    stream = client.completions.create(
        model="lantau", prompt="hello there", max_tokens=10**8, stream=True
    )
    for _, chunk in zip(range(3), stream, strict=False):
        assert chunk.choices[0].text == " tok"
    assert len(engine.queues) == 1  # far from done: 10**8 tokens
    stream.close()
    assert wait_until(lambda: not engine.queues), "the request is still in flight"
    status = httpx.get(f"{base}/status").json()
    assert status["num_in_flight"] == 0 and status["ready"]


def test_empty_prompt_is_refused(served, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="lantau", prompt="   ", max_tokens=4)
    with pytest.raises(InvalidRequestError):
        served[0].tokenize("")
    assert len(served[0].tokenize("three words here")[1]) == 3


def test_served_model_aliases():
    """`--served-model-name NAME ALIAS...` (vLLM's): requests may name any (an app written
    for another provider's model name keeps working), /v1/models lists all, answers name the
    first; another name is a 404."""
    from fastapi.testclient import TestClient

    from lantau.cli import make_parser

    args = make_parser().parse_args(["serve", "--served-model-name", "support-llama", "gpt-4o"])
    assert args.served_model_name == ["support-llama", "gpt-4o"]
    config = ServerConfig(grpc_port=0, served_model_name="support-llama",
                          served_model_aliases=("gpt-4o",))  # fmt: skip
    client = TestClient(build_app(EchoEngine(), config))
    listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert listed == ["support-llama", "gpt-4o"]
    body = {"prompt": "hi", "max_tokens": 2}
    r = client.post("/v1/completions", json={**body, "model": "gpt-4o"})
    assert r.status_code == 200 and r.json()["model"] == "support-llama"
    assert client.post("/v1/completions", json={**body, "model": "gpt-5"}).status_code == 404
    assert client.get("/v2/models/gpt-4o/ready").status_code == 200
