"""`lantau serve --model-repository`: real servers on loopback driven by tritonclient (HTTP and
gRPC), the openai client and `lantau rollback`. The acceptance run: a load generator runs
through a swap, a rollback, an automatic rollback (a corrupt version), a drain-first swap and a
canary that fails its latency check (a slower model), with 0 failed requests, each response
from one version, checked against the server's own counters."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lantau.model.build import build_engine
from lantau.model.manifest import MANIFEST_NAME
from tests.servers import free_port, kserve_greedy_text, wait_ready

CONFIG = """
name: "tiny"
max_batch_size: 32
instance_group [{ count: 2, kind: KIND_GPU, gpus: [0, 1] }]
dynamic_batching { preferred_batch_size: [8, 16, 32], max_queue_delay_microseconds: 100 }
model_transaction_policy { decoupled: True }
parameters { key: "max_model_len" value: { string_value: "256" } }
parameters { key: "num_kv_blocks" value: { string_value: "64" } }
"""


def param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Engine folders built once: tiny seeds 1 and 2, and a model several times slower a
    token (an HF folder 8x wider, with the same tokenizer)."""
    import transformers

    from tests.conftest import save_tiny_hf_model

    root = tmp_path_factory.mktemp("builds")
    for name, src, seed in (("v1", "random:tiny", 1), ("v2", "random:tiny", 2)):
        build_engine(src, root / name, dtype="bf16", seed=seed, device="cpu")
    wide = root / "wide-hf"
    save_tiny_hf_model(wide, transformers.LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    ))  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "v1" / name, wide / name)
    build_engine(str(wide), root / "slow", dtype="bf16", device="cpu")
    return root


class Server:
    def __init__(self, repo, *extra: str, env: dict | None = None) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        cmd = [
            sys.executable, "-m", "lantau.cli", "serve", "--model-repository", str(repo),
            "--device", "cpu", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
            "--drain-timeout", "30", *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(repo).parent / f"server-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_ready(self.base, self.proc, log=self.log)

    def log(self) -> str:
        return self.log_path.read_text()

    def status(self) -> dict:
        return httpx.get(f"{self.base}/status", timeout=10).json()

    def model(self, name: str = "tiny") -> dict:
        return self.status()["models"][name]

    def wait_for(self, check, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.model()
            if check(model):
                return model
            time.sleep(0.1)
        raise AssertionError(f"timed out: {self.model()}\n{self.log()}")

    def metric(self, name: str, **labels) -> float:
        """The sum of a /metrics family's samples matching `labels`."""
        total = 0.0
        for line in httpx.get(f"{self.base}/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in
                                                     labels.items()):  # fmt: skip
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.log()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, built):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "tiny").mkdir()
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)
    shutil.copytree(built / "v1", repo / "tiny" / "1")
    (repo / "badcfg").mkdir()
    (repo / "badcfg" / "config.pbtxt").write_text("max_batch_size: 4\nfoo: 1\n")
    shutil.copytree(built / "v1", repo / "badcfg" / "1")
    half = repo / "unbuilt" / "1"
    half.mkdir(parents=True)
    shutil.copy(next((built / "v1").glob("model-*")), half)  # shards, no manifest yet
    return repo


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    # NOTE: the deliberately slow version: the engine core serving tiny/4 sleeps 0.5 s a step
    delay = tmp_path_factory.mktemp("delay") / "step-delay"
    delay.write_text("tiny/4 0.5\n")
    server = Server(
        repo, "--model-control-mode", "explicit", "--load-model", "tiny",
        env={"LANTAU_TEST_STEP_DELAY_FILE": str(delay)},
    )  # fmt: skip
    yield server
    server.close()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def test_tritonclient_repository_calls(server):
    http = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    index = {(m["name"], m.get("version", "")): m["state"] for m in
             http.get_model_repository_index()}  # fmt: skip
    assert index[("tiny", "1")] == "READY"
    assert index[("badcfg", "")] == "UNAVAILABLE"
    models = grpc.get_model_repository_index(as_json=True)["models"]
    assert {"name": "tiny", "version": "1", "state": "READY"} in models
    assert http.get_model_metadata("tiny")["versions"] == ["1"]
    assert grpc.get_model_metadata("tiny").versions == ["1"]
    # the model's config is its config.pbtxt as read, over lantau's (whose tensors stay)
    config = http.get_model_config("tiny")
    assert config["max_batch_size"] == 32 and config["backend"] == "lantau"
    assert config["dynamic_batching"]["preferred_batch_size"] == [8, 16, 32]
    assert config["instance_group"][0]["count"] == 2
    assert config["parameters"]["num_kv_blocks"]["string_value"] == "64"
    assert config["input"][0]["name"] == "text_input"
    config = grpc.get_model_config("tiny").config
    assert config.max_batch_size == 32 and config.model_transaction_policy.decoupled
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16, 32]
    assert config.parameters["max_model_len"].string_value == "256"
    ready = httpx.post(f"{server.base}/v2/repository/index", json={"ready": True}).json()
    assert [m["name"] for m in ready] == ["tiny"]
    # KServe inference names the version that served it; an unloaded version is NOT_FOUND
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    result = grpc.infer("tiny", [text], model_version="1")
    assert result.get_response().model_version == "1"
    with pytest.raises(InferenceServerException, match="unknown model: 'tiny' version 7"):
        grpc.infer("tiny", [text], model_version="7")
    server.baseline_rss_mb = rss_mb(server.proc.pid)  # the frontend, model loaded


