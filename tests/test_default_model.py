"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy output equals HF transformers
loaded from the same file, reads as English, and stop strings cut the text exactly."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from lantau import LLM, SamplingParams
from lantau.model.loader import DEFAULT_MODEL_FILE, default_model_path
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Give me three tips for staying healthy.",
    "Explain what a computer is to a child.",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", max_model_len=2048)


@pytest.fixture(scope="module")
def hf_model():
    folder = default_model_path().parent
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
    )
    return model.eval()


def test_greedy_matches_hf_and_reads_as_english(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    outputs = llm.chat(conversations, params)
    hf_model.generation_config.eos_token_id = None
    for conv, out in zip(conversations, outputs, strict=True):
        ids = llm.encode_chat(conv)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, NUM_TOKENS)[0]
    texts = [o.outputs[0].text for o in outputs]
    assert "Paris" in texts[0]
    for text in texts:
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 10, text
        common = {"the", "a", "is", "of", "and", "to", "in", "it", "you", "your", "can", "that"}
        assert any(w.lower() in common for w in words), text


def test_stop_strings_cut_exactly(llm):
    prompt = "Once upon a time"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    text = free.text
    assert len(text) > 30
    stop = text[15:19]  # a stop string somewhere inside the text
    first = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
    cut = out[0].outputs[0]
    assert cut.text == text[:first]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) <= len(free.token_ids)
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == text[: first + len(stop)]
    core = llm.engine.core
    core.scheduler.check_integrity()
    assert core.kv_cache.num_free_blocks == core.config.cache.num_blocks


def test_text_matches_full_decode(llm):
    out = llm.generate("The three primary colors are", SamplingParams(max_tokens=24, seed=3))
    completion = out[0].outputs[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
