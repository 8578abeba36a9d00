"""Server behaviour under overload, deadlines, SIGTERM drain and a dead engine: real
`lantau serve` processes on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import orjson

from tests import test_hardening as hardening

Server = hardening.Server
make_server = hardening.make_server  # the fixture: real servers, closed after each test

MODEL = "random:tiny"


def wait_idle(server: Server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = server.status()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0:
            return s
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: {server.status()}")


def long_body(max_tokens: int = 64, **extra) -> dict:
    return {"prompt": "Count with me:", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def test_overload_gets_429_and_the_rest_succeed(make_server):
    server = make_server("--max-pending-requests", "4")

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [
                client.post(f"{server.base}/v1/completions", json=long_body()) for _ in range(40)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}
    assert codes.count(429) >= 20 and codes.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 64
    wait_idle(server)


def test_deadline_aborts(make_server, tmp_path, monkeypatch):
    # 10 ms a step: 480 tokens take ~5 s, so each deadline passes mid-request, the stream's
    # after its first token however busy the machine (a deadline before the first token is a
    # plain 504, not a stream)
    delay = tmp_path / "delay"
    delay.write_text("0.01")
    monkeypatch.setenv("LANTAU_TEST_STEP_DELAY_FILE", str(delay))
    server = make_server()
    before = wait_idle(server)["num_generated_tokens"]
    r = httpx.post(f"{server.base}/v1/completions", json=long_body(480, timeout=0.3), timeout=30)
    assert r.status_code == 504 and r.json()["error"]["param"] == "timeout"
    after = wait_idle(server)["num_generated_tokens"]
    assert after - before < 480
    headers = {"x-request-timeout": "1.5"}
    body = long_body(480, stream=True)
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, headers=headers) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert any(b'"code":504' in e.encode() for e in events) and events[-1] == "data: [DONE]"
    assert wait_idle(server)["num_generated_tokens"] - after < 480


def test_sigterm_drains_in_flight_streams(make_server):
    server = make_server("--drain-timeout", "60")

    async def stream(client: httpx.AsyncClient) -> list[dict]:
        body = long_body(48, stream=True)
        chunks = []
        async with client.stream("POST", f"{server.base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(orjson.loads(line[6:]))
        return chunks

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client)) for _ in range(20)]
            while (await client.get(f"{server.base}/status")).json()["num_in_flight"] < 20:
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await client.post(f"{server.base}/v1/completions", json=long_body(4))
            health = await client.get(f"{server.base}/health")
            return await asyncio.gather(*tasks), refused, health

    results, refused, health = asyncio.run(main())
    assert refused.status_code == 503 and health.status_code == 503
    for chunks in results:
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(bool(c["choices"][0]["text"]) for c in chunks) >= 1
    assert server.proc.wait(timeout=60) == 0


def test_engine_death_fails_readiness_and_exits_nonzero(make_server):
    server = make_server()
    os.kill(server.status()["engine_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    saw_unready = False
    while time.monotonic() < deadline and not saw_unready:
        try:
            saw_unready = httpx.get(f"{server.base}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            saw_unready = True  # already gone
        time.sleep(0.1)
    assert saw_unready
    assert server.proc.wait(timeout=15) != 0


_SPAWN_ORDER = """
import sys
import lantau.engine.async_llm as async_llm

def spawn_core(config, source):
    first = "web stack imported" if "lantau.server.app" in sys.modules else "core first"
    print(first, config.model)
    raise SystemExit(0)

async_llm.spawn_core = spawn_core
from lantau.cli import main
main(["serve", "random:tiny", "--device", "cpu", "--port", "0"])
"""


def test_serve_spawns_the_engine_core_before_importing_the_web_stack():
    """`lantau serve MODEL` starts its engine core before it imports the server (FastAPI,
    uvicorn, gRPC, prometheus_client): the core's start runs beside those imports, which from
    a cold disk take seconds (CPU, all cold: ready 3.23 -> 2.93 s median)."""
    import subprocess
    import sys

    code = [sys.executable, "-c", _SPAWN_ORDER]
    done = subprocess.run(code, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "core first random:tiny"


def test_step_log_records_every_serving_step(make_server, tmp_path):
    """`--step-log FILE`: one JSON line a serving step (none for the warm-up), numbered from
    1, each with its batch; the new requests across them are the requests sent."""
    path = tmp_path / "steps.jsonl"
    server = make_server("--step-log", str(path))
    prompts = [[5, 17, 300, 9], [1, 2, 3], list(range(40, 70))]
    for ids in prompts:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 5, "ignore_eos": True}
        r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    wait_idle(server)
    records = [orjson.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert sum(r["new"] for r in records) == len(prompts)
    # each request: its prompt in prefill steps, then 4 decode steps (the 5th token is the
    # last step's sample)
    assert sum(r["tokens"] - r["decodes"] for r in records) == sum(map(len, prompts))
    assert sum(r["decodes"] for r in records) == 4 * len(prompts)
    for r in records:
        assert r["model"] == MODEL and r["pid"] != server.proc.pid  # the engine core's
        # (a step with no requests only collects the one before it)
        assert r["reqs"] <= r["tokens"] and r["decodes"] <= r["reqs"]
        assert 0 <= r["host_ms"] <= r["call_ms"] and r["device_ms"] is None  # CPU: no events
    assert all(a["t"] < b["t"] for a, b in zip(records, records[1:], strict=False))
    assert sum(r["reqs"] == 0 for r in records) < len(records) / 2
    # read back: every step counted once, by kind (no device times on the CPU)
    from lantau.bench.step_log import read_step_log, summarize_steps

    summary = summarize_steps(read_step_log(path), records[0]["t"], records[-1]["t"])
    kinds = summary["by_kind"]
    assert summary["steps"] == len(records) == sum(k["steps"] for k in kinds.values())
    assert kinds["decode"]["steps"] == sum(r["tokens"] == r["reqs"] > 0 for r in records)
    assert summary["device_busy_share"] is None and kinds["mixed"]["device_ms"] is None
    # `lantau bench serve --step-log`: the run's own steps, in its results and report
    from lantau.bench.report import write_report
    from lantau.bench.serve import ServeConfig, run_serve

    config = ServeConfig(base_url=server.base, workload="random:16/4", num_requests=4,
                         vocab_size=1000, step_log=str(path), show_progress=False,
                         is_probed=False, gpu_indices=())  # fmt: skip
    result = run_serve(config)
    steps = result.engine_steps
    assert result.summary.num_completed == 4 and steps["steps"] >= 4  # a step a token at least
    assert steps["by_kind"]["mixed"]["tokens"] >= 16 and steps["by_kind"]["decode"]["steps"] >= 3
    write_report(result.to_dict(), tmp_path / "report")
    assert "## Engine steps (means)" in (tmp_path / "report" / "report.md").read_text()
