"""Bad input gets a named exception naming the field, and leaves no state behind."""

from __future__ import annotations

import shutil

import pytest

from lantau import LLM, InvalidRequestError, ModelLoadError, SamplingParams


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
