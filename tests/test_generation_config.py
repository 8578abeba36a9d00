"""A model's generation_config.json: its end tokens stop generation (as HF transformers'
`generate` on the same folder stops), and its sampling defaults fill what a request leaves
out, on the served routes (a real `lantau serve`, the official openai client, KServe) and
offline (`LLM.get_default_sampling_params`), unless `--generation-config vllm`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import openai
import pytest
import torch
import transformers

from lantau import LLM, SamplingParams
from lantau.errors import ModelLoadError
from lantau.model.generation_config import (
    eos_token_ids,
    model_sampling_defaults,
    sampling_defaults,
)
from lantau.model.source import read_model_config, resolve_model_source
from lantau.server.kserve_http import KServeModel, generate_inputs
from lantau.server.openai_api import parse_request, sampling_params_from
from lantau.server.schemas import RequestLimits
from tests.servers import lantau_serve

PROMPT = [5, 17, 300, 41, 9]


def test_sampling_defaults_and_end_tokens_read_as_vllm_reads_them():
    generation = {
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": None,
        "repetition_penalty": 1.05, "max_new_tokens": 64, "eos_token_id": [128001, 128009],
        "num_beams": 4,  # not a sampling default lantau (or vLLM) takes
    }  # fmt: skip
    assert sampling_defaults(generation) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
        "max_tokens": 64,
    }  # fmt: skip
    assert eos_token_ids(generation) == (128001, 128009)
    assert eos_token_ids({"eos_token_id": 2}) == (2,)
    assert sampling_defaults({"temperature": "hot", "top_k": 2.5, "top_p": float("nan")}) == {}


@pytest.fixture(scope="module")
def chat_model(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a generation config as an instruct model's: an end-of-turn token
    beside config.json's end of text (the greedy continuation's fourth new token, so that HF's
    generate and lantau both stop there), temperature 0.6, top_p 0.9 and max_new_tokens 3."""
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()  # fmt: skip
    end = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i] and t != 2)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(eos_token_id=[2, end], temperature=0.6, top_p=0.9, max_new_tokens=3)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder, ids[: ids.index(end) + 1], end


def test_end_of_turn_token_stops_as_hf_generate_does(chat_model):
    """HF's generate reads the folder's generation config and stops at its end token; so does
    lantau (config.json names only 2)."""
    folder, until_end, end = chat_model
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert read_model_config(resolve_model_source(str(folder))).eos_token_ids == (2, end)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12,
                             pad_token_id=0)[0, len(PROMPT) :].tolist()  # fmt: skip
    assert hf_ids == until_end
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    out = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=12)
    )[0].outputs[0]
    assert out.token_ids == until_end and out.finish_reason == "stop"


def test_offline_defaults(chat_model):
    """LLM.get_default_sampling_params: the model's (vLLM's name); generate without params
    uses them (three tokens: max_new_tokens); generation_config="vllm" keeps SamplingParams'."""
    folder, _, _ = chat_model
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 3)
    out = llm.generate({"prompt_token_ids": [7, 8, 9, 10]})[0].outputs[0]
    assert len(out.token_ids) == 3 or out.finish_reason == "stop"
    plain = LLM(str(folder), device="cpu", num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_request_fields_over_the_models_defaults():
    """What the body sets wins; what it leaves out is the model's, then OpenAI's (KServe's
    generate too)."""
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 3}

    def parse(body: dict, chat: bool = False):
        return parse_request(json.dumps(body).encode(), chat=chat, limits=RequestLimits())

    params = sampling_params_from(parse({"model": "m", "prompt": "hi"}), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 3)
    body = parse({"model": "m", "prompt": "hi", "temperature": 0, "top_p": 1, "max_tokens": 7})
    params = sampling_params_from(body, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, 20, 7)
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert sampling_params_from(chat, {}).max_tokens == 512
    assert sampling_params_from(chat, defaults).max_tokens == 3
    assert sampling_params_from(body, None).temperature == 0.0

    served = SimpleNamespace(name="m", engine=SimpleNamespace(sampling_defaults=defaults))
    job = KServeModel(served).build_job(generate_inputs({"text_input": "hi", "top_p": 0.5}), {})
    assert (job.params.temperature, job.params.top_p, job.params.max_tokens) == (0.6, 0.5, 3)


def test_modes(chat_model, tmp_path):
    folder, _, _ = chat_model
    assert model_sampling_defaults(folder)["temperature"] == 0.6
    assert model_sampling_defaults(folder, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    assert model_sampling_defaults(folder, str(other)) == {"temperature": 0.2}
    with pytest.raises(ModelLoadError, match="neither auto, vllm nor a folder"):
        model_sampling_defaults(folder, str(tmp_path / "missing"))
    (other / "generation_config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        model_sampling_defaults(folder, str(other))
    result = subprocess.run(
        [sys.executable, "-m", "lantau.cli", "serve", str(folder), "--generation-config", "hot"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--generation-config: 'hot'" in result.stderr


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_served_defaults_and_end_of_turn(chat_model, mode):
    """A real `lantau serve` of the folder: a completion that leaves max_tokens out gets the
    model's 3 (auto) or OpenAI's 16 (vllm); the end-of-turn token ends a greedy answer with
    finish_reason "stop" either way; the ready line names the model's defaults."""
    folder, until_end, _ = chat_model
    with lantau_serve(str(folder), "--generation-config", mode) as (base, proc):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        expected = 3 if mode == "auto" else 16
        # a prompt whose greedy continuation holds no end token within 16
        other = [7, 8, 9, 10]
        r = client.completions.create(model=str(folder), prompt=other, temperature=0)
        assert r.usage.completion_tokens == expected and r.choices[0].finish_reason == "length"
        r = client.completions.create(model=str(folder), prompt=PROMPT, temperature=0,
                                      max_tokens=12)  # fmt: skip
        assert r.usage.completion_tokens == len(until_end)
        assert r.choices[0].finish_reason == "stop"
    ready = "sampling defaults (generation_config.json): max_tokens=3"
    assert (ready in proc.output) == (mode == "auto")


def test_lantau_chat_sampling_from_its_flags_then_its_own_defaults():
    """`lantau chat`: a flag wins over chat's own defaults (random:tiny has no generation
    config to come between them: `LLM.sampling_defaults`, tested above); it answers and quits
    on an empty line."""
    result = subprocess.run(
        [sys.executable, "-m", "lantau.cli", "chat", "random:tiny", "--device", "cpu",
         "--max-model-len", "256", "--temperature", "0.2", "--max-tokens", "4"],
        input="hello\n\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "temperature 0.2, top_p 0.9, max_tokens 4)" in result.stdout
    assert result.stdout.count("> ") == 2  # asked, answered, asked again, quit
