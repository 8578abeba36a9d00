"""/metrics after known traffic, counted exactly; x-request-id in and out; the request log;
metrics switched off. Real `lantau serve` processes on loopback."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

import tests.test_hardening as hardening
from lantau.bench.monitor import parse_prometheus
from lantau.engine.protocol import StepStats
from tests.test_hardening import wait_idle

make_server = hardening.make_server  # the fixture: real servers, closed after each test

LABEL = '{model_name="random:tiny"}'


def scrape(server) -> dict[str, float]:
    response = httpx.get(f"{server.base}/metrics")  # no API key: /metrics stays open
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse_prometheus(response.text)


def series(name: str, **labels: str) -> str:
    pairs = {"model_name": "random:tiny", **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def complete(server, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return httpx.post(
        f"{server.base}/v1/completions", json=body, headers={"x-api-key": "secret"}, timeout=60
    )


def test_metrics_count_known_traffic_exactly(make_server):
    server = make_server("--max-pending-requests", "1", "--api-key", "secret", "--log-requests")
    before = scrape(server)
    assert before[series("lantau:request_success_total", finished_reason="length")] == 0
    assert (
        'lantau:cache_config_info{block_size="16",model_name="random:tiny",num_gpu_blocks="512"}'
        in before
    )

    # a long streamed request; while it runs, a second one is refused (429)
    first_chunk = threading.Event()
    streamed: list[str] = []

    def stream() -> None:
        body = {"prompt": list(range(10, 30)), "max_tokens": 60, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream(
            "POST", f"{server.base}/v1/completions", json=body, headers={"x-api-key": "secret"}
        ) as r:
            for line in r.iter_lines():
                if line:
                    streamed.append(line)
                    first_chunk.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(60)
    refused = complete(server, [5, 6, 7], 3)
    thread.join(60)
    assert refused.status_code == 429, refused.text
    assert streamed[-1] == "data: [DONE]"
    short = complete(server, [5, 6, 7, 8, 9], 3)
    assert short.status_code == 200
    medium = complete(server, list(range(40, 47)), 4)
    assert medium.status_code == 200
    bad = complete(server, [1, 2], -1)
    assert bad.status_code == 400
    wait_idle(server)

    m = scrape(server)
    prompts, outputs = [20, 5, 7], [60, 3, 4]
    assert m[series("lantau:request_success_total", finished_reason="length")] == 3
    assert m[series("lantau:request_success_total", finished_reason="abort")] == 0
    for code, count in (("200", 3), ("429", 1), ("400", 1)):
        assert m[series("lantau:request_status_total", code=code, protocol="http")] == count
    assert m[series("lantau:request_rejected_total", reason="overloaded")] == 1
    assert m[series("lantau:request_rejected_total", reason="unavailable")] == 0
    assert m["lantau:prompt_tokens_total" + LABEL] == sum(prompts)
    assert m["lantau:generation_tokens_total" + LABEL] == sum(outputs)
    assert m["lantau:request_prompt_tokens_sum" + LABEL] == sum(prompts)
    assert m["lantau:request_generation_tokens_sum" + LABEL] == sum(outputs)
    for name in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_dispatch_time_seconds",
        "request_decode_time_seconds", "time_per_output_token_seconds",
        "request_prompt_tokens", "request_generation_tokens",
    ):  # fmt: skip
        assert m[f"lantau:{name}_count" + LABEL] == 3, name
    # one output a step a request: the gaps between a request's tokens
    assert m["lantau:inter_token_latency_seconds_count" + LABEL] == sum(n - 1 for n in outputs)
    assert m["lantau:engine_generated_tokens_total" + LABEL] == sum(outputs)
    assert m["lantau:prefix_cache_queries_total" + LABEL] == sum(prompts)
    assert m["lantau:num_requests_running" + LABEL] == 0
    assert m["lantau:num_requests_waiting" + LABEL] == 0
    assert m["lantau:kv_cache_usage_perc" + LABEL] == 0
    assert m["lantau:engine_steps_total" + LABEL] >= 60
    # e2e covers queue + prefill + decode of the same requests
    e2e = m["lantau:e2e_request_latency_seconds_sum" + LABEL]
    parts = sum(
        m[f"lantau:request_{p}_time_seconds_sum" + LABEL] for p in ("queue", "prefill", "decode")
    )
    assert abs(e2e - parts) < 0.05 * e2e + 0.01
    dispatch = m["lantau:request_dispatch_time_seconds_sum" + LABEL]
    assert 0 < dispatch <= m["lantau:request_queue_time_seconds_sum" + LABEL]
    # the HTTP layer: before the engine for the three that reached it; the first token to its
    # bytes sent for the one streamed
    assert m["lantau:request_http_in_time_seconds_count" + LABEL] == 3
    assert 0 < m["lantau:request_http_in_time_seconds_sum" + LABEL] < e2e
    assert m["lantau:request_http_first_chunk_time_seconds_count" + LABEL] == 1
    assert 0 < m["lantau:request_http_first_chunk_time_seconds_sum" + LABEL] < e2e

    # garbage collections timed in both processes, the first the full one of the start-up
    # heap before its freeze: the core's under the model's labels, the frontend's under none
    for process, model in (("core", "random:tiny"), ("frontend", "")):
        key = dict(model_name=model, process=process, generation="2")
        assert m[series("lantau:gc_pause_seconds_count", **key)] >= 1, process
        assert m[series("lantau:gc_pause_seconds_sum", **key)] > 0, process

    # the request log: one JSON line per inference request, the refusals too
    lines = [json.loads(x) for x in server.close().splitlines() if x.startswith('{"time"')]
    assert sorted(x["status"] for x in lines) == ["200", "200", "200", "400", "429"]
    done = [x for x in lines if x["status"] == "200"]
    assert sorted(x["num_output_tokens"] for x in done) == sorted(outputs)
    assert all(x["finish_reason"] == "length" and x["e2e_s"] >= x["ttft_s"] for x in done)
    assert all(0 < x["dispatch_s"] <= x["queue_s"] for x in done)


def test_prefix_hits_are_counted(make_server):
    server = make_server()
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16
    usages = [complete(server, prompt, 2).json()["usage"] for _ in range(2)]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0 and cached == 32
    wait_idle(server)
    m = scrape(server)
    assert m["lantau:prompt_tokens_cached_total" + LABEL] == cached
    assert m["lantau:prefix_cache_hits_total" + LABEL] == cached
    assert m["lantau:prefix_cache_queries_total" + LABEL] == 80
    assert m["lantau:prefix_cache_hit_rate" + LABEL] == pytest.approx(cached / 80)


def test_request_ids_in_and_out(make_server):
    server = make_server("--api-key", "secret")
    r = complete(server, [3, 4, 5], 2)
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and r.json()["id"].endswith(generated)
    given = "trace-42.a:b"
    r = httpx.post(
        f"{server.base}/v1/completions",
        json={"prompt": [3, 4, 5], "max_tokens": 2},
        headers={"x-api-key": "secret", "x-request-id": given},
    )
    assert r.headers["x-request-id"] == given and r.json()["id"].endswith(f"-{given}")
    # a refusal (no key) and a KServe route carry one too; a strange id is replaced
    r = httpx.post(f"{server.base}/v1/completions", json={}, headers={"x-request-id": "a b"})
    assert r.status_code == 401 and len(r.headers["x-request-id"]) == 32
    r = httpx.post(
        f"{server.base}/v2/models/{server.status()['model']}/generate",
        json={"text_input": "Hi", "max_tokens": 2},
        headers={"x-api-key": "secret", "x-request-id": given},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == given
    assert "x-request-id" not in httpx.get(f"{server.base}/health").headers  # probes: untouched


def test_metrics_can_be_disabled(make_server):
    server = make_server("--disable-metrics")
    assert httpx.get(f"{server.base}/metrics").status_code == 404
    r = complete(server, [3, 4, 5], 2)
    assert r.status_code == 200 and r.headers["x-request-id"]


def test_grpc_calls_are_counted_and_logged(make_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from tests.test_hardening import grpc_inputs

    server = make_server("--log-requests", grpc=True)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    model = server.status()["model"]
    client.infer(model, grpc_inputs(max_tokens=3), headers={"x-request-id": "grpc-7"})
    with pytest.raises(InferenceServerException):
        client.infer(model, grpc_inputs(max_tokens=-1))
    wait_idle(server)
    m = scrape(server)
    assert m[series("lantau:request_status_total", code="OK", protocol="grpc")] == 1
    assert m[series("lantau:request_status_total", code="INVALID_ARGUMENT", protocol="grpc")] == 1
    assert m["lantau:generation_tokens_total" + LABEL] == 3
    lines = [json.loads(x) for x in server.close().splitlines() if x.startswith('{"time"')]
    ok = [x for x in lines if x["status"] == "OK"]
    assert len(lines) == 2 and ok[0]["request_id"] == "grpc-7"
    assert ok[0]["engine_request_id"].endswith("-grpc-7") and ok[0]["num_output_tokens"] == 3


def test_triton_statistics_count_known_traffic(make_server):
    """Triton's statistics extension through tritonclient, HTTP and gRPC: requests that
    ended and failed, their stages' times, the engine's steps, as /metrics counts them."""
    import time

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = make_server(grpc=True)
    model = server.status()["model"]
    for n in (3, 4, 5):
        assert complete(server, list(range(5, 5 + n)), n).status_code == 200
    late = complete(server, list(range(10, 20)), 500, timeout=0.05)  # aborted at its deadline
    assert late.status_code == 504, late.text
    wait_idle(server)
    m = scrape(server)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert "statistics" in http.get_server_metadata()["extensions"]
    answers = [
        http.get_inference_statistics(model),
        http.get_inference_statistics(),  # every model
        http.get_inference_statistics(model, "1"),
        grpc.get_inference_statistics(model, as_json=True),  # uint64s as strings
    ]
    for answer in answers:
        (entry,) = answer["model_stats"]
        s = {k: {f: int(v) for f, v in d.items()} for k, d in entry["inference_stats"].items()}
        assert (entry["name"], entry["version"]) == (model, "1")
        assert int(entry["inference_count"]) == 4
        assert s["success"]["count"] == 3 and s["fail"]["count"] == 1
        e2e = m["lantau:e2e_request_latency_seconds_sum" + LABEL]
        assert abs(s["success"]["ns"] + s["fail"]["ns"] - e2e * 1e9) < 1e6  # within a ms
        assert s["queue"]["count"] == m["lantau:request_queue_time_seconds_count" + LABEL]
        assert s["compute_input"]["count"] == s["queue"]["count"]
        assert 0 < s["compute_input"]["ns"] <= s["queue"]["ns"]
        assert 0 < s["compute_infer"]["ns"] < s["success"]["ns"] + s["fail"]["ns"]
        assert int(entry["execution_count"]) == m["lantau:engine_steps_total" + LABEL]
        assert abs(int(entry["last_inference"]) / 1000 - time.time()) < 60
    for call in (
        lambda: http.get_inference_statistics("no-such-model"),
        lambda: http.get_inference_statistics(model, "2"),
        lambda: grpc.get_inference_statistics("no-such-model"),
    ):
        with pytest.raises(InferenceServerException, match="unknown model"):
            call()


def test_triton_statistics_are_off_with_metrics(make_server):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = make_server("--disable-metrics")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    with pytest.raises(InferenceServerException, match="--disable-metrics"):
        http.get_inference_statistics()


# -- the parts alone ---------------------------------------------------------------------


class FakeNvml:
    """pynvml's functions the reader calls, for two devices; the second has no power sensor."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    class NotSupported(Exception):
        pass

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("Util", (), {"gpu": 40 + h, "memory": 1})()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"used": (h + 1) << 30, "total": 80 << 30, "free": 0})()

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NotSupported
        return 350_500  # milliwatts

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"


