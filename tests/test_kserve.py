"""The KServe v2 / Triton API on loopback, driven by the official tritonclient (HTTP and gRPC)
and httpx: outputs equal the offline engine's greedy text, streams concatenate to it, errors
carry the right status, and disconnects abort requests so no KV block is left behind.

The servers are assembled here (AsyncLLM + the KServe router under uvicorn + the gRPC server,
in one background event loop), so these tests depend on nothing but the KServe modules.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time

import grpc
import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lantau import LLM, SamplingParams

MODEL = "random:tiny"
MODEL_NAME = "lantau/tiny"  # a slash, as HF-style names have: routes must take it
ENGINE_ARGS = dict(device="cpu", max_model_len=512, num_kv_blocks=128)
PROMPTS = ["Hello, my name is", "The capital of France is"]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread(threading.Thread):
    """An asyncio loop holding the engine, uvicorn with the KServe router, and gRPC."""

    def __init__(self) -> None:
        super().__init__(name="kserve-test-server", daemon=True)
        self.http_port, self.grpc_port = free_port(), free_port()
        self.is_started = threading.Event()
        self.error: BaseException | None = None
        self.engine = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import uvicorn
        from fastapi import FastAPI

        from lantau.engine.async_llm import AsyncLLM
        from lantau.llm import build_engine_config
        from lantau.model.loader import load_tokenizer
        from lantau.server.kserve_grpc import start_grpc_server
        from lantau.server.kserve_http import make_kserve_router

        self.loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        config, source = build_engine_config(MODEL, **ENGINE_ARGS)
        self.engine = engine = AsyncLLM(config, source, load_tokenizer(source))
        http_server = grpc_server = serve_task = None
        try:
            await engine.start()
            is_ready = lambda: engine.is_ready(5.0)
            app = FastAPI()
            app.include_router(make_kserve_router(engine, MODEL_NAME, is_ready))
            http_server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=self.http_port, log_level="warning")
            )
            serve_task = asyncio.create_task(http_server.serve())
            grpc_server = await start_grpc_server(
                engine, MODEL_NAME, "127.0.0.1", self.grpc_port, is_ready
            )
            while not http_server.started:
                if serve_task.done():  # it failed to bind
                    serve_task.result()
                await asyncio.sleep(0.02)
            self.is_started.set()
            await self.stop_event.wait()
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.is_started.set()
            if http_server is not None:
                http_server.should_exit = True
                await serve_task
            if grpc_server is not None:
                await grpc_server.stop(0)
            await engine.shutdown()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.join(timeout=30)


@pytest.fixture(scope="module")
def server():
    thread = ServerThread()
    thread.start()
    assert thread.is_started.wait(timeout=120), "the servers did not start"
    if thread.error is not None:
        raise thread.error
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def expected(offline) -> dict[str, str]:
    """Greedy text per prompt from the offline engine (same model, same seed)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = offline.generate(PROMPTS, params)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outputs, strict=True)}


