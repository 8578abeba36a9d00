"""Bad input gets a named exception naming the field, and leaves no state behind: offline, and
served over every route (OpenAI, KServe v2 HTTP and gRPC), where it is a 4xx or
INVALID_ARGUMENT naming the field in JSON terms, never a 5xx, UNKNOWN or INTERNAL."""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from typing import Any

import grpc
import httpx
import msgspec
import numpy as np
import openai
import orjson
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from lantau import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from lantau.server import schemas
from lantau.server.kserve_grpc import CONTENTS_FIELDS
from lantau.server.kserve_http import INPUT_SPECS
from tests.servers import free_port, wait_ready


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64
    )


def assert_untouched(llm: LLM) -> None:
    core = llm.engine.core
    core.scheduler.check_integrity()
    assert not core.scheduler.requests and not llm.engine.states
    assert core.kv_cache.num_free_blocks == 64


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(temperature=math.inf), "temperature"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
        (dict(top_p=math.nan), "top_p"),
        (dict(seed=2**64), "seed"),
        (dict(max_tokens=2**63), "max_tokens"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(n=True), "n"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}:") as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    "prompt, field",
    [
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": list(range(3, 67))}, "prompt"),  # 64 tokens, max_model_len 64
        ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, 6.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, True]}, "prompt_token_ids"),
        ({"prompt_token_ids": np.array([[5, 6]])}, "prompt_token_ids"),  # 2-D
        ("text", "prompt"),  # this checkpoint ships no tokenizer
        (42, "prompt"),
    ],
)
def test_bad_prompts_queue_nothing(llm, prompt, field):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([good, prompt], SamplingParams(max_tokens=3))
    assert err.value.field == field
    assert_untouched(llm)
    # the engine still serves afterwards
    assert len(llm.generate(good, SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3
    assert_untouched(llm)


def test_numpy_token_ids_are_served_as_ints(llm):
    """np.int64 ids (a list of them, or the array itself) are the same prompt as Python ints:
    before, validation's isinstance(t, int) refused them as "must be integers in [0, V)"."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    ids = np.array([5, 6, 7], dtype=np.int64)
    for prompt in (list(ids), ids, tuple(ids.tolist())):
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].token_ids == want
        assert all(type(t) is int for t in out.prompt_token_ids)
    assert_untouched(llm)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="no such model"):
        LLM("/nonexistent/model/folder")


def test_unknown_random_shape():
    with pytest.raises(ModelLoadError, match="unknown random shape 'nope'"):
        LLM("random:nope")


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst / "model.safetensors"


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    path = copy_model(tiny_llama_dir, tmp_path / "m")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_corrupt_safetensors_header(tiny_llama_dir, tmp_path):
    path = copy_model(tiny_llama_dir, tmp_path / "m")
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_missing_weights(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="missing"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_corrupt_config(tiny_llama_dir, tmp_path):
    copy_model(tiny_llama_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config"):
        LLM(str(tmp_path / "m"), device="cpu")


# ---------------------------------------------------------------- served: every route, typed
# One `lantau serve` (HTTP and gRPC) for the tests below; its limits are lowered to be tested:
# --max-n 4 and --max-logprobs 3 (under OpenAI's own 5 and 20).

MODEL = "random:tiny"
MAX_N, MAX_LOGPROBS = 4, 3
PYTHON_NAMES = re.compile(r"NoneType|\b(int|str|float|dict|list|tuple)\b")


class Served:
    def __init__(self) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "lantau.cli", "serve", MODEL, "--device", "cpu",
            "--port", str(self.port), "--grpc-port", str(self.grpc_port),
            "--max-model-len", "256", "--num-kv-blocks", "64",
            "--max-n", str(MAX_N), "--max-logprobs", str(MAX_LOGPROBS),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        wait_ready(self.base, self.proc)
        self.http = httpx.Client(base_url=self.base, timeout=30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def post(self, path: str, body: bytes | dict, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return self.http.post(path, content=content, **kwargs)

    def close(self) -> None:
        self.http.close()
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served():
    server = Served()
    yield server
    server.close()


def served_idle(served: Served, timeout: float = 10.0) -> dict:
    """No request in flight and every KV block free (after the core's next report)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = served.http.get("/status").json()
        if s["num_in_flight"] == 0 and s["num_running"] == 0 and s["kv_cache_usage"] == 0.0:
            return s
        time.sleep(0.1)
    raise AssertionError(f"engine not idle: {served.http.get('/status').json()}")


def assert_openai_400(r: httpx.Response, param: str, words: str = "") -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error
    assert not PYTHON_NAMES.search(error["message"]), error
    return error["message"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": 5}]}]},
         "messages[0].content[1].text", "expected a string or null, got an integer"),
        (CHAT, {"messages": [{"role": "user", "content": [["text"]]}]},
         "messages[0].content[0]", "expected an object, got an array"),
        (CHAT, {"messages": [{"role": "user", "content": None}]},
         "messages[0].content", "got null"),
        (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
        (CHAT, {"messages": {"role": "user"}}, "messages", "got an object"),
        (CHAT, {"messages": []}, "messages", "length >= 1"),
        (CHAT, {"messages": HI, "stream_options": [True]}, "stream_options", "got an array"),
        (CHAT, {"messages": HI, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage", "expected a boolean or null, got a string"),
        (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
        (CHAT, {"messages": HI, "logprobs": 1}, "logprobs", "got an integer"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2**70}, "max_tokens", "<="),
        (COMPLETIONS, {"prompt": "x", "n": 1e30}, "n", "expected an integer or null, got a number"),
        (COMPLETIONS, {"prompt": "x", "seed": 2**64}, "seed", "<="),
        (COMPLETIONS, {"prompt": "x", "top_k": -(2**64)}, "top_k", ">="),
        (COMPLETIONS, {"prompt": "x", "priority": 2**63}, "priority", "<="),
        (COMPLETIONS, {"prompt": [1, [2, "a"]]}, "prompt[1][1]", "got a string"),
        (COMPLETIONS, {"prompt": ["a", [1, 2]]}, "prompt", "a batch of either"),
        (COMPLETIONS, {"prompt": [3, "b"]}, "prompt", "a batch of either"),
        (COMPLETIONS, {"prompt": []}, "prompt", "a batch of either"),
        (COMPLETIONS, {"prompt": "x", "stop": [None]}, "stop[0]", "expected a string, got null"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]", ">= 0"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", "got a string"),
        (COMPLETIONS, {"prompt": "x", "temperature": True}, "temperature", "got a boolean"),
        (COMPLETIONS, {"prompt": "x", "timeout": True}, "timeout", "got a boolean"),
        (COMPLETIONS, {"prompt": "x", "timeout": 0}, "timeout", "> 0"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        (COMPLETIONS, {"prompt": "x", "ignore_eos": None, "max_tokens": -1}, "max_tokens", ">= 1"),
        (COMPLETIONS, [{"prompt": "x"}], "body", "expected an object, got an array"),
    ],
)  # fmt: skip
def test_openai_wrong_types_name_the_field(served, path, body, param, words):
    assert_openai_400(served.post(path, body), param, words)


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b'{"prompt": "x", "temperature": 1e400}', "temperature", "number out of range"),
        (b'{"prompt": "x", "top_p": NaN}', "body", "malformed JSON"),
        (b'{"prompt": "x", "presence_penalty": -Infinity}', "body", "malformed JSON"),
        (b'{"prompt": "x", "max_tokens": 123456789012345678901234567890}', "max_tokens", "<="),
        (b'{"prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}", "n", "got an array"),
        (b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", "stop[0]", ""),
        (b'{"prompt": "x", "min_p": 1e300}', "min_p", "in [0, 1], got 1e+300"),
    ],
)
def test_openai_numeric_extremes(served, raw, param, words):
    assert_openai_400(served.post(COMPLETIONS, raw), param, words)


def test_openai_client_bounds(served):
    """OpenAI's own logprobs bounds, the server's --max-logprobs and --max-n, through the
    official client; within them the requests are served."""
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
    cases = [
        (dict(logprobs=6), "logprobs", "<= 5"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", "--max-logprobs"),
        (dict(n=MAX_N + 1), "n", "--max-n"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
        assert e.value.body["param"] == param and words in e.value.body["message"]
    chat = dict(model=MODEL, messages=HI, max_tokens=2, logprobs=True)
    for top, words in ((21, "<= 20"), (MAX_LOGPROBS + 1, "--max-logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(top_logprobs=top, **chat)
        assert e.value.body["param"] == "top_logprobs" and words in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens"
    out = client.chat.completions.create(top_logprobs=MAX_LOGPROBS, n=MAX_N, **chat)
    assert len(out.choices) == MAX_N
    assert all(len(t.top_logprobs) == MAX_LOGPROBS for t in out.choices[0].logprobs.content)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=3)
    assert all(len(top) <= 3 for top in out.choices[0].logprobs.top_logprobs)
    served_idle(served)


def test_max_completion_tokens_is_honoured(served):
    body = {"messages": HI, "max_completion_tokens": 3, "max_tokens": 9, "ignore_eos": True}
    r = served.post(CHAT, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_shorter_timeout_wins(served):
    """A body `timeout` cannot extend a shorter `x-request-timeout`, nor the reverse."""
    body = {"prompt": "Count:", "max_tokens": 250, "ignore_eos": True}
    for timeout, header in ((100.0, "0.05"), (0.05, "100")):
        start = time.monotonic()
        r = served.post(
            COMPLETIONS, {**body, "timeout": timeout}, headers={"x-request-timeout": header}
        )
        assert r.status_code == 504, r.text
        assert time.monotonic() - start < 5
    for header in ("nan", "inf", "-1", "soon"):
        r = served.post(COMPLETIONS, body, headers={"x-request-timeout": header})
        assert_openai_400(r, "x-request-timeout", "seconds")
    served_idle(served)


# KServe v2: the tensors of TensorRT-LLM's ensemble, sent as JSON, binary and gRPC

INFER = f"/v2/models/{MODEL}/infer"
GENERATE = f"/v2/models/{MODEL}/generate"
PROMPT = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}


def tensor(name: str, datatype: str, value) -> dict:
    return {"name": name, "datatype": datatype, "shape": [1], "data": [value]}


def assert_kserve_400(r: httpx.Response, words: str) -> str:
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert words in message and not PYTHON_NAMES.search(message), message
    return message


@pytest.mark.parametrize(
    "body, words",
    [
        ({"inputs": {"text_input": "hi"}}, "inputs: expected an array, got an object"),
        ({"inputs": [PROMPT, 5]}, "inputs[1]: expected an object"),
        ({"inputs": [{**PROMPT, "shape": [1.5]}]}, "inputs[0].shape[0]: expected an integer"),
        ({"inputs": [{**PROMPT, "shape": [2**64]}]}, "inputs[0].shape[0]"),
        ({"inputs": [{**PROMPT, "datatype": ["BYTES"]}]}, "inputs[0].datatype"),
        ({"inputs": [{**PROMPT, "parameters": []}]}, "inputs[0].parameters"),
        ({"inputs": [{**PROMPT, "parameters": {"binary_data_size": 1e30}}]},
         "inputs[0].parameters.binary_data_size"),
        ({"inputs": [PROMPT], "parameters": ["binary_data_output"]}, "parameters"),
        ({"inputs": [PROMPT], "parameters": {"priority": {"a": 1}}}, "parameters[...]"),
        ({"inputs": [PROMPT], "parameters": {"priority": 1e30}}, "priority: expected a 64-bit"),
        ({"inputs": [PROMPT], "parameters": {"priority": 2**63}}, "priority"),
        ({"inputs": [PROMPT], "outputs": {"name": "text_output"}}, "outputs"),
        ({"inputs": [PROMPT], "outputs": [{"name": "text_output", "parameters": 1}]},
         "outputs[0].parameters"),
        ({"inputs": [PROMPT], "id": ["x"]}, "id"),
        ({"inputs": [PROMPT, tensor("max_tokens", "INT32", 2**70)]}, "max_tokens"),
        ({"inputs": [PROMPT, tensor("max_tokens", "INT32", 1e30)]}, "max_tokens"),
        ({"inputs": [PROMPT, tensor("max_tokens", "INT32", [[5, 6]])]}, "does not hold 2"),
        ({"inputs": [PROMPT, tensor("max_tokens", "INT32", {"a": 1})]},
         "max_tokens: expected an integer, got an object"),
        ({"inputs": [PROMPT, tensor("temperature", "FP32", None)]},
         "temperature: expected a number, got null"),
        ({"inputs": [PROMPT, tensor("temperature", "FP32", 10**400)]}, "temperature"),
        ({"inputs": [PROMPT, tensor("random_seed", "UINT64", 2**64)]}, "random_seed"),
        ({"inputs": [PROMPT, tensor("stream", "BOOL", "yes")]}, "stream"),
        ({"inputs": [{**PROMPT, "data": [5]}]}, "text_input: expected a string, got an integer"),
    ],
)  # fmt: skip
def test_kserve_http_infer_wrong_types(served, body, words):
    assert_kserve_400(served.post(INFER, body), words)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"text_input": "hi", "parameters": [1]}, "parameters"),
        ({"text_input": "hi", "parameters": {"temperature": [1]}}, "parameters[...]"),
        ({"text_input": "hi", "id": {"a": 1}}, "id"),
        ({"text_input": "hi", "max_tokens": 2**70}, "max_tokens"),
        ({"text_input": "hi", "max_tokens": 1e300}, "max_tokens"),
        ({"text_input": {"a": "hi"}}, "text_input"),
        ({"text_input": ["hi"], "top_k": [2**63]}, "top_k"),
        ({"text_input": "hi", "beam_width": 2}, "beam_width"),
        ({"text_input": "hi", "stop_words": [1]}, "stop_words"),
        ({"text_input": "hi", "temperature": [[[[[[[[1]]]]]]]] * 2}, "temperature"),
        ({"text_input": "hi", "parameters": {"top_p": 1e300}}, "top_p"),
    ],
)
def test_kserve_http_generate_wrong_types(served, body, words):
    for path in (GENERATE, f"{GENERATE}_stream"):
        assert_kserve_400(served.post(path, body), words)


def test_kserve_http_extremes(served):
    deep = b'{"text_input": "hi", "max_tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_kserve_400(served.post(GENERATE, deep), "nested too deeply")
    data = b"[" * 900 + b"1" + b"]" * 900  # deeper than Python's stack allows to recurse
    body = b'{"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": '
    assert_kserve_400(served.post(INFER, body + data + b"}]}"), "text_input")
    length = {"Inference-Header-Content-Length": b"\xb2"}  # latin-1 "²": a digit to isdigit
    assert_kserve_400(served.post(INFER, b"{}", headers=length), "Inference-Header")
    for name, value in (
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("repetition_penalty", -math.inf),
    ):
        raw = struct.pack("<f", value)
        header = orjson.dumps(
            {
                "inputs": [
                    PROMPT,
                    {
                        "name": name,
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"binary_data_size": 4},
                    },
                ]
            }
        )
        r = served.post(
            INFER, header + raw, headers={"Inference-Header-Content-Length": str(len(header))}
        )
        assert_kserve_400(r, name)
    served_idle(served)


def grpc_inputs(*extra: tuple[str, str, np.ndarray]) -> list:
    tensors = [("text_input", "BYTES", np.array([b"hi"], dtype=object)), *extra]
    inputs = []
    for name, datatype, data in tensors:
        inputs.append(grpcclient.InferInput(name, list(data.shape), datatype))
        inputs[-1].set_data_from_numpy(data)
    return inputs


def grpc_status(served: Served, inputs: list, **kwargs) -> str:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        client.infer(MODEL, inputs, **kwargs)
        return "StatusCode.OK"
    except InferenceServerException as e:
        assert not PYTHON_NAMES.search(e.message()), e.message()
        return e.status()
    finally:
        client.close()


def test_grpc_wrong_types_and_extremes(served):
    """tritonclient.grpc: non-finite floats, out-of-range and mistyped values, in tensors and in
    request parameters, are INVALID_ARGUMENT; a UINT64 seed at 2**64 - 1 is served."""
    f32 = lambda v: np.array([v], dtype=np.float32)  # noqa: E731
    bad = [
        dict(inputs=grpc_inputs(("temperature", "FP32", f32(np.inf)))),
        dict(inputs=grpc_inputs(("top_p", "FP32", f32(np.nan)))),
        dict(inputs=grpc_inputs(("repetition_penalty", "FP32", f32(-np.inf)))),
        dict(inputs=grpc_inputs(("max_tokens", "BOOL", np.array([True])))),
        dict(inputs=grpc_inputs(("max_tokens", "UINT64", np.array([2**64 - 1], dtype=np.uint64)))),
        dict(inputs=grpc_inputs(("max_tokens", "FP64", np.array([1e30])))),
        dict(inputs=grpc_inputs(("text_input", "INT32", np.array([5], dtype=np.int32)))[1:]),
        dict(inputs=grpc_inputs(), parameters={"temperature": math.inf}),
        dict(inputs=grpc_inputs(), parameters={"max_tokens": 1e30}),
        dict(inputs=grpc_inputs(), parameters={"max_tokens": "many"}),
        dict(inputs=grpc_inputs(), priority=2**64 - 1),
    ]  # fmt: skip
    for kwargs in bad:
        assert grpc_status(served, **kwargs) == "StatusCode.INVALID_ARGUMENT", kwargs
    seed = ("random_seed", "UINT64", np.array([2**64 - 1], dtype=np.uint64))
    ok = grpc_inputs(seed, ("max_tokens", "INT32", np.array([2], dtype=np.int32)))
    assert grpc_status(served, ok) == "StatusCode.OK"
    served_idle(served)


def test_grpc_raw_parameters_and_stream(served):
    """Raw stubs: an unset parameter, typed contents of the wrong kind; on a stream each bad
    request gets an error response naming its field, and the stream serves the next."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents[
        :
    ] = [b"hi"]
    request.parameters["max_tokens"].SetInParent()  # no value: null
    with pytest.raises(grpc.RpcError) as e:
        served.stub.ModelInfer(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "null" in e.value.details()
    bad = service_pb2.ModelInferRequest(model_name=MODEL, id="bad")
    bad.CopyFrom(request)
    bad.id = "bad"
    del bad.parameters["max_tokens"]
    bad.inputs.add(name="temperature", datatype="FP64", shape=[1]).contents.fp64_contents[:] = [
        math.inf
    ]
    good = service_pb2.ModelInferRequest(model_name=MODEL, id="good")
    good.inputs.add().CopyFrom(request.inputs[0])
    good.parameters["max_tokens"].int64_param = 2
    responses = list(served.stub.ModelStreamInfer(iter([bad, good]), timeout=30))
    by_id = {r.infer_response.id: r for r in responses}
    assert "temperature" in by_id["bad"].error_message
    assert "internal" not in by_id["bad"].error_message
    assert by_id["good"].error_message == "" and by_id["good"].infer_response.outputs
    served_idle(served)


# ---------------------------------------------------------------- fuzz, from the schemas
# A valid body per route, then 1-3 of its fields (at any depth, named from the schemas) set to
# a value of any type: numeric extremes, wrong types, lists for objects, raw JSON numbers that
# no encoder writes (1e400, NaN). Every answer is a 2xx or a 4xx (a 504 only for a body whose
# own `timeout` passed); gRPC never says UNKNOWN or INTERNAL; the server stays healthy.

RAW_NUMBERS = [b"1e400", b"-1e400", b"NaN", b"Infinity", b"-Infinity", b"1" * 40, b"-0"]
EXTREMES = [
    None, True, False, 0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e30, 1e300, -1e300,
    5e-324, 0.5, "", "x", [], [1], {}, {"a": 1}, [[["x"]]],
]  # fmt: skip


def _values() -> st.SearchStrategy:
    leaf = st.one_of(
        st.sampled_from(EXTREMES),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
        st.sampled_from([f"@@RAW{i}@@" for i in range(len(RAW_NUMBERS))]),
    )
    nest = lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=2)  # noqa: E731
    return st.recursive(leaf, nest, max_leaves=5)


def _encode(body: dict) -> bytes:
    raw = msgspec.json.encode(body)
    for i, number in enumerate(RAW_NUMBERS):
        raw = raw.replace(f'"@@RAW{i}@@"'.encode(), number)
    return raw


def _field_paths(struct: type, nested: dict[str, list[tuple]]) -> list[tuple]:
    """Every top-level field of the schema, and the nested paths given for some."""
    names = [f.encode_name for f in msgspec.structs.fields(struct)]
    return [(name,) for name in names] + [p for paths in nested.values() for p in paths]


PART = ("messages", 0, "content", 0)
FUZZ_ROUTES = {
    COMPLETIONS: (
        {"prompt": [5, 6, 7], "max_tokens": 2, "stop": ["zz"], "stop_token_ids": [3],
         "stream_options": {"include_usage": True}},
        _field_paths(schemas.CompletionRequest, {
            "nested": [("prompt", 0), ("stop", 0), ("stop_token_ids", 0),
                       ("stream_options", "include_usage")]}),
    ),
    CHAT: (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_tokens": 2, "stream_options": {"include_usage": True}},
        _field_paths(schemas.ChatRequest, {
            "nested": [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                       PART, (*PART, "type"), (*PART, "text"),
                       ("stream_options", "include_usage")]}),
    ),
    GENERATE: (
        {"text_input": "hi", "max_tokens": 2, "parameters": {"priority": 0}, "id": "x"},
        [(name,) for name in INPUT_SPECS] + [("parameters", name) for name in INPUT_SPECS]
        + [("parameters",), ("id",), ("parameters", "priority")],
    ),
    INFER: (
        {"inputs": [dict(PROMPT), tensor("max_tokens", "INT32", 2)],
         "outputs": [{"name": "text_output", "parameters": {"binary_data": False}}],
         "parameters": {"binary_data_output": False}, "id": "x"},
        _field_paths(schemas.InferHeader, {
            "inputs": [("inputs", i, *rest) for i in (0, 1) for rest in (
                (), ("name",), ("datatype",), ("shape",), ("shape", 0), ("data",), ("data", 0),
                ("parameters",), ("parameters", "binary_data_size"))],
            "outputs": [("outputs", 0), ("outputs", 0, "name"), ("outputs", 0, "parameters")],
            "parameters": [("parameters", "binary_data_output"), ("parameters", "priority"),
                           ("parameters", "temperature")]}),
    ),
}  # fmt: skip


def _mutated(path: str, changes: list[tuple[tuple, Any]]) -> bytes:
    body = copy.deepcopy(FUZZ_ROUTES[path][0])
    for field_path, value in changes:
        node = body
        for key in field_path[:-1]:
            node = _child(node, key)
        last = field_path[-1]
        is_index = isinstance(node, list) and isinstance(last, int) and last < len(node)
        if is_index or (isinstance(node, dict) and isinstance(last, str)):
            node[last] = value
    return _encode(body)


def _child(node: Any, key: str | int) -> Any:
    """node[key], made an object where a dict lacks it; None where there is no such child."""
    if isinstance(node, dict) and isinstance(key, str):
        return node.setdefault(key, {})
    if isinstance(node, list) and isinstance(key, int) and key < len(node):
        return node[key]
    return None


@st.composite
def _http_case(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(FUZZ_ROUTES)))
    paths = FUZZ_ROUTES[path][1]
    changes = draw(st.lists(st.tuples(st.sampled_from(paths), _values()), min_size=1, max_size=3))
    return path, _mutated(path, changes)


def _is_deadline(raw: bytes) -> bool:
    """A 504 is right when the body's own `timeout` was a valid, short one."""
    try:
        timeout = msgspec.json.decode(raw).get("timeout")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0


def test_fuzz_http_from_schemas(served):
    seen: list[int] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_http_case(), stream=st.booleans())
    def fuzz(case: tuple[str, bytes], stream: bool) -> None:
        path, raw = case
        if stream and path == GENERATE:
            path = f"{GENERATE}_stream"
        r = served.post(path, raw)
        ok = r.status_code < 500 or (r.status_code == 504 and _is_deadline(raw))
        assert ok and r.status_code >= 200, (path, raw, r.status_code, r.text)
        assert b"internal" not in r.content, (path, raw, r.text)
        seen.append(r.status_code)

    fuzz()
    assert len(seen) >= 60
    assert any(400 <= s < 500 for s in seen) and any(s == 200 for s in seen), seen
    assert served.http.get("/health").status_code == 200
    assert served.post(COMPLETIONS, {"prompt": "alive", "max_tokens": 2}).status_code == 200
    served_idle(served)


GRPC_EXTREMES = {  # what each InferTensorContents field can hold, extremes first
    "bool_contents": st.booleans(),
    "int_contents": st.sampled_from([-(2**31), 2**31 - 1]) | st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.sampled_from([-(2**63), 2**63 - 1]) | st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.sampled_from([0, 2**32 - 1]) | st.integers(0, 2**32 - 1),
    "uint64_contents": st.sampled_from([0, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    "fp32_contents": st.sampled_from([math.inf, -math.inf, math.nan, 3e38]) | st.floats(width=32),
    "fp64_contents": st.sampled_from([math.inf, math.nan, 1e300, 1e30]) | st.floats(),
    "bytes_contents": st.binary(max_size=8),
}
GRPC_PARAMETERS = {
    "bool_param": st.booleans(),
    "int64_param": st.integers(-(2**63), 2**63 - 1),
    "uint64_param": st.sampled_from([2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    "double_param": st.sampled_from([math.inf, -math.inf, math.nan, 1e300, 1e30]) | st.floats(),
    "string_param": st.text(max_size=6),
}


@st.composite
def _grpc_request(draw) -> service_pb2.ModelInferRequest:
    """text_input plus up to 3 inputs of any datatype (typed or raw contents) holding extreme
    values, and up to 3 request parameters of any kind; max_tokens 2 unless overridden."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="fuzz")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs[0].contents.bytes_contents.append(b"hi")
    request.parameters["max_tokens"].int64_param = 2
    names = st.sampled_from(sorted(INPUT_SPECS)[1:] + ["text_input", "priority", "n"])
    for name in draw(st.lists(names, max_size=3, unique=True)):
        datatype, field = draw(st.sampled_from(sorted(CONTENTS_FIELDS.items())))
        values = draw(st.lists(GRPC_EXTREMES[field], min_size=0, max_size=2))
        shape = draw(st.sampled_from([[len(values)], [1], [1, len(values)], [-1]]))
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(tensor.contents, field).extend(values)
    for name in draw(st.lists(names, max_size=3, unique=True)):
        kind = draw(st.sampled_from(sorted(GRPC_PARAMETERS)))
        setattr(request.parameters[name], kind, draw(GRPC_PARAMETERS[kind]))
    return request


def test_fuzz_grpc_from_schemas(served):
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    codes: list[grpc.StatusCode] = []

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=_grpc_request(), stream=st.booleans())
    def fuzz(request: service_pb2.ModelInferRequest, stream: bool) -> None:
        if stream:  # one request on a stream: an error comes back in-band
            # NOTE: a valid request with the "stream" parameter answers a response a token
            responses = list(served.stub.ModelStreamInfer(iter([request]), timeout=30))
            assert responses, request
            for response in responses:
                assert "internal" not in response.error_message, (request, response.error_message)
            failed = any(response.error_message for response in responses)
            codes.append(None if failed else grpc.StatusCode.OK)
            return
        try:
            served.stub.ModelInfer(request, timeout=30)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            assert e.code() in allowed, (request, e.code(), e.details())
            assert not PYTHON_NAMES.search(e.details()), e.details()
            codes.append(e.code())

    fuzz()
    assert len(codes) >= 30
    assert grpc.StatusCode.INVALID_ARGUMENT in codes and grpc.StatusCode.OK in codes, codes
    live = served.stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5)
    assert live.live
    served_idle(served)


def test_nothing_leaked(served):
    """Last: no request of the tests above is in flight, and every KV block is free."""
    status = served_idle(served)
    assert status["num_waiting"] == 0 and status["ready"]
