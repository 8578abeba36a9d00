"""`lantau route`, the gateway: its routing policies exactly (plain Python), then the proxy in
a thread in front of scripted fake replicas (failover, retries, a stream cut, drain-and-remove,
its /metrics), then as a real process in front of two real `lantau serve` processes, one of
them killed under load."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import openai
import orjson
import pytest

from lantau.bench.monitor import parse_prometheus
from lantau.gateway.policy import (
    Backend,
    LeastLoaded,
    RoundRobin,
    SessionAffinity,
    backends_to_try,
    choose_backend,
    make_policy,
)
from lantau.gateway.proxy import GATEWAY, GatewayConfig, build_app
from tests.fake_openai_server import AppThread, FakeOpenAIServer, Script
from tests.servers import free_port, wait_ready

# --- the policies ---------------------------------------------------------------------------


def backends(n: int, loads=None) -> list[Backend]:
    out = [Backend(f"http://10.0.0.{i}:8000", is_healthy=True) for i in range(n)]
    for b, load in zip(out, loads or [0] * n, strict=True):
        b.num_in_flight = load
    return out


def test_round_robin_and_least_loaded():
    pool = backends(3)
    rr = RoundRobin()
    picks = [rr.choose(pool, None).url for _ in range(6)]
    assert Counter(picks) == Counter({b.url: 2 for b in pool}) and picks[:3] == picks[3:]
    ll = LeastLoaded()
    assert ll.choose(backends(3, [4, 1, 2]), None).url.endswith(".1:8000")
    idle = backends(3)  # ties: taken in turn, not always the first
    assert {ll.choose(idle, None).url for _ in range(3)} == {b.url for b in idle}


def test_load_is_the_replicas_own_count_where_it_reports_one():
    a, b = backends(2)
    assert a.load == 0
    a.report_in_flight(10)  # other gateways' requests
    a.start_request()
    assert (a.num_in_flight, a.load) == (1, 11)
    assert LeastLoaded().choose([a, b], None) is b
    a.report_in_flight(0)  # the next check: it has emptied
    assert a.load == 1  # this gateway's own request is still open
    a.end_request()
    b.report_in_flight(None)  # no /status
    b.num_in_flight = 3
    assert b.load == 3 and LeastLoaded().choose([a, b], None) is a


def test_session_affinity_is_stable_moves_few_and_bounds_load():
    policy = SessionAffinity(load_factor=1.25)
    pool = backends(4)
    keys = [f"user-{i}" for i in range(2000)]
    first = {k: policy.choose(pool, k).url for k in keys}
    assert first == {k: policy.choose(pool, k).url for k in keys}  # stable
    assert SessionAffinity().choose(pool, "user-7").url == first["user-7"]  # any process
    counts = Counter(first.values())
    assert all(350 <= c <= 650 for c in counts.values()), counts  # spread evenly
    # losing a backend moves only the sessions that were on it
    gone = pool[2].url
    moved = {k: policy.choose(pool[:2] + pool[3:], k).url for k in keys}
    assert all(moved[k] == first[k] for k in keys if first[k] != gone)
    # bounded load: a session's backend over 1.25 x the mean hands it to its next choice
    key = "user-7"
    loaded = backends(4, [0, 0, 0, 0])
    home = next(b for b in loaded if b.url == first[key])
    home.num_in_flight = 3  # total 4 with this request: cap ceil(1.25 * 4 / 4) = 2
    assert policy.choose(loaded, key).url != home.url
    for b in loaded:  # 1 each: total 5, cap ceil(1.25 * 5 / 4) = 2
        b.num_in_flight = 1
    assert policy.choose(loaded, key).url == home.url
    assert policy.choose(backends(2, [5, 0]), None).url.endswith(".1:8000")  # no key: least


def test_choose_backend_skips_down_draining_and_tried():
    pool = backends(4)
    pool[0].is_healthy = False
    pool[1].is_draining = True
    policy = LeastLoaded()
    assert choose_backend(policy, pool, None, {pool[2].url}) is pool[3]
    assert choose_backend(policy, pool, None, {pool[2].url, pool[3].url}) is None
    pool[0].is_healthy = True
    order = backends_to_try(RoundRobin(), pool, max_attempts=2)
    first = next(order)
    next(b for b in pool if b is not first and b.is_available).is_healthy = False
    rest = list(order)  # the pick after a failure sees what changed meanwhile
    assert len(rest) == 1 and rest[0] is not first and rest[0].is_available
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="at least 1"):
        SessionAffinity(load_factor=0.5)


def test_health_transitions_are_counted():
    b = Backend("http://x:1")
    assert b.set_healthy(True) and not b.set_healthy(True)
    assert b.set_healthy(False, "refused") and b.last_error == "refused"
    assert b.num_transitions == {"up": 1, "down": 1}


# --- the proxy in front of fake replicas ----------------------------------------------------


class GatewayThread(AppThread):
    """build_app(config) served on loopback by a thread of its own (as `lantau route` serves
    it: no request decompression, handlers cancelled when their client goes)."""

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(
            lambda: build_app(config), auto_decompress=False, handler_cancellation=True
        )

    @property
    def gateway(self):
        return self.app[GATEWAY]

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"{self.url}/metrics").text)


def gateway(*urls: str, **kw) -> GatewayThread:
    kw.setdefault("health_interval_s", 0.2)
    return GatewayThread(GatewayConfig(backends=urls, port=0, **kw))


def body(i: int, max_tokens: int = 4, stream: bool = True) -> dict:
    return {"model": "fake-model", "prompt": [i, 1, 2], "max_tokens": max_tokens, "stream": stream}


def post(g: GatewayThread, payload: dict, **kw) -> httpx.Response:
    return httpx.post(f"{g.url}/v1/completions", json=payload, timeout=30, **kw)


def events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


QUICK = Script(ttft_s=0.01, itl_s=0.005)


def test_streams_pass_through_and_spread():
    with (
        FakeOpenAIServer(lambda b: QUICK) as a,
        FakeOpenAIServer(lambda b: QUICK) as b,
        gateway(a.url, b.url) as g,
    ):
        direct = httpx.post(f"{a.url}/v1/completions", json=body(0), timeout=10).text
        answers = [post(g, body(i)) for i in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        assert all(r.headers["content-type"].startswith("text/event-stream") for r in answers)
        assert all(r.text == direct for r in answers)  # byte for byte
        assert len(a.bodies) - 1 == 3 and len(b.bodies) == 3  # least loaded, ties in turn
        m = g.metrics()
        assert m[f'lantau:gateway_backend_responses_total{{backend="{b.url}",code="200"}}'] == 3
        assert m[f'lantau:gateway_backend_up{{backend="{a.url}"}}'] == 1
        assert m[f'lantau:gateway_request_duration_seconds_count{{backend="{b.url}"}}'] == 3


def test_bodies_pass_as_sent_and_are_capped():
    """A gzip body goes on compressed (the replica undoes it and caps what it inflates to);
    one past the gateway's cap is refused there."""
    with FakeOpenAIServer(lambda b: QUICK) as a, gateway(a.url, max_body_bytes=1000) as g:
        packed = gzip.compress(orjson.dumps(body(7)))
        r = httpx.post(
            f"{g.url}/v1/completions", content=packed, timeout=10,
            headers={"content-encoding": "gzip", "content-type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 200 and a.bodies[-1]["prompt"] == [7, 1, 2]
        r = httpx.post(f"{g.url}/v1/completions", content=b" " * 1001, timeout=10)
        assert r.status_code == 413 and len(a.bodies) == 1


def test_replicas_reported_load_steers_least_loaded():
    """A replica that reports many requests in flight (another gateway's) gets none of this
    gateway's until its report drops."""
    with FakeOpenAIServer(lambda b: QUICK) as a, FakeOpenAIServer(lambda b: QUICK) as b:
        a.reported_in_flight, b.reported_in_flight = 50, 0
        with gateway(a.url, b.url) as g:
            for i in range(4):
                assert post(g, body(i)).status_code == 200
            assert (len(a.bodies), len(b.bodies)) == (0, 4)
            a.reported_in_flight, b.reported_in_flight = 0, 50
            deadline = time.monotonic() + 5
            while [x.reported_in_flight for x in g.gateway.backends] != [0, 50]:
                assert time.monotonic() < deadline, "the new reports were never read"
                time.sleep(0.05)
            for i in range(4):
                assert post(g, body(10 + i)).status_code == 200
            assert (len(a.bodies), len(b.bodies)) == (4, 4)


def test_headers_passed_on():
    """End-to-end headers go on once each; hop-by-hop ones and those `Connection` names do not;
    the request id is the client's, or a new one, and x-forwarded-for grows by the client."""
    with FakeOpenAIServer(lambda b: QUICK) as a, gateway(a.url) as g:
        sent = {"X-Request-ID": "abc", "X-Forwarded-For": "10.1.1.1", "Authorization": "Bearer k",
                "Connection": "keep-alive, X-Hop", "X-Hop": "1", "X-Custom": "yes"}  # fmt: skip
        assert post(g, body(0), headers=sent).status_code == 200
        assert post(g, body(1)).status_code == 200
        seen, fresh = a.headers
        assert seen.getall("x-request-id") == ["abc"] and seen["authorization"] == "Bearer k"
        assert seen.getall("x-forwarded-for") == ["10.1.1.1, 127.0.0.1"]
        assert "x-hop" not in seen and seen["x-custom"] == "yes"
        assert len(fresh["x-request-id"]) == 32 and fresh["x-forwarded-for"] == "127.0.0.1"


def test_a_dead_replica_is_routed_around_and_marked_down():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # NOTE: no health checks after the first: the dead one is found by a request
    with (
        FakeOpenAIServer(lambda b: QUICK) as a,
        gateway(dead, a.url, policy="round-robin", health_interval_s=60) as g,
    ):
        g.gateway.backends[0].is_healthy = True  # as if it had died since its last check
        answers = [post(g, body(i, stream=i % 2 == 0)) for i in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        assert len(a.bodies) == 4
        m = g.metrics()
        assert m[f'lantau:gateway_retries_total{{backend="{dead}",reason="connect"}}'] == 1
        assert m[f'lantau:gateway_backend_up{{backend="{dead}"}}'] == 0
        listed = httpx.get(f"{g.url}/gateway/backends").json()["backends"]
        assert "Cannot connect" in listed[0]["last_error"] and listed[1]["healthy"]


def test_refusals_retried_elsewhere_and_passed_on_when_everyone_refuses():
    busy = Script(status=429)
    with (
        FakeOpenAIServer(lambda b: busy) as a,
        FakeOpenAIServer(lambda b: Script(status=503)) as b,
        FakeOpenAIServer(lambda b: QUICK) as c,
        gateway(a.url, b.url, c.url, policy="round-robin", health_interval_s=60) as g,
    ):
        answers = [post(g, body(i)) for i in range(3)]
        assert [r.status_code for r in answers] == [200] * 3 and len(c.bodies) == 3
        assert not g.gateway.backends[1].is_healthy  # a 503 is a replica not ready for work
        m = g.metrics()
        assert m[f'lantau:gateway_retries_total{{backend="{a.url}",reason="http_429"}}'] >= 1
    with (
        FakeOpenAIServer(lambda b: busy) as a,
        FakeOpenAIServer(lambda b: busy) as b,
        gateway(a.url, b.url) as g,
    ):
        r = post(g, body(0))
        assert r.status_code == 429 and r.json()["error"]["message"] == "scripted"
        assert g.metrics()['lantau:gateway_failed_requests_total{reason="http_429"}'] == 1


def test_a_stream_cut_before_its_first_event_is_retried_after_it_ends_with_an_error():
    def script_of(cut_at):
        return lambda b: Script(ttft_s=0.01, itl_s=0.005, break_after=cut_at)

    with (
        FakeOpenAIServer(script_of(0)) as a,
        FakeOpenAIServer(lambda b: QUICK) as b,
        gateway(a.url, b.url, policy="round-robin") as g,
    ):
        answers = [post(g, body(i)) for i in range(2)]
        assert all(events(r.text)[-1] == "[DONE]" and len(events(r.text)) == 6 for r in answers)
        assert len(b.bodies) == 2  # each ended there, one after a cut on a
    with FakeOpenAIServer(script_of(2)) as a, gateway(a.url) as g:
        r = post(g, body(0, max_tokens=6))
        sent = events(r.text)
        assert r.status_code == 200 and len(sent) == 4 and sent[-1] == "[DONE]"
        assert '"text": "x"' in sent[0] and '"text": "x"' in sent[1]
        assert "the replica serving this stream failed" in sent[2]
        assert g.metrics()['lantau:gateway_failed_requests_total{reason="stream_cut"}'] == 1


def test_no_backend_health_and_session_affinity():
    with (
        FakeOpenAIServer(lambda b: QUICK) as a,
        FakeOpenAIServer(lambda b: QUICK) as b,
        gateway(a.url, b.url, policy="session") as g,
    ):
        assert httpx.get(f"{g.url}/health").status_code == 200
        for i in range(6):
            post(g, body(i), headers={"x-session-id": "alice"})
            post(g, {**body(100 + i), "user": "bob"})
        homes = {len(a.bodies), len(b.bodies)}
        assert homes in ({12, 0}, {6}), homes  # each session stayed on one replica
        a.health_status = b.health_status = 503
        deadline = time.monotonic() + 5
        while httpx.get(f"{g.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "the gateway kept routing to down replicas"
            time.sleep(0.05)
        r = post(g, body(0))
        assert r.status_code == 503 and "no healthy backend" in r.json()["error"]["message"]


def test_requests_go_to_the_replicas_serving_their_model():
    """Each replica's /v1/models, read at its health checks, routes a request by the model it
    names (the body's, or KServe's path); a model no replica lists may go to any; the gateway's
    /v1/models is every replica's."""
    with (
        FakeOpenAIServer(lambda b: QUICK, model_names=("llama", "org/chat")) as a,
        FakeOpenAIServer(lambda b: QUICK, model_names=("qwen",)) as b,
        gateway(a.url, b.url) as g,
    ):
        for i in range(3):
            assert post(g, {**body(i), "model": "llama"}).status_code == 200
            assert post(g, {**body(10 + i), "model": "qwen"}).status_code == 200
        assert [x["model"] for x in a.bodies] == ["llama"] * 3
        assert [x["model"] for x in b.bodies] == ["qwen"] * 3
        listed = httpx.get(f"{g.url}/v1/models").json()["data"]
        assert sorted(m["id"] for m in listed) == ["llama", "org/chat", "qwen"]
        assert post(g, {**body(20), "model": "new"}).status_code == 200  # any replica
        assert len(a.bodies) + len(b.bodies) == 7
        b.model_names = ("qwen", "new")  # loaded since: seen at its next check
        deadline = time.monotonic() + 5
        while "new" not in (g.gateway.backends[1].models or ()):
            assert time.monotonic() < deadline, "the gateway never saw b's new model"
            time.sleep(0.05)
        before = len(b.bodies)
        for i in range(2):
            post(g, {**body(30 + i), "model": "new"})
        assert len(b.bodies) == before + 2


def stream_in_flight(g: GatewayThread, replica: FakeOpenAIServer) -> tuple[threading.Thread, dict]:
    """A 20-token stream through the gateway, returned once it reached `replica`; the
    response lands in the dict's "r" when the thread ends."""
    result: dict = {}
    streaming = threading.Thread(target=lambda: result.update(r=post(g, body(0, 20))))
    streaming.start()
    deadline = time.monotonic() + 10
    while not replica.bodies:
        assert time.monotonic() < deadline, "the stream never reached the replica"
        time.sleep(0.01)
    return streaming, result


def test_replicas_found_by_dns_come_and_go():
    """--backend-dns: a name's addresses become backends; an address gone from the DNS is
    drained (its stream ends whole) and removed; one back is added again."""
    slow = Script(ttft_s=0.02, itl_s=0.03)
    with FakeOpenAIServer(lambda b: slow) as a, gateway(backend_dns=(f"localhost:{a.port}",)) as g:
        url = f"http://127.0.0.1:{a.port}"
        assert url in [b.url for b in g.gateway.backends]
        addresses = {"127.0.0.1"}

        async def resolve(host, port):
            assert (host, port) == ("localhost", a.port)
            return set(addresses)

        g.gateway.resolve = resolve
        streaming, result = stream_in_flight(g, a)
        deadline = time.monotonic() + 10
        addresses.clear()  # the pod is gone from the Service

        def urls() -> list[str]:
            return [b.url for b in g.gateway.backends]

        while url in urls():
            assert time.monotonic() < deadline + 10, "never removed"
            time.sleep(0.02)
        streaming.join(10)
        assert len(events(result["r"].text)) == 22  # it ended whole first
        assert post(g, body(1)).status_code == 503  # nothing left to route to
        addresses.add("127.0.0.1")
        while not any(b.url == url and b.is_healthy for b in g.gateway.backends):
            assert time.monotonic() < deadline + 20, "never added back"
            time.sleep(0.02)
        assert post(g, body(2)).status_code == 200


def test_the_model_a_request_names():
    from aiohttp.test_utils import make_mocked_request

    from lantau.gateway.proxy import requested_model

    known = {"org", "org/chat", "qwen"}

    def named(path: str, fields: dict | None = None) -> str | None:
        return requested_model(make_mocked_request("POST", path), fields or {}, known)

    assert named("/v2/models/org/chat/infer") == "org/chat"  # the longest known name
    assert named("/v2/models/org/infer") == "org"
    assert named("/v2/models/qwen/versions/2/infer") == "qwen"
    assert named("/v2/models/other/infer") is None  # unknown: routed by the policy alone
    assert named("/v1/completions", {"model": "qwen"}) == "qwen"
    assert named("/v1/completions", {"model": 3}) is None


def test_admin_adds_and_drains_backends():
    slow = Script(ttft_s=0.05, itl_s=0.05)
    with (
        FakeOpenAIServer(lambda b: slow) as a,
        FakeOpenAIServer(lambda b: QUICK) as b,
        gateway(a.url, admin_key="k") as g,
    ):
        url = f"{g.url}/gateway/backends"
        # a 20-token stream on a (1 s), then b added and a removed: the removal waits for it
        streaming, result = stream_in_flight(g, a)
        assert httpx.post(url, json={"url": b.url}).status_code == 401
        assert httpx.post(url, json={"url": "ftp://x"}, headers=AUTH_K).status_code == 400
        r = httpx.post(url, json={"url": b.url + "/"}, headers=AUTH_K)
        assert r.status_code == 201 and r.json() == {"url": b.url, "healthy": True}
        assert httpx.post(url, json={"url": b.url}, headers=AUTH_K).status_code == 409
        start = time.monotonic()
        r = httpx.request("DELETE", url, json={"url": a.url}, headers=AUTH_K, timeout=30)
        assert r.status_code == 200 and r.json()["in_flight"] == 0
        assert time.monotonic() - start > 0.3
        streaming.join(10)
        assert len(events(result["r"].text)) == 22  # 20 tokens, usage, [DONE]: whole
        assert [x["url"] for x in httpx.get(url).json()["backends"]] == [b.url]
        assert post(g, body(1)).status_code == 200 and len(b.bodies) == 1
    with FakeOpenAIServer(lambda b: QUICK) as a, gateway(a.url) as g:  # no admin key: off
        r = httpx.post(f"{g.url}/gateway/backends", json={"url": a.url})
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


AUTH_K = {"authorization": "Bearer k"}


# --- real processes -------------------------------------------------------------------------


SERVED = "lantau/tiny"  # tests/test_kserve.py's helpers' name


class Replica:
    """`lantau serve random:tiny` on CPU, its steps slowed by the test's delay file."""

    def __init__(self, delay_file) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        cmd = [sys.executable, "-m", "lantau.cli", "serve", "random:tiny", "--device", "cpu",
               "--port", str(self.port), "--grpc-port", str(self.grpc_port),
               "--served-model-name", SERVED, "--max-model-len", "512",
               "--num-kv-blocks", "512"]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LANTAU_TEST_STEP_DELAY_FILE": delay_file}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    def num_running(self) -> int:
        return httpx.get(f"{self.url}/status").json()["num_running"]


@pytest.fixture
def replicas(tmp_path):
    delay = tmp_path / "delay"
    delay.write_text("0.02")  # seconds a step: 40 tokens take ~1 s
    started = [Replica(str(delay)) for _ in range(2)]
    try:
        for r in started:
            wait_ready(r.url, r.proc)
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.communicate(timeout=30)


def start_route(*urls: str, grpc: tuple[str, ...] = (), grpc_port: int = 0):
    port = free_port()
    cmd = [sys.executable, "-m", "lantau.cli", "route", "--port", str(port),
           "--health-interval", "0.2", "--drain-timeout", "20"]  # fmt: skip
    for url in urls:
        cmd += ["--backend", url]
    for address in grpc:
        cmd += ["--grpc-backend", address]
    if grpc:
        cmd += ["--grpc-port", str(grpc_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return proc, base


def test_a_replica_killed_under_load_loses_no_request(replicas):
    """12 buffered completions in flight over two real replicas when one is SIGKILLed: every
    one is answered (those on the dead replica again, on the other), and so is every request
    after; the official client sees nothing but answers."""
    proc, base = start_route(*(r.url for r in replicas))
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)

        def complete(i: int) -> openai.types.Completion:
            return client.completions.create(
                model=SERVED, prompt=f"Request {i}:", max_tokens=40,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        results: dict[int, object] = {}

        def run(i: int) -> None:
            try:
                results[i] = complete(i)
            except Exception as e:  # noqa: BLE001 - the assertion below names it
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        victim, survivor = replicas
        deadline = time.monotonic() + 30
        while victim.num_running() < 2:  # it holds some of them, mid-generation
            assert time.monotonic() < deadline, "requests never reached the first replica"
            time.sleep(0.02)
        victim.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        errors = {i: r for i, r in results.items() if isinstance(r, Exception)}
        assert not errors and len(results) == 12, errors
        assert all(r.usage.completion_tokens == 40 for r in results.values())
        # after the kill: streams and buffered answers alike, on the survivor
        for i in range(4):
            stream = client.completions.create(
                model=SERVED, prompt=f"After {i}:", max_tokens=8, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices)
        m = parse_prometheus(httpx.get(f"{base}/metrics").text)
        assert m[f'lantau:gateway_backend_up{{backend="{victim.url}"}}'] == 0
        assert m[f'lantau:gateway_backend_up{{backend="{survivor.url}"}}'] == 1
        retried = sum(v for k, v in m.items() if k.startswith("lantau:gateway_retries_total"))
        assert retried >= 2
        assert survivor.num_running() == 0
        # the gateway froze its start-up objects: its one full collection, timed, came first
        assert m['lantau:gc_pause_seconds_count{generation="2",process="gateway"}'] >= 1
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_sigterm_drains_the_gateway(replicas):
    """SIGTERM: the stream in flight ends whole, new requests are refused, the gateway exits 0."""
    proc, base = start_route(replicas[0].url)
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", timeout=30,
            json={"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"text"' in first and rest[-1] == "data: [DONE]" and len(rest) >= 40
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_grpc_through_the_gateway_and_a_replica_killed(replicas):
    """tritonclient's gRPC client against the gateway's gRPC port: health, metadata, infer and
    a decoupled stream relayed to the replicas; after one replica is killed, every call still
    answers (the dead one is retried on the other, then marked down)."""
    import tritonclient.grpc as grpcclient

    from tests.test_kserve import collect_stream, make_inputs, text_output

    grpc_port = free_port()
    proc, base = start_route(grpc=tuple(r.grpc_address for r in replicas), grpc_port=grpc_port)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_model_metadata(SERVED).name == SERVED

        def infer(prompt: str) -> str:
            inputs = make_inputs(grpcclient, prompt, max_tokens=8)
            return text_output(client.infer(SERVED, inputs))

        answers = {infer(f"Question {i}:") for i in range(4)}
        assert all(answers)
        by_id = collect_stream(client, [
            dict(inputs=make_inputs(grpcclient, "Stream one:", 8, stream=True), request_id="a"),
            dict(inputs=make_inputs(grpcclient, "Stream two:", 8, stream=False), request_id="b"),
        ])  # fmt: skip
        assert "".join(text_output(r) for r in by_id["a"]) and text_output(by_id["b"][0])
        replicas[0].proc.send_signal(signal.SIGKILL)
        replicas[0].proc.wait(10)
        assert all(infer(f"After {i}:") for i in range(4))
        by_id = collect_stream(client, [
            dict(inputs=make_inputs(grpcclient, "Stream three:", 8, stream=True), request_id="c"),
        ])  # fmt: skip
        assert "".join(text_output(r) for r in by_id["c"])
        listed = httpx.get(f"{base}/gateway/backends").json()["backends"]
        by_url = {b["url"]: b for b in listed}
        assert not by_url[f"grpc://{replicas[0].grpc_address}"]["healthy"]
        assert by_url[f"grpc://{replicas[1].grpc_address}"]["responses"]["OK"] >= 8
        client.close()
    finally:
        proc.kill()
        proc.communicate(timeout=30)


class FakeGrpcReplica:
    """A gRPC server answering every GRPCInferenceService method as raw bytes: ServerReady
    ready; unary calls echoed; ModelStreamInfer echoes each request once the client closed its
    side (so a replay shows), or, `refusing`, UNAVAILABLE before any response."""

    def __init__(self, refusing: bool = False) -> None:
        self.refusing = refusing
        self.streamed: list[bytes] = []

    def __enter__(self) -> FakeGrpcReplica:
        import grpc

        replica = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if details.method.endswith("/ServerReady"):
                    return grpc.unary_unary_rpc_method_handler(lambda r, c: b"\x08\x01")
                if details.method.endswith("/ModelStreamInfer"):
                    return grpc.stream_stream_rpc_method_handler(replica._stream)
                return grpc.unary_unary_rpc_method_handler(lambda r, c: r)

        from concurrent.futures import ThreadPoolExecutor

        self.server = grpc.server(ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((Handler(),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        return self

    def _stream(self, requests, context):
        import grpc

        if self.refusing:
            context.abort(grpc.StatusCode.UNAVAILABLE, "refusing")
        got = list(requests)
        self.streamed += got
        yield from (b"echo:" + r for r in got)

    def __exit__(self, *exc) -> None:
        self.server.stop(0)


def test_grpc_stream_replayed_to_the_next_replica():
    """A stream whose first replica refuses before any response goes to the next one with every
    request it carried so far; unary calls and ServerReady pass as bytes."""
    import grpc

    with (
        FakeGrpcReplica(refusing=True) as dead,
        FakeGrpcReplica() as alive,
        gateway(grpc_backends=(dead.address, alive.address), grpc_port=0,
                policy="round-robin", health_interval_s=60) as g,
    ):  # fmt: skip
        channel = grpc.insecure_channel(f"127.0.0.1:{g.gateway.bound_grpc_port}")
        method = "/inference.GRPCInferenceService/"
        for i in range(2):  # round-robin: one of the two streams starts on the refusing one
            replies = channel.stream_stream(method + "ModelStreamInfer")(iter([b"a", b"b%d" % i]))
            assert list(replies) == [b"echo:a", b"echo:b%d" % i]
        assert alive.streamed == [b"a", b"b0", b"a", b"b1"]
        assert channel.unary_unary(method + "ModelInfer")(b"xyz") == b"xyz"
        listed = httpx.get(f"{g.url}/gateway/backends").json()["backends"]
        by_url = {b["url"]: b for b in listed}
        # UNAVAILABLE as it refused, or INTERNAL where its end raced the gateway's sending
        assert sum(by_url[f"grpc://{dead.address}"]["retries"].values()) >= 1
        assert by_url[f"grpc://{alive.address}"]["responses"]["OK"] >= 2  # both streams
        channel.close()


def test_grpc_replicas_found_by_dns():
    import grpc

    with FakeGrpcReplica() as replica:
        port = int(replica.address.rsplit(":", 1)[1])
        config = dict(grpc_backend_dns=(f"localhost:{port}",), grpc_port=0)
        with gateway(**config) as g:
            found = {b.url: b.is_healthy for b in g.gateway.grpc_backends}
            assert found[f"grpc://127.0.0.1:{port}"]
            channel = grpc.insecure_channel(f"127.0.0.1:{g.gateway.bound_grpc_port}")
            method = "/inference.GRPCInferenceService/ModelInfer"
            assert channel.unary_unary(method)(b"hello") == b"hello"
            channel.close()