@pytest.fixture()
def http_client(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.close()


@pytest.fixture()
def grpc_client(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def make_inputs(
    module, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool | None = None, binary=True
) -> list:
    """TensorRT-LLM ensemble tensors: [1, 1] each, as its clients send them."""
    tensors = [
        ("text_input", "BYTES", np.array([[prompt.encode()]], dtype=object)),
        ("max_tokens", "INT32", np.array([[max_tokens]], dtype=np.int32)),
        ("temperature", "FP32", np.array([[0.0]], dtype=np.float32)),
    ]
    if stream is not None:
        tensors.append(("stream", "BOOL", np.array([[stream]], dtype=bool)))
    inputs = []
    for name, datatype, data in tensors:
        tensor = module.InferInput(name, list(data.shape), datatype)
        if module is httpclient:
            tensor.set_data_from_numpy(data, binary_data=binary)
        else:
            tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def text_output(result) -> str:
    output = result.as_numpy("text_output")
    assert output.shape == (1, 1)
    value = output[0, 0]  # bytes when sent binary; tritonclient leaves JSON strings as str
    return value.decode() if isinstance(value, bytes) else value


def wait_idle(engine, timeout: float = 5.0) -> None:
    """No request in the core and no KV block in use, after the core's next heartbeat."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.stats.num_running == 0 and engine.stats.kv_cache_usage == 0 and not engine.queues:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats}, {len(engine.queues)} queued")


# ---------------------------------------------------------------- health and metadata


def test_http_health_and_metadata(http_client):
    assert http_client.is_server_live()
    assert http_client.is_server_ready()
    assert http_client.is_model_ready(MODEL_NAME)
    assert http_client.is_model_ready(MODEL_NAME, "1")
    assert not http_client.is_model_ready("no-such-model")
    meta = http_client.get_server_metadata()
    assert meta["name"] == "lantau"
    assert {"binary_tensor_data", "generate"} <= set(meta["extensions"])
    model = http_client.get_model_metadata(MODEL_NAME)
    assert model["name"] == MODEL_NAME and model["versions"] == ["1"]
    inputs = {t["name"]: t["datatype"] for t in model["inputs"]}
    assert inputs["text_input"] == "BYTES" and inputs["max_tokens"] == "INT32"
    assert inputs["temperature"] == "FP32" and inputs["stream"] == "BOOL"
    assert model["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
    config = http_client.get_model_config(MODEL_NAME)
    assert config["backend"] == "lantau" and config["max_batch_size"] == 0
    by_name = {t["name"]: t for t in config["input"]}
    assert by_name["text_input"]["data_type"] == "TYPE_STRING"
    assert not by_name["text_input"]["optional"] and by_name["max_tokens"]["optional"]
    assert config["output"][0]["data_type"] == "TYPE_STRING"


def test_grpc_health_and_metadata(grpc_client):
    assert grpc_client.is_server_live()
    assert grpc_client.is_server_ready()
    assert grpc_client.is_model_ready(MODEL_NAME)
    assert not grpc_client.is_model_ready("no-such-model")
    meta = grpc_client.get_server_metadata(as_json=True)
    assert meta["name"] == "lantau" and "binary_tensor_data" in meta["extensions"]
    model = grpc_client.get_model_metadata(MODEL_NAME, as_json=True)
    inputs = {t["name"]: t["datatype"] for t in model["inputs"]}
    assert inputs["text_input"] == "BYTES" and model["outputs"][0]["name"] == "text_output"
    config = grpc_client.get_model_config(MODEL_NAME).config
    assert config.backend == "lantau" and config.max_batch_size == 0
    assert config.input[0].name == "text_input" and config.model_transaction_policy.decoupled


# ---------------------------------------------------------------- inference


@pytest.mark.parametrize(
    "binary, compression",
    [(True, None), (False, None), (True, "gzip")],
    ids=["binary", "json", "gzip"],
)
def test_http_infer_matches_offline(http_client, expected, binary, compression):
    prompt = PROMPTS[0]
    outputs = (
        None if binary else [httpclient.InferRequestedOutput("text_output", binary_data=False)]
    )
    result = http_client.infer(
        MODEL_NAME, make_inputs(httpclient, prompt, binary=binary), outputs=outputs,
        request_id="client-7", request_compression_algorithm=compression,
    )  # fmt: skip
    assert text_output(result) == expected[prompt]
    assert result.get_response()["id"] == "client-7"
    if binary:  # tritonclient asked for binary outputs: no JSON data came back
        assert "data" not in result.get_output("text_output")


def test_http_infer_raw_json_and_parameters(server, expected):
    """Plain JSON, [1]-shaped tensors; sampling given as request parameters (vLLM style)."""
    body = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPTS[1]]}],
        "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0},
    }
    r = httpx.post(f"{base_url(server)}/v2/models/{MODEL_NAME}/versions/1/infer", json=body)
    assert r.status_code == 200, r.text
    output = r.json()["outputs"][0]
    assert output["shape"] == [1] and output["data"] == [expected[PROMPTS[1]]]


def test_grpc_infer_matches_offline(grpc_client, expected):
    for prompt in PROMPTS:
        result = grpc_client.infer(MODEL_NAME, make_inputs(grpcclient, prompt, stream=True))
        assert text_output(result) == expected[prompt]  # `stream` is ignored by unary infer


def stop_words_inputs(prompt: str, stop: str, stream: bool) -> list:
    """stop_words with a stop string and an empty one; empty bad_words (TRT-LLM's "none")."""
    inputs = make_inputs(grpcclient, prompt, stream=stream)
    for name, words in (("stop_words", [stop.encode(), b""]), ("bad_words", [b""])):
        tensor = grpcclient.InferInput(name, [1, len(words)], "BYTES")
        tensor.set_data_from_numpy(np.array([words], dtype=object))
        inputs.append(tensor)
    return inputs


def test_grpc_stop_words_match_offline(grpc_client, offline, expected):
    """A stop string spanning tokens: the text is cut where the offline engine cuts it, and
    a stream never sends the characters the cut takes back."""
    prompt = PROMPTS[1]
    stop = " ".join(expected[prompt].split()[:2])  # " routed routed ..." -> "routed routed"
    reference = offline.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
    )[0].outputs[0]
    assert reference.finish_reason == "stop"
    result = grpc_client.infer(MODEL_NAME, stop_words_inputs(prompt, stop, stream=False))
    assert text_output(result) == reference.text
    by_id = collect_stream(
        grpc_client, [dict(inputs=stop_words_inputs(prompt, stop, stream=True), request_id="s")]
    )
    assert "".join(text_output(r) for r in by_id["s"]) == reference.text


def test_grpc_min_length_holds_off_stop_words(grpc_client, offline, expected):
    """TensorRT-LLM's min_length tensor is min_tokens: a stop word in the first min_length
    tokens does not end the text."""
    prompt = PROMPTS[1]
    stop = " ".join(expected[prompt].split()[:2])
    inputs = stop_words_inputs(prompt, stop, stream=False)
    tensor = grpcclient.InferInput("min_length", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[MAX_TOKENS]], dtype=np.int32))
    reference = offline.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], min_tokens=MAX_TOKENS),
    )[0].outputs[0]
    assert reference.finish_reason == "length" and reference.text == expected[prompt]
    assert text_output(grpc_client.infer(MODEL_NAME, [*inputs, tensor])) == reference.text


