"""Greedy tokens and logits equal HF transformers' (float32, CPU) on tiny random models."""

from __future__ import annotations

import pytest
import torch
import transformers

from lantau import LLM, SamplingParams
from tests.conftest import TINY_LLAMA, hf_greedy, save_tiny_hf_model

NUM_PROMPTS, NUM_TOKENS = 8, 32

# the shared tiny shape, without token ids: HF's defaults for each architecture apply
COMMON = {k: v for k, v in TINY_LLAMA.items() if not k.endswith("_token_id")}

CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
}


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 12, 17, 25, 31, 48, 70]
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_hf_model(folder, CONFIGS[request.param]())


def test_greedy_and_logits_match_hf(hf_model_dir):
    folder, hf_model = hf_model_dir
    prompts = make_prompts()
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    last_logits = llm.engine.core.runner.last_logits
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        hf_tokens, hf_logits = hf_greedy(hf_model, prompt, NUM_TOKENS)
        assert output.outputs[0].token_ids == hf_tokens, f"prompt {i}"
        ours = last_logits[f"{output.request_id}#0"].float()
        assert (ours - hf_logits).abs().max().item() <= 1e-4, f"prompt {i}"
    llm.engine.core.scheduler.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == 256


def test_prompt_logprobs_match_hf(hf_model_dir):
    """SamplingParams.prompt_logprobs: every prompt token's logprob (after the first) and
    rank, and each position's top-k, equal HF's log-softmax of its logits at the position
    before; across prompt chunks (a 16-token threshold), beside requests not asking, with n
    samples (sample 0 computes them), and never from the prefix cache (every position is
    computed; a plain request after it does hit the cache)."""
    folder, hf_model = hf_model_dir
    prompts = make_prompts()[3:]  # 17 to 70 tokens
    llm = LLM(
        str(folder), dtype="float32", device="cpu", num_kv_blocks=256,
        long_prefill_token_threshold=16,
    )  # fmt: skip
    asking = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4, n=2)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    params = [asking if i % 2 == 0 else plain for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output, p in zip(prompts, outputs, params, strict=True):
        if p is plain:
            assert output.prompt_logprobs is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            entry, token, row = got[i], prompt[i], ref[i - 1]
            assert abs(entry[token].logprob - row[token].item()) <= 1e-4, (i, entry[token])
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(4).indices.tolist()
            assert set(entry) == set(top) | {token}
            assert all(entry[t].rank == r for r, t in enumerate(top, start=1) if t != token)
        assert output.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, [asking, plain])
    assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens > 0
    for a, b in zip(again[0].prompt_logprobs[1:], outputs[0].prompt_logprobs[1:], strict=True):
        # another batch, other chunks: the same up to float rounding
        assert {t: e.rank for t, e in a.items()} == {t: e.rank for t, e in b.items()}
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-5 for t in a)
    llm.engine.core.scheduler.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == 256


def test_repetition_penalty_matches_hf(tiny_llama_dir):
    """Through the whole engine: HF's repetition penalty covers prompt and output tokens,
    like lantau's; greedy tokens must agree."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    hf_model.generation_config.eos_token_id = None
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=256)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, repetition_penalty=1.3
    )
    prompts = make_prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    )
    assert any(  # the penalty must matter here, or this test proves nothing
        a.outputs[0].token_ids != b.outputs[0].token_ids
        for a, b in zip(outputs, plain, strict=True)
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        hf_tokens, _ = hf_greedy(hf_model, prompt, NUM_TOKENS, repetition_penalty=1.3)
        assert output.outputs[0].token_ids == hf_tokens