def test_gpu_metrics_from_nvml():
    from lantau.metrics.gpu import GpuReader
    from lantau.metrics.prometheus import MetricsExporter
    from lantau.metrics.stats import EngineFigures, EngineMetrics

    figures = [EngineFigures(EngineMetrics("m", 64), StepStats())]
    exporter = MetricsExporter(lambda: figures, ["model_name"], GpuReader(FakeNvml(), [0, 1]))
    m = parse_prometheus(exporter.render().decode())
    assert m['lantau:gpu_utilization_perc{gpu="0",uuid="GPU-0"}'] == 40
    assert m['lantau:gpu_utilization_perc{gpu="1",uuid="GPU-1"}'] == 41
    assert m['lantau:gpu_memory_used_bytes{gpu="1",uuid="GPU-1"}'] == 2 << 30
    assert m['lantau:gpu_memory_total_bytes{gpu="0",uuid="GPU-0"}'] == 80 << 30
    assert m['lantau:gpu_power_watts{gpu="0",uuid="GPU-0"}'] == 350.5
    assert 'lantau:gpu_power_watts{gpu="1",uuid="GPU-1"}' not in m  # not supported: absent
    assert m['lantau:gpu_temperature_celsius{gpu="0",uuid="GPU-0"}'] == 61
    assert m['lantau:gpu_sm_clock_hertz{gpu="0",uuid="GPU-0"}'] == 1980e6


def test_no_gpu_means_no_gpu_metrics_and_one_log_line(caplog):
    from lantau.metrics.gpu import GpuReader

    with caplog.at_level("INFO", logger="lantau.metrics.gpu"):
        reader = GpuReader.start()
    if reader is not None:
        pytest.skip("this machine has a GPU")
    assert len(caplog.records) == 1 and "GPU metrics off" in caplog.records[0].message


def test_histogram_buckets():
    from lantau.metrics.prometheus import histogram_family
    from lantau.metrics.stats import Histogram, length_buckets, parse_buckets

    hist = Histogram((0.1, 0.8))
    for value in (0.05, 0.1, 0.5, 0.8, 0.81, 3.0):
        hist.observe(value)
    family = histogram_family("lantau:x", "doc", ["model_name"], [(["m"], hist)])
    buckets = {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 2, "0.8": 4, "+Inf": 6}  # le: a value on a bound counts in it
    assert length_buckets(600) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert parse_buckets(["e2e=0.8,0.1,0.35"]) == {"e2e": (0.1, 0.35, 0.8)}
    for bad in ("e2e", "nope=1", "ttft=0,1", "ttft=x"):
        with pytest.raises(ValueError):
            parse_buckets([bad])