def collect_stream(grpc_client, requests: list[dict], timeout: float = 30.0) -> dict:
    """Send each request on one stream; responses by request id until each one is final."""
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for kwargs in requests:
            grpc_client.async_stream_infer(MODEL_NAME, **kwargs)
        by_id: dict[str, list] = {kwargs["request_id"]: [] for kwargs in requests}
        num_open = len(by_id)
        while num_open:
            result, error = responses.get(timeout=timeout)
            assert error is None, error
            response = result.get_response()
            by_id[response.id].append(result)
            num_open -= response.parameters["triton_final_response"].bool_param
        return by_id
    finally:
        grpc_client.stop_stream()


def test_grpc_stream_infer(grpc_client, expected):
    """Two streaming requests and one plain request interleaved on one stream."""
    by_id = collect_stream(
        grpc_client,
        [
            dict(inputs=make_inputs(grpcclient, PROMPTS[0], stream=True), request_id="a"),
            dict(inputs=make_inputs(grpcclient, PROMPTS[1], stream=True), request_id="b"),
            dict(inputs=make_inputs(grpcclient, PROMPTS[1], stream=False), request_id="c"),
        ],
    )
    for request_id, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        results = by_id[request_id]
        # one response per text delta; deltas the client has not taken yet are merged,
        # so a loaded machine may send the whole text in fewer responses
        assert all(text_output(r) for r in results[:-1])
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
        assert finals == [False] * (len(results) - 1) + [True]
        assert "".join(text_output(r) for r in results) == expected[prompt]
    assert len(by_id["c"]) == 1 and text_output(by_id["c"][0]) == expected[PROMPTS[1]]


def test_grpc_stream_empty_final_response(grpc_client, expected):
    by_id = collect_stream(
        grpc_client,
        [
            dict(
                inputs=make_inputs(grpcclient, PROMPTS[0], stream=True),
                request_id="e",
                enable_empty_final_response=True,
            )
        ],
    )
    *deltas, final = by_id["e"]
    assert final.get_response().outputs == [] and final.as_numpy("text_output") is None
    assert "".join(text_output(r) for r in deltas) == expected[PROMPTS[0]]


def test_http_generate(server, expected):
    body = {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{base_url(server)}/v2/models/{MODEL_NAME}/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected[PROMPTS[0]]
    assert r.json()["model_name"] == MODEL_NAME


def test_http_generate_guided_decoding(server):
    """TensorRT-LLM's guided decoding fields (its generate curl's shape): any JSON, a JSON
    schema, a regex, an EBNF grammar; a bad guide is a 400 naming it."""
    import json
    import re

    url = f"{base_url(server)}/v2/models/{MODEL_NAME}/generate"
    schema = {"type": "object", "properties": {"year": {"type": "integer", "maximum": 2100}},
              "required": ["year"], "additionalProperties": False}  # fmt: skip
    cases = [
        ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(schema)},
         lambda t: set(json.loads(t)) == {"year"}),
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": r"\d{4}"},
         lambda t: re.fullmatch(r"\d{4}", t)),
        ({"guided_decoding_guide_type": "ebnf_grammar",
          "guided_decoding_guide": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]  # fmt: skip
    for guide, check in cases:
        body = {"text_input": "What year is next? Answer:", "max_tokens": 24, "temperature": 0}
        r = httpx.post(url, json={**body, **guide})
        assert r.status_code == 200, r.text
        assert check(r.json()["text_output"]), (guide, r.json())
    for guide, words in (
        ({"guided_decoding_guide_type": "xml"}, "not one of"),
        ({"guided_decoding_guide_type": "regex"}, "required"),
        ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "("}, "regex"),
        ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{"}, "JSON"),
        ({"guided_decoding_guide": "x"}, "without guided_decoding_guide_type"),
    ):
        r = httpx.post(url, json={"text_input": "x", "max_tokens": 2, **guide})
        assert r.status_code == 400 and words in r.json()["error"], (guide, r.text)