def test_bad_input_is_named_and_the_served_version_stays(server):
    http = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
    cases = [
        ("../etc", "holds a path separator"),
        ("a..b", "holds '..'"),
        ("nope", "no model 'nope' in the repository"),
        ("badcfg", "config.pbtxt: line 2: "),
        ("unbuilt", "no complete version to serve (version folders without a manifest: [1])"),
    ]
    for name, message in cases:
        with pytest.raises(InferenceServerException, match=re.escape(message)):
            http.load_model(name)
    with pytest.raises(InferenceServerException, match="has no field named"):
        http.load_model("badcfg")
    assert server.model()["primary"] == 1 and http.is_model_ready("tiny")


class LoadGenerator:
    """Workers sending streamed and whole completions until stopped; each response's
    versions (system_fingerprint of every chunk) and any failure are kept."""

    def __init__(self, base: str, num_workers: int = 2) -> None:
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        self.stop = threading.Event()
        self.responses: list[set[str]] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._work, args=(i,)) for i in
                        range(num_workers)]  # fmt: skip

    def _work(self, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                if (worker + i) % 2:
                    chunks = self.client.completions.create(
                        model="tiny", prompt=f"Hello {i}", max_tokens=8, stream=True
                    )
                    versions = {c.system_fingerprint for c in chunks}
                else:
                    reply = self.client.completions.create(
                        model="tiny", prompt=f"Hello {i}", max_tokens=8
                    )
                    versions = {reply.system_fingerprint}
                self.responses.append(versions)
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.failures.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> LoadGenerator:
        for t in self.threads:
            t.start()
        return self

    def wait_for_responses(self, num: int, timeout: float = 60.0) -> None:
        target = len(self.responses) + num
        deadline = time.monotonic() + timeout
        while len(self.responses) < target and time.monotonic() < deadline:
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def load_in_thread(server: Server) -> threading.Thread:
    """A load on another thread (tritonclient's HTTP client is gevent's: one thread only)."""
    url = f"{server.base}/v2/repository/models/tiny/load"
    thread = threading.Thread(target=lambda: httpx.post(url, timeout=120).raise_for_status())
    thread.start()
    return thread


def test_acceptance_swap_rollback_auto_rollback_under_load(server, repo, built):
    tiny = repo / "tiny"
    http = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
    aborted_before = server.metric("lantau:request_success_total", finished_reason="abort")
    pids = dict(server.model()["engine_pids"])
    with LoadGenerator(server.base) as load:
        load.wait_for_responses(5)
        # 1. a swap: version 2 starts beside 1, traffic moves, 1 drains and stops; a second
        # load meanwhile is refused (409), naming what is in progress
        shutil.copytree(built / "v2", tiny / "2")
        loading = load_in_thread(server)
        server.wait_for(lambda m: m["busy"] is not None)
        with pytest.raises(InferenceServerException, match="already swapping"):
            http.load_model("tiny")
        loading.join()
        model = server.model()
        assert model["primary"] == 2 and model["versions"] == ["2"]
        pids.update(model["engine_pids"])
        load.wait_for_responses(5)
        # 2. a rollback with the CLI, drain-first (as when memory holds one version only):
        # new requests wait while 2 drains, none fails
        (tiny / "config.pbtxt").write_text(CONFIG + param("swap", "drain_first"))
        done = subprocess.run(
            [sys.executable, "-m", "lantau.cli", "rollback", "tiny", "--url", server.base],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "tiny now serves version 1" in done.stdout
        pids.update(server.model()["engine_pids"])
        load.wait_for_responses(5)
        # 3. an automatic rollback: version 3 is corrupt (one byte flipped)
        (tiny / "config.pbtxt").write_text(CONFIG)
        shutil.copytree(built / "v2", tiny / "3")
        shard = next((tiny / "3").glob("model-*"))
        data = bytearray(shard.read_bytes())
        data[-7] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(InferenceServerException, match="version 3 failed to load.*checksum"):
            http.load_model("tiny")
        assert server.model()["primary"] == 1
        load.wait_for_responses(5)
        # 4. a canary phase that fails its latency check: version 4 is slow (see `server`)
        shutil.rmtree(tiny / "3")
        shutil.copytree(built / "v2", tiny / "4")
        (tiny / "config.pbtxt").write_text(
            CONFIG + param("canary_share", "0.5") + param("canary_requests", "3")
        )
        http.load_model("tiny")
        pids.update(server.model()["engine_pids"])
        model = server.wait_for(lambda m: 4 in m["rejected"])
        assert model["primary"] == 1 and model["versions"] == ["1"] and "P95" in model["reason"]
        load.wait_for_responses(5)
    assert load.failures == []
    assert all(len(versions) == 1 for versions in load.responses)  # one version a response
    served = set().union(*load.responses)
    assert {"tiny:1", "tiny:2", "tiny:4"} <= served
    # the server's own counters: no request aborted, refused as unavailable, or failed
    assert server.metric("lantau:request_success_total", finished_reason="abort") == aborted_before
    assert server.metric("lantau:request_rejected_total", reason="unavailable") == 0
    assert server.metric("lantau:request_status_total", protocol="http", code="500") == 0
    for kind in ("swap", "rollback", "auto_rollback", "canary"):
        assert server.metric("lantau:model_transitions_total", model_name="tiny", kind=kind) >= 1
    # every stopped version's engine core is gone; one process serves
    live = server.model()["engine_pids"]
    assert list(live) == ["1"]
    stopped = [psutil.Process(p) for p in pids.values() if p != live["1"] and psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(stopped, timeout=15)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def test_poll_mode_ignores_a_half_written_version(tmp_path, built):
    repo = tmp_path / "repo"
    shutil.copytree(built / "v1", repo / "tiny" / "1")
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)
    server = Server(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    try:
        assert server.model()["primary"] == 1
        with pytest.raises(InferenceServerException, match="not allowed in model control mode"):
            httpclient.InferenceServerClient(server.base.removeprefix("http://")).load_model("tiny")
        half = repo / "tiny" / "2"
        shutil.copytree(built / "v2", half, ignore=shutil.ignore_patterns(MANIFEST_NAME))
        time.sleep(1.0)  # NOTE: five polls; nothing to wait on: the point is that none acts
        assert server.model()["versions"] == ["1"]
        shutil.copy(built / "v2" / MANIFEST_NAME, half / MANIFEST_NAME)  # the build finishes
        assert server.wait_for(lambda m: m["primary"] == 2)["versions"] == ["2"]
    finally:
        log = server.close()
    assert "swap 1 -> 2" in log


def test_unload_returns_memory(server):
    """Last on this server: after an unload (gRPC) no engine core process is left, the
    frontend's RSS is within 64 MiB of what it was with the model loaded before any request
    (the versions swapped in and out above left nothing behind), and the model is gone."""
    grpcclient.InferenceServerClient(server.grpc_url).unload_model("tiny")
    frontend = server.proc.pid
    children = [p for p in psutil.Process(frontend).children(recursive=True)
                if "resource_tracker" not in " ".join(p.cmdline())]  # fmt: skip
    assert children == []
    assert rss_mb(frontend) < server.baseline_rss_mb + 64, (
        server.baseline_rss_mb,
        rss_mb(frontend),
    )
    assert server.model()["versions"] == []
    assert httpx.post(f"{server.base}/v1/completions",
                      json={"model": "tiny", "prompt": "Hi"}).status_code == 404  # fmt: skip


def scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    """/metrics through prometheus_client's own parser: {(sample, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(m: dict, name: str, **labels: str) -> float | None:
    return m.get((name, frozenset(labels.items())))


def scrape_until(server: Server, check, timeout: float = 15.0) -> dict:
    """A scrape once `check` holds (an answer is counted just after it is sent)."""
    deadline = time.monotonic() + timeout
    while not check(m := scrape(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert check(m), sorted(k for k in m if "request_status" in k[0])
    return m


def models_of(m: dict, name: str) -> set[tuple[str, str]]:
    """The (model, version) pairs of a family's samples."""
    return {(dict(k[1])["model_name"], dict(k[1])["model_version"]) for k in m if k[0] == name}


def test_metrics_per_model_and_version(tmp_path, built):
    """Two models: every engine and request series carries model_name and model_version, and
    counts per model equal the requests sent to it (warm-up canaries not counted). Unloaded,
    or swapped away, a version's series go; the other versions' keep counting."""
    from tests.test_hardening import grpc_inputs

    repo = tmp_path / "repo"
    for name in ("a", "b"):
        shutil.copytree(built / "v1", repo / name / "1")
        (repo / name / "config.pbtxt").write_text(
            param("max_model_len", "256") + param("num_kv_blocks", "64")
        )
    delay = tmp_path / "step-delay"
    delay.write_text("b/1 0.1\n")  # b's version 1 slow: a request outlasts the swap below
    server = Server(
        repo, "--model-control-mode", "explicit", "--load-model", "a", "--load-model", "b",
        env={"LANTAU_TEST_STEP_DELAY_FILE": str(delay)},
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        for _ in range(3):
            client.completions.create(model="a", prompt="Hello", max_tokens=4)
        client.completions.create(model="b", prompt="Hello", max_tokens=2)
        grpcclient.InferenceServerClient(server.grpc_url).infer("b", grpc_inputs(max_tokens=2))
        a1 = {"model_name": "a", "model_version": "1"}
        b1 = {"model_name": "b", "model_version": "1"}
        ok = {"protocol": "grpc", "code": "OK"}
        m = scrape_until(server, lambda m: sample(m, "lantau:request_status_total", **b1, **ok))
        for labels, num, num_tokens in ((a1, 3, 12), (b1, 2, 4)):
            assert sample(m, "lantau:request_success_total", **labels,
                          finished_reason="length") == num  # fmt: skip
            assert sample(m, "lantau:e2e_request_latency_seconds_count", **labels) == num
            assert sample(m, "lantau:generation_tokens_total", **labels) == num_tokens
            assert sample(m, "lantau:num_requests_running", **labels) == 0
            assert sample(m, "lantau:cache_config_info", **labels, block_size="16",
                          num_gpu_blocks="64") == 1  # fmt: skip
        assert sample(m, "lantau:request_status_total", **a1, protocol="http", code="200") == 3
        assert sample(m, "lantau:request_status_total", **b1, protocol="http", code="200") == 1
        assert sample(m, "lantau:request_status_total", **b1, **ok) == 1
        engine_families = {k[0] for k in m if "model_version" in dict(k[1])}
        repository_families = ("lantau:model_transitions_total", "lantau:model_version_serving")
        assert {k[0] for k in m if k[0].startswith("lantau:")} - engine_families == set(
            repository_families
        )  # no engine or request series without the two labels
        for family in engine_families:  # besides the server's own (no model: labels empty)
            assert models_of(m, family) - {("", "")} == {("a", "1"), ("b", "1")}, family
        # Triton's statistics: each model's version, its requests as /metrics counts them
        stats = httpclient.InferenceServerClient(
            server.base.removeprefix("http://")
        ).get_inference_statistics()
        got = {(s["name"], s["version"]): s for s in stats["model_stats"]}
        assert set(got) == {("a", "1"), ("b", "1")}
        assert [got[k]["inference_stats"]["success"]["count"] for k in sorted(got)] == [3, 2]
        b_only = grpcclient.InferenceServerClient(server.grpc_url).get_inference_statistics(
            "b", as_json=True
        )
        assert [(s["name"], s["version"]) for s in b_only["model_stats"]] == [("b", "1")]

        # a unloaded: its series are gone; b's keep their counts; a request for a now counts
        # on the server's own figures (no model took it)
        httpx.post(f"{server.base}/v2/repository/models/a/unload", timeout=60).raise_for_status()
        gone = httpx.post(f"{server.base}/v1/completions", json={"model": "a", "prompt": "Hi"})
        assert gone.status_code == 404
        no_model = {"model_name": "", "model_version": "", "protocol": "http", "code": "404"}
        m = scrape_until(server, lambda m: sample(m, "lantau:request_status_total", **no_model))
        assert all(("a", "1") not in models_of(m, f) for f in engine_families)
        assert sample(m, "lantau:request_success_total", **b1, finished_reason="length") == 2
        assert sample(m, "lantau:model_transitions_total", model_name="a", kind="unload",
                      from_version="1", to_version="") == 1  # fmt: skip

        # b swapped to version 2 while a request streams on version 1: version 1 reports
        # while it drains, its series go once it stops; version 2's count from 0
        shutil.copytree(built / "v2", repo / "b" / "2")
        stream = iter(client.completions.create(
            model="b", prompt="Hi", max_tokens=100, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        next(stream)
        url, answers = f"{server.base}/v2/repository/models/b/load", []
        loading = threading.Thread(target=lambda: answers.append(httpx.post(url, timeout=120)))
        loading.start()
        b2 = {"model_name": "b", "model_version": "2"}
        serving = {"model_name": "b", "version": "2", "role": "primary"}
        m = scrape_until(server, lambda m: sample(m, "lantau:model_version_serving", **serving))
        assert sample(m, "lantau:num_requests_running", **b1) == 1  # draining, still there
        assert sample(m, "lantau:num_requests_running", **b2) == 0
        # all 100 tokens came on version 1 (counted by usage, not chunks: a sampled token
        # whose text is held back, part of a character, sends no chunk of its own)
        rest = list(stream)
        assert rest[-1].usage.completion_tokens == 100 and rest[-1].model == "b"
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert {c.system_fingerprint for c in rest if c.choices} == {"b:1"}
        loading.join()
        assert answers[0].status_code == 200, answers[0].text
        client.completions.create(model="b", prompt="Hello", max_tokens=3)
        http_ok = {"protocol": "http", "code": "200"}
        m = scrape_until(
            server, lambda m: sample(m, "lantau:request_status_total", **b2, **http_ok)
        )
        assert models_of(m, "lantau:num_requests_running") == {("b", "2")}
        assert models_of(m, "lantau:request_success_total") == {("b", "2")}
        assert sample(m, "lantau:request_success_total", **b2, finished_reason="length") == 1
        assert sample(m, "lantau:generation_tokens_total", **b2) == 3
        assert sample(m, "lantau:model_version_serving", model_name="b", version="2",
                      role="primary") == 1  # fmt: skip
    finally:
        server.close()


def test_standby_core_taken_by_the_first_version_or_stopped(tmp_path, built):
    """`lantau serve --model-repository` spawns an engine core before its web stack imports
    (cli.serve): the first version started takes it, told its config then; a start that loads
    nothing (a bad config) stops it, its socket folder gone."""
    import asyncio

    from lantau.engine.async_llm import spawn_core
    from lantau.request import SamplingParams
    from lantau.server.app import ServerConfig
    from lantau.server.model_control import ModelManager
    from lantau.server.repository import RepositoryOptions

    repo = tmp_path / "repo"
    shutil.copytree(built / "v1", repo / "tiny" / "1")
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)
    shutil.copytree(built / "v1", repo / "badcfg" / "1")
    (repo / "badcfg" / "config.pbtxt").write_text("max_batch_size: 4\nfoo: 1\n")

    async def start(name: str):
        standby = spawn_core(None, None)
        options = RepositoryOptions(repo, "explicit", (name,))
        manager = ModelManager(options, {"device": "cpu"}, ServerConfig(), None, standby)
        await manager.start()
        return standby, manager

    async def serve_one():
        standby, manager = await start("tiny")
        try:
            engine = manager.models["tiny"].engine
            assert engine.process is standby.process and manager.standby is None
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            outs = [o async for o in engine.generate("r", {"prompt_token_ids": [1, 2, 3]}, params)]
            return len(outs[-1].outputs[0].token_ids)
        finally:
            await manager.shutdown()

    assert asyncio.run(serve_one()) == 5

    async def load_nothing():
        standby, manager = await start("badcfg")
        await manager.shutdown()
        return standby, manager

    standby, manager = asyncio.run(load_nothing())
    assert manager.names() == [] and manager.standby is None
    assert not standby.process.is_alive() and not os.path.exists(standby.ipc_dir)


def test_a_models_lora_adapters_from_its_config(tmp_path, built):
    """config.pbtxt's `lora_modules` (a path relative to the model's folder and an absolute
    one) and `max_loras`: the model's versions serve each adapter under its own name
    (/v1/models lists it with the model as parent); a completion and a KServe generate
    naming an adapter run on the model's version with it (the offline engine's tokens with
    the adapter); a swap to a new version keeps serving them; a model whose adapter would
    take a served adapter's name, or a model's, is refused, naming it, and what is served
    stays; a missing adapter folder is a config error naming the parameter."""
    import transformers

    from lantau import LLM, SamplingParams
    from tests.conftest import TINY_LLAMA, save_tiny_hf_model
    from tests.test_lora import ALL, save_adapter

    hf = tmp_path / "hf"
    save_tiny_hf_model(hf, transformers.LlamaConfig(**TINY_LLAMA))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(built / "v1" / name, hf / name)
    repo = tmp_path / "repo"
    build_engine(str(hf), repo / "tiny" / "1", dtype="fp32", device="cpu")
    loras = repo / "tiny" / "loras"
    save_adapter(hf, loras / "brand_a", 1, r=4, lora_alpha=8, target_modules=ALL)
    save_adapter(hf, tmp_path / "brand_b", 2, r=8, lora_alpha=4,
                 target_modules=["q_proj", "v_proj"])  # fmt: skip
    adapters = f"brand_a=loras/brand_a,brand_b={tmp_path / 'brand_b'}"
    config = param("max_model_len", "256") + param("num_kv_blocks", "64")
    (repo / "tiny" / "config.pbtxt").write_text(
        config + param("lora_modules", adapters) + param("max_loras", "2")
    )
    for name, spec in (("other", "brand_a=/x"), ("clash", "tiny=/x"), ("nofolder", "c=nope")):
        shutil.copytree(built / "v1", repo / name / "1")
        adapter = tmp_path / "brand_b" if spec != "c=nope" else "nope"
        spec = spec.split("=")[0] + f"={adapter}"
        (repo / name / "config.pbtxt").write_text(config + param("lora_modules", spec))
    prompt = [5, 17, 300, 41, 9, 120, 7]
    offline = LLM(str(repo / "tiny" / "1"), device="cpu", num_kv_blocks=64,
                  lora_modules=[f"brand_a={loras / 'brand_a'}",
                                f"brand_b={tmp_path / 'brand_b'}"])  # fmt: skip

    def expected(lora, ids=prompt) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=lora)
        return offline.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text

    assert len({expected(None), expected("brand_a"), expected("brand_b")}) == 3
    server = Server(repo, "--model-control-mode", "explicit", "--load-model", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert listed == {"tiny": None, "brand_a": "tiny", "brand_b": "tiny"}

        def served(model: str) -> str:
            reply = client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert reply.model == model
            return reply.choices[0].text

        for model, lora in (("brand_a", "brand_a"), ("tiny", None), ("brand_b", "brand_b")):
            assert served(model) == expected(lora), model
        text = "5,17,300"  # ids the tiny model knows (< 512)
        ids = offline.engine.tokenizer.encode(text, add_special_tokens=False)
        assert kserve_greedy_text(server.base, "brand_b", text, 6) == expected("brand_b", ids)
        # version 2 swaps in: the adapters go on being served, now by it
        shutil.copytree(repo / "tiny" / "1", repo / "tiny" / "2")
        http = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
        http.load_model("tiny")
        assert server.model()["primary"] == 2
        assert served("brand_a") == expected("brand_a")
        for name, message in (
            ("other", "lora module 'brand_a' is served by model 'tiny' already"),
            ("clash", "lora module 'tiny' is a model's name"),
            ("nofolder", "parameters['lora_modules']"),
        ):
            with pytest.raises(InferenceServerException, match=re.escape(message)):
                http.load_model(name)
        assert served("brand_a") == expected("brand_a")  # what was served stays
    finally:
        server.close()