def test_http_generate_exclude_input_in_output(server, expected):
    """TRT-LLM's flag: False puts the prompt before the generated text."""
    body = {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "exclude_input_in_output": False}  # fmt: skip
    r = httpx.post(f"{base_url(server)}/v2/models/{MODEL_NAME}/generate", json=body)
    assert r.json()["text_output"] == PROMPTS[0] + expected[PROMPTS[0]]


def test_http_generate_stream(server, expected):
    body = {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "parameters": {"temperature": 0}}
    url = f"{base_url(server)}/v2/models/{MODEL_NAME}/generate_stream"
    deltas = []
    with httpx.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                deltas.append(orjson.loads(line.removeprefix("data: "))["text_output"])
    # deltas not yet taken are merged: a loaded machine may send fewer, never empty ones
    assert all(deltas[:-1]) and "".join(deltas) == expected[PROMPTS[1]]


# ---------------------------------------------------------------- errors


def raw_infer(server, model: str, inputs: list[dict], **extra) -> httpx.Response:
    return httpx.post(
        f"{base_url(server)}/v2/models/{model}/infer", json={"inputs": inputs, **extra}
    )


PROMPT_TENSOR = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}


@pytest.mark.parametrize(
    "inputs, status, words",
    [
        ([PROMPT_TENSOR], 404, "unknown model"),  # sent to another model's name below
        ([], 400, "text_input"),
        ([PROMPT_TENSOR, {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [0]}],
         400, "max_tokens"),
        ([PROMPT_TENSOR, {"name": "top_p", "datatype": "FP32", "shape": [1], "data": [1.5]}],
         400, "top_p"),
        ([PROMPT_TENSOR, {"name": "max_tokens", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
         400, "max_tokens"),
        ([PROMPT_TENSOR, {"name": "beam_width", "datatype": "INT32", "shape": [1], "data": [2]}],
         400, "beam_width"),
        ([{**PROMPT_TENSOR, "shape": [2], "data": ["a", "b"]}], 400, "one prompt"),
        ([{**PROMPT_TENSOR, "shape": [3]}], 400, "shape"),
        ([{**PROMPT_TENSOR, "data": [""]}], 400, "empty"),
        ([{**PROMPT_TENSOR, "data": ["x " * 600]}], 400, "max_model_len"),
        ([PROMPT_TENSOR, {"name": "bad_words", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
         400, "bad_words"),
    ],
    ids=["unknown-model", "no-text-input", "max-tokens-0", "top-p", "bad-type", "unknown-input",
         "batch-of-2", "bad-shape", "empty-prompt", "too-long", "bad-words"],
)  # fmt: skip
def test_http_infer_errors(server, inputs, status, words):
    model = "no-such-model" if status == 404 else MODEL_NAME
    r = raw_infer(server, model, inputs)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_http_malformed_requests(server, http_client):
    url = f"{base_url(server)}/v2/models/{MODEL_NAME}/infer"
    assert httpx.post(url, content=b"{not json").status_code == 400
    assert httpx.post(url, content=b"[1, 2]").status_code == 400
    bad_length = httpx.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert bad_length.status_code == 400 and "error" in bad_length.json()
    binary = {**PROMPT_TENSOR, "parameters": {"binary_data_size": 10}}
    del binary["data"]
    assert raw_infer(server, MODEL_NAME, [binary]).status_code == 400  # no bytes follow
    assert httpx.get(f"{base_url(server)}/v2/models/no-such-model").status_code == 404
    assert httpx.get(f"{base_url(server)}/v2/models/{MODEL_NAME}/versions/9").status_code == 404
    generate = f"{base_url(server)}/v2/models/{MODEL_NAME}/generate"
    r = httpx.post(generate, json={"text_input": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]
    stream = httpx.post(f"{generate}_stream", json={"max_tokens": 4})
    assert stream.status_code == 400 and "text_input" in stream.json()["error"]
    with pytest.raises(InferenceServerException, match="max_tokens"):
        http_client.infer(MODEL_NAME, make_inputs(httpclient, "hi", max_tokens=0))
    huge = httpx.post(url, content=b" " * (64 << 20 | 1))  # over the router's default limit
    assert huge.status_code == 413 and "error" in huge.json()


def test_overload_is_resource_exhausted():
    """Admission refusals: 429 with Retry-After over HTTP, RESOURCE_EXHAUSTED over gRPC."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from lantau.engine.async_llm import EngineOverloadedError
    from lantau.server.kserve_http import ErrorCode, make_kserve_router

    class OverloadedEngine:
        dead, max_model_len, sampling_defaults = None, 512, {}

        async def generate(self, *args, **kwargs):
            raise EngineOverloadedError("1024 requests pending")
            yield

    app = FastAPI()
    app.include_router(make_kserve_router(OverloadedEngine(), MODEL_NAME, lambda: True))
    r = TestClient(app).post(f"/v2/models/{MODEL_NAME}/generate", json={"text_input": "hi"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "busy" in r.json()["error"]
    for code in ErrorCode:  # kserve_grpc looks the gRPC status up by name
        assert grpc.StatusCode[code.name]


def test_grpc_errors(grpc_client):
    def code_of(model: str, inputs) -> grpc.StatusCode:
        with pytest.raises(InferenceServerException) as e:
            grpc_client.infer(model, inputs)
        return e.value.status()

    inputs = make_inputs(grpcclient, "hi")
    assert code_of("no-such-model", inputs) == "StatusCode.NOT_FOUND"
    assert code_of(MODEL_NAME, inputs[1:]) == "StatusCode.INVALID_ARGUMENT"  # no text_input
    assert code_of(MODEL_NAME, make_inputs(grpcclient, "hi", 0)) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as e:
        grpc_client.get_model_metadata("no-such-model")
    assert e.value.status() == "StatusCode.NOT_FOUND"


def test_grpc_stream_error_keeps_stream(grpc_client, expected):
    """A bad request on a stream gets an error response; the stream serves the next one."""
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc_client.async_stream_infer(MODEL_NAME, make_inputs(grpcclient, "hi", 0))
        result, error = responses.get(timeout=30)
        assert result is None and "max_tokens" in str(error)
        grpc_client.async_stream_infer(MODEL_NAME, make_inputs(grpcclient, PROMPTS[0]))
        result, error = responses.get(timeout=30)
        assert error is None and text_output(result) == expected[PROMPTS[0]]
    finally:
        grpc_client.stop_stream()


# ---------------------------------------------------------------- aborts and leaks

LONG = 500  # tokens a cancelled request would run to (~0.6 s here) if it were not aborted


def generated_since(engine, before: int) -> int:
    wait_idle(engine)
    return engine.stats.num_generated_tokens - before


def test_http_stream_disconnect_aborts(server):
    engine = server.engine
    wait_idle(engine)
    before = engine.stats.num_generated_tokens
    body = {"text_input": PROMPTS[0], "max_tokens": LONG, "temperature": 0}
    with httpx.stream(
        "POST", f"{base_url(server)}/v2/models/{MODEL_NAME}/generate_stream", json=body
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # leaving the block closed the connection mid-stream
    assert generated_since(engine, before) < LONG


def test_http_infer_disconnect_aborts(server):
    engine = server.engine
    wait_idle(engine)
    before = engine.stats.num_generated_tokens
    body = {"text_input": PROMPTS[0], "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url(server)}/v2/models/{MODEL_NAME}/generate", json=body, timeout=0.15)
    assert generated_since(engine, before) < LONG


def test_grpc_stream_cancel_aborts(server, grpc_client):
    engine = server.engine
    wait_idle(engine)
    before = engine.stats.num_generated_tokens
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    grpc_client.async_stream_infer(
        MODEL_NAME, make_inputs(grpcclient, PROMPTS[1], LONG, stream=True)
    )
    for _ in range(2):  # it is generating
        assert responses.get(timeout=30)[1] is None
    grpc_client.stop_stream(cancel_requests=True)
    assert generated_since(engine, before) < LONG


def test_grpc_infer_deadline_aborts(server, grpc_client):
    engine = server.engine
    wait_idle(engine)
    before = engine.stats.num_generated_tokens
    with pytest.raises(InferenceServerException) as e:
        grpc_client.infer(
            MODEL_NAME, make_inputs(grpcclient, PROMPTS[1], LONG), client_timeout=0.15
        )
    assert "DEADLINE_EXCEEDED" in e.value.status()
    assert generated_since(engine, before) < LONG


def test_nothing_leaked(server):
    """Last: every request above finished or was aborted, and freed its KV blocks."""
    wait_idle(server.engine)
    assert server.engine.stats.num_waiting == 0
    assert not server.engine.processor.states
