"""`lantau serve` as users run it (a real process on loopback), driven by the official
`openai` client: outputs equal the offline engine's, streaming, errors, aborts free blocks."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lantau import LLM, SamplingParams
from tests.servers import lantau_serve
from tests.strategies import json_values

MODEL = "random:tiny"
API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server():
    flags = ("--api-key", API_KEY, "--api-key", "second-key")
    with lantau_serve(MODEL, *flags) as (base, _):
        yield base


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, device="cpu", max_model_len=512, num_kv_blocks=128)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)


def status(base: str) -> dict:
    return httpx.get(f"{base}/status", headers={"x-api-key": API_KEY}).json()


def wait_idle(base: str, timeout: float = 10.0) -> dict:
    """The engine has no request and every KV block is free (after its next heartbeat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(base)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0:
            return s
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: {status(base)}")


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline(client, offline):
    out = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=12, temperature=0
    )
    ref = offline.generate("The weather today", SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_equals_offline_and_stream_matches(client, offline):
    messages = [{"role": "user", "content": "Say something nice."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert full.choices[0].message.content == ref.text
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_completion_logprobs(client, offline):
    out = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=5, temperature=0, logprobs=2
    )
    ref = offline.generate(
        "The weather today", SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    )[0].outputs[0]
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    expected = [entry[t].logprob for entry, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_stop_string_and_params(client, offline):
    free = offline.generate("Once upon", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop = free.text[5:8]
    out = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == free.text[: free.text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=5,
        temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        logprobs=True, top_logprobs=3, extra_body={"top_k": 20, "min_p": 0.01},
    )  # fmt: skip
    assert [c.index for c in sampled.choices] == [0, 1]
    for choice in sampled.choices:
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=5,
        temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.01},
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in sampled.choices
    ]


def test_logit_bias_forces_and_bans_tokens(client, server, offline):
    """logit_bias as the openai client sends it (token ids as strings): +100 forces a token,
    -100 bans greedy's choice; the same tokens as the offline engine given the same bias."""
    prompt = "The weather today"
    free = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    for bias in ({"42": 100}, {str(free.token_ids[0]): -100, "7": -100}):
        ref = offline.generate(
            prompt,
            SamplingParams(
                temperature=0, max_tokens=6, logit_bias={int(t): b for t, b in bias.items()}
            ),
        )[0].outputs[0]
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias
        )
        assert out.choices[0].text == ref.text
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6,
            temperature=0.8, seed=3, logit_bias=bias,
        )  # fmt: skip
        assert chat.usage.completion_tokens == 6
    forced = offline.generate(prompt, SamplingParams(max_tokens=6, logit_bias={42: 100}))[0]
    assert forced.outputs[0].token_ids == [42] * 6  # sampled at temperature 1, still forced
    banned = ref.token_ids
    assert banned[0] != free.token_ids[0] and 7 not in banned
    headers = {"x-api-key": API_KEY}
    for bias, words in (
        ({"49152000": 1}, "not in the vocabulary"),
        ({"x": 1}, "expected an integer"),
        ({"5": 101}, "must map token ids"),
        ({"5": "high"}, "expected a number"),
    ):
        r = httpx.post(
            f"{server}/v1/completions", json={"prompt": prompt, "logit_bias": bias}, headers=headers
        )
        assert r.status_code == 400 and words in r.json()["error"]["message"], (bias, r.text)
        assert r.json()["error"]["param"].startswith("logit_bias")
    wait_idle(server)


def streamed_choices(stream) -> tuple[dict[int, str], dict[int, list[str]]]:
    """A completions stream's text by choice, and each choice's finish reasons as sent."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons


def test_batch_of_prompts_and_echo(client, server, offline):
    """A batch of prompts (strings or token ids) with n samples each: choice p * n + i is
    prompt p's sample i, as the offline engine makes it, streamed or not; usage over the
    batch; `echo` puts each prompt's text before its choices'."""
    prompts = ["The weather today", "Once upon a time", "Numbers: 1, 2,"]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=6)
    refs = offline.generate(prompts, params)
    expected = [o.text for r in refs for o in r.outputs]
    out = client.completions.create(
        model=MODEL, prompt=prompts, n=2, temperature=0.9, seed=11, max_tokens=6
    )
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == expected
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert out.usage.completion_tokens == sum(len(o.token_ids) for r in refs for o in r.outputs)
    stream = client.completions.create(
        model=MODEL, prompt=prompts, n=2, temperature=0.9, seed=11, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, reasons = streamed_choices(stream)
    assert [texts[i] for i in range(6)] == expected
    assert all(reasons[i] == ["length"] for i in range(6))
    ids = [r.prompt_token_ids for r in refs[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    greedy = offline.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=6))
    assert [c.text for c in by_ids.choices] == [r.outputs[0].text for r in greedy]
    echoed = client.completions.create(
        model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=0, echo=True
    )
    assert [c.text for c in echoed.choices] == [
        p + r.outputs[0].text for p, r in zip(prompts[:2], greedy, strict=True)
    ]
    stream = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert streamed_choices(stream)[0] == {0: prompts[0] + greedy[0].outputs[0].text}
    # a prompt of the batch refused: the whole request is, and nothing stays running
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=["fine", "word " * 600], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=MODEL, prompt=["text", [1, 2]], max_tokens=4)
    wait_idle(server)


def test_echo_with_logprobs_as_lm_eval_asks(client, server, offline):
    """lm-eval-harness's loglikelihood request (a batch of token-id prompts, echo, logprobs
    1, max_tokens 1, greedy): each choice's logprobs are its prompt's tokens (null for the
    first) then its sampled token's, as the offline engine's prompt_logprobs and logprobs
    give them; streamed, the same."""
    prompts = [[5, 17, 300, 42, 9, 77, 123], [8, 8, 400, 3]]
    refs = offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
    )
    args = dict(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    out = client.completions.create(**args)
    for choice, prompt, ref in zip(out.choices, prompts, refs, strict=True):
        lp, sample = choice.logprobs, ref.outputs[0]
        assert len(lp.tokens) == len(lp.text_offset) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [e[t].logprob for e, t in zip(ref.prompt_logprobs[1:], prompt[1:], strict=True)]
        expected.append(sample.logprobs[0][sample.token_ids[0]].logprob)
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset)
    stream = client.completions.create(**args, stream=True)
    streamed: dict[int, list] = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i, choice in enumerate(out.choices):  # another batch: the same up to float rounding
        assert streamed[i][0] is None
        assert streamed[i][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    wait_idle(server)


def test_vllm_prompt_logprobs_field(client, offline):
    """vLLM's prompt_logprobs: a choice's prompt (completions) or the conversation's (chat),
    null first, then each position's entries keyed by token id, as offline."""
    prompt = "The weather today is"
    ref = offline.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    ids = ref[0].prompt_token_ids
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    got = out.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for entry, want, token in zip(got[1:], ref[0].prompt_logprobs[1:], ids[1:], strict=True):
        assert set(entry) == {str(t) for t in want} and str(token) in entry
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == want[token].rank
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    assert chat.model_dump()["prompt_logprobs"][0] is None
    assert len(chat.model_dump()["prompt_logprobs"]) == chat.usage.prompt_tokens
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 99}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == "prompt_logprobs"


def test_streamed_logprobs_equal_the_unstreamed(client):
    """Each chunk carries the logprobs of the tokens it adds (both routes)."""
    args = dict(model=MODEL, prompt="The weather today", max_tokens=8, temperature=0, logprobs=2)
    full = client.completions.create(**args).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert (tokens, values, offsets) == (full.tokens, full.token_logprobs, full.text_offset)
    chat = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    full = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [
        t
        for chunk in client.chat.completions.create(**chat, stream=True)
        for c in chunk.choices
        if c.logprobs is not None
        for t in c.logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full]
    assert all(len(t.top_logprobs) == 2 for t in streamed)


def test_n_samples_ending_apart_send_one_finish_reason_each(client, server):
    """A sample that stops early stays in its request's outputs while the others run: its
    finish_reason is sent once, not again with every later chunk."""
    stream = client.completions.create(
        model=MODEL, prompt="Tell me", n=4, temperature=1.0, seed=2, max_tokens=40, stop=["e"],
        stream=True,
    )  # fmt: skip
    texts, reasons = streamed_choices(stream)
    assert sorted(reasons) == [0, 1, 2, 3] and all(len(r) == 1 for r in reasons.values())
    assert len({len(t) for t in texts.values()}) > 1  # they did end apart
    wait_idle(server)


@pytest.mark.parametrize(
    "route, extra, field",
    [
        ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        ("chat", dict(tool_choice="required"), "tool_choice"),
        ("chat", dict(functions=[{"name": "f"}]), "functions"),
        ("chat", dict(response_format={"type": "yaml"}), "response_format.type"),
        ("chat", dict(modalities=["text", "audio"]), "modalities"),
        ("chat", dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
        (
            "chat",
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ]
            ),
            "messages[0].content[1].type",
        ),  # fmt: skip
        ("completions", dict(suffix="the end"), "suffix"),
        ("completions", dict(best_of=3), "best_of"),
        (
            "completions",
            dict(extra_body={"response_format": {"type": "json_schema"}}),
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            ),
            "response_format",
        ),  # fmt: skip
        ("completions", dict(extra_body={"guided_regex": "("}), "guided_regex"),
        (
            "completions",
            dict(extra_body={"structured_outputs": {"choice": True}}),
            "structured_outputs",
        ),  # fmt: skip
        (
            "completions",
            dict(extra_body={"structured_outputs": {"regex": "a", "json": {}}}),
            "structured_outputs",
        ),  # fmt: skip
        (
            "completions",
            dict(extra_body={"guided_choice": ["a"], "guided_regex": "a"}),
            "guided_choice",
        ),  # fmt: skip
    ],
)
def test_features_not_served_are_refused_by_name(client, server, route, extra, field):
    """What this server does not do is a 400 naming the field, never an answer that
    quietly ignored it."""
    if route == "chat":
        args = dict(messages=[{"role": "user", "content": "Hi"}]) | extra
        call = client.chat.completions.create
    else:
        args = dict(prompt="Hi", extra_body={}) | extra
        call = client.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        call(model=MODEL, max_tokens=3, **args)
    assert e.value.body["param"] == field, e.value.body


def test_features_asked_off_are_accepted(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=3, tools=[], tool_choice="none", response_format={"type": "text"},
        modalities=["text"],
    )  # fmt: skip
    assert chat.usage.completion_tokens == 3
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, best_of=1, suffix="")
    assert out.usage.completion_tokens == 3


def test_vllm_extras_min_tokens_and_stop_strings_kept(client, offline):
    """vLLM's min_tokens, include_stop_str_in_output and skip_special_tokens in the body:
    the offline engine's outputs for the same SamplingParams."""
    prompt = "Once upon"
    free = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    extras = [
        dict(min_tokens=12, stop_token_ids=[free.token_ids[1]]),
        dict(stop=[free.text[4:6]], include_stop_str_in_output=True),
        dict(skip_special_tokens=False),
    ]
    outs = []
    for extra in extras:
        ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, **extra))
        args = {k: v for k, v in extra.items() if k != "stop"}
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=extra.get("stop"),
            extra_body=args,
        )  # fmt: skip
        assert out.choices[0].text == ref[0].outputs[0].text, extra
        assert out.usage.completion_tokens == len(ref[0].outputs[0].token_ids)
        outs.append(out)
    assert outs[0].usage.completion_tokens == 12  # min_tokens held the stop token off
    kept = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[free.text[4:6]],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text.endswith(free.text[4:6])


def test_tokenize_detokenize_and_version(server, offline):
    """vLLM's /tokenize (a text, or a conversation through the chat template) and
    /detokenize, against the offline engine's tokenizer; /version."""
    import lantau

    headers = {"x-api-key": API_KEY}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=30)

    text = "The weather today is sunny"
    ids = offline.tokenizer.encode(text)
    got = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 512
    assert got["token_strs"] == offline.tokenizer.convert_ids_to_tokens(ids)
    plain = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    conv = [{"role": "user", "content": "Say something nice."}]
    chat = post("/tokenize", {"model": MODEL, "messages": conv}).json()
    assert chat["tokens"] == offline.encode_chat(conv)
    bare = post("/tokenize", {"messages": conv, "add_generation_prompt": False}).json()
    assert bare["tokens"] == offline.encode_chat(conv, add_generation_prompt=False)
    assert bare["count"] < chat["count"]
    back = post("/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": offline.tokenizer.decode(ids)}
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "messages": conv}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "word " * 200_000}, "prompt"),  # cannot fit: not tokenized
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ):
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.get(f"{server}/version", headers=headers).json() == {"version": lantau.version()}


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}},
    "required": ["answer", "n"], "additionalProperties": False,
}  # fmt: skip


def test_structured_outputs(client, server, offline):
    """response_format json_schema / json_object and vLLM's structured_outputs and guided_*:
    the text follows the grammar, and is the offline engine's for the same grammar and seed
    (streamed too); a batch mixing grammars and none leaves nothing behind."""
    messages = [{"role": "user", "content": "Is it raining?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=4, response_format=fmt
    )
    content = reply.choices[0].message.content
    value = json.loads(content)
    assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9 and len(value) == 2
    ref = offline.chat(messages, SamplingParams(
        max_tokens=40, temperature=1.0, seed=4, structured_outputs={"json": SCHEMA}))  # fmt: skip
    assert content == ref[0].outputs[0].text
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=4,
        response_format=fmt, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
    # any object, pushed to the shortest by a bias: "{}" then EOS
    eos = offline.engine.core.config.model_config.eos_token_ids[0]
    close = offline.tokenizer.encode("}", add_special_tokens=False)[0]
    empty = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0,
        response_format={"type": "json_object"}, logit_bias={str(eos): 100, str(close): 50},
    )  # fmt: skip
    assert empty.choices[0].message.content == "{}"
    assert empty.choices[0].finish_reason == "stop"
    for extra, check in (
        ({"structured_outputs": {"regex": "(cat|dog)s?"}}, r"(cat|dog)s?"),
        ({"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
    ):
        outs = client.completions.create(
            model=MODEL, prompt=["Pick one:", "Another:"], max_tokens=12, temperature=0.9,
            seed=1, n=2, extra_body=extra,
        )  # fmt: skip
        assert all(re.fullmatch(check, c.text) for c in outs.choices), (extra, outs.choices)
        assert all(c.finish_reason == "stop" for c in outs.choices)
    wait_idle(server)


def test_template_options_and_continuous_usage(client, offline):
    """vLLM's chat extras: continue_final_message renders the assistant's unfinished turn
    for the model to go on with (the offline engine's tokens for the same rendering);
    chat_template_kwargs may not set apply_chat_template's own arguments. Streamed with
    continuous_usage_stats, every chunk carries the usage so far."""
    conv = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "It is"},
    ]
    ids = offline.tokenizer.encode(
        offline.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=False, continue_final_message=True
        ),
        add_special_tokens=False,
    )
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))
    reply = client.chat.completions.create(
        model=MODEL, messages=conv, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert reply.choices[0].message.content == ref[0].outputs[0].text
    assert reply.usage.prompt_tokens == len(ids)
    for extra, param in (
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=conv, extra_body=extra)
        assert e.value.body["param"] == param
    stream = client.chat.completions.create(
        model=MODEL, messages=conv[:1], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert chunks and all(c.usage is not None for c in chunks)  # each text chunk: its usage
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


def test_async_client_concurrent_streams(server, offline):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"Number {i} is", max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY)
        return await asyncio.gather(*(one(aclient, i) for i in range(8)))

    texts = asyncio.run(main())
    refs = offline.generate(
        [f"Number {i} is" for i in range(8)], SamplingParams(temperature=0, max_tokens=8)
    )
    assert texts == [r.outputs[0].text for r in refs]
    wait_idle(server)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(max_tokens=0), openai.BadRequestError),
        (dict(temperature=-1.0), openai.BadRequestError),
        (dict(top_p=1.5), openai.BadRequestError),
        (dict(n=0), openai.BadRequestError),
        (dict(model="no-such-model"), openai.NotFoundError),
        (dict(prompt="word " * 600), openai.BadRequestError),  # over max_model_len
    ],
)
def test_bad_requests(client, server, kwargs, error):
    args = dict(model=MODEL, prompt="hello", max_tokens=4) | kwargs
    with pytest.raises(error):
        client.completions.create(**args)
    wait_idle(server)


def test_malformed_bodies_and_auth(server):
    headers = {"authorization": f"Bearer {API_KEY}"}
    url = f"{server}/v1/completions"
    for body in (b"{bad", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": "9"}',
                 b'{"prompt": "x", "stop": [1]}', b'\xff\xfe'):  # fmt: skip
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        assert "message" in r.json()["error"]
    assert httpx.post(url, json={"prompt": "x"}).status_code == 401
    assert httpx.post(url, json={"prompt": "x"}, headers={"x-api-key": "wrong"}).status_code == 401
    ok = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, headers={"x-api-key": "second-key"})
    assert ok.status_code == 200
    big = httpx.post(url, content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}', headers=headers)
    assert big.status_code == 413
    assert httpx.get(f"{server}/health").status_code == 200  # probes need no key


def test_disconnect_aborts_and_frees_blocks(server):
    headers = {"x-api-key": API_KEY}
    body = {"prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    before = wait_idle(server)["num_generated_tokens"]
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        next(lines)  # the first chunk: the request is running
        assert status(server)["num_running"] == 1
    # the stream closed after one chunk: the engine must drop the request, not finish it
    after = wait_idle(server)["num_generated_tokens"]
    assert after - before < 480
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=0.5)
    assert wait_idle(server)["num_generated_tokens"] - after < 480


def test_a_batch_disconnected_or_past_its_deadline_is_aborted_whole(server):
    """Every prompt of a batch is aborted when its client hangs up mid-stream, or when its
    deadline passes (504), and every KV block comes back."""
    headers = {"x-api-key": API_KEY}
    prompts = ["Tell me a long story", "Write a long poem", "List many numbers"]
    body = {"prompt": prompts, "max_tokens": 400, "ignore_eos": True, "stream": True}
    before = wait_idle(server)["num_generated_tokens"]
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        next(lines)
        assert status(server)["num_running"] == 3
    after = wait_idle(server)["num_generated_tokens"]
    assert after - before < 3 * 400
    body = {**body, "stream": False, "timeout": 0.5}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 504, r.text
    assert wait_idle(server)["num_generated_tokens"] - after < 3 * 400


# --- fuzz: malformed requests never get a 5xx and never break the engine -------------------

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "n", "stop", "seed", "stream", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "timeout", "priority",
    "logit_bias", "echo", "suffix", "best_of", "tools", "tool_choice", "response_format",
]  # fmt: skip


def _bad_bodies():
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
        st.text(max_size=20),
    )  # fmt: skip
    values = st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=6,
    )
    body = st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=6)
    # NOTE: max_tokens forced out of range keeps every body invalid (and every request short)
    bad = body.map(lambda b: {**b, "max_tokens": -1, "max_completion_tokens": -1})
    raw = st.binary(max_size=64)
    return st.one_of(bad.map(orjson.dumps), raw, values.map(orjson.dumps))


def test_fuzz_malformed_requests(server):
    client = httpx.Client(headers={"x-api-key": API_KEY}, timeout=30)
    seen: list[int] = []

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_bad_bodies(), chat=st.booleans())
    def fuzz(body: bytes, chat: bool) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = client.post(f"{server}{path}", content=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert "message" in r.json()["error"]
        seen.append(r.status_code)

    fuzz()
    assert len(seen) >= 500
    ok = client.post(f"{server}/v1/completions", json={"prompt": "still alive", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    wait_idle(server)


def test_fuzz_tokenize_and_detokenize(server):
    """/tokenize and /detokenize on any body: an answer or a 4xx naming what is wrong,
    never a 5xx."""
    client = httpx.Client(headers={"x-api-key": API_KEY}, timeout=30)
    fields = ["model", "prompt", "messages", "tools", "tokens", "add_special_tokens",
              "add_generation_prompt", "return_token_strs"]  # fmt: skip
    values = json_values()
    # NOTE: json, not orjson: integers past 64 bits and NaN too
    bodies = st.dictionaries(st.sampled_from(fields), values, max_size=4).map(
        lambda b: json.dumps(b).encode()
    )

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=st.one_of(bodies, st.binary(max_size=32)), path=st.sampled_from(
        ["/tokenize", "/detokenize"]))  # fmt: skip
    def fuzz(body: bytes, path: str) -> None:
        r = client.post(f"{server}{path}", content=body)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code != 200:
            assert "message" in r.json()["error"]

    fuzz()


def test_a_request_whose_first_output_is_its_last_ends_with_its_response():
    """The route's chain of outputs closes the engine's generator when it ends, also when the
    first output was already the last (max_tokens 1, or tokens merged into it): its finally
    (the request's record, its admission counts) runs then, not when it is collected."""
    from types import SimpleNamespace

    from lantau.server.openai_api import _chain

    ended: list[str] = []

    async def engine_outputs(n: int):
        try:
            for i in range(n):
                yield SimpleNamespace(finished=i == n - 1)
        finally:
            ended.append(f"{n} output(s)")

    async def run(n: int) -> list:
        rest = engine_outputs(n)
        first = await anext(rest)
        chained = [o async for o in _chain(first, rest)]
        assert ended[-1:] == [f"{n} output(s)"]  # before anything else runs
        return chained

    assert [o.finished for o in asyncio.run(run(1))] == [True]
    assert [o.finished for o in asyncio.run(run(3))] == [False, False, True]


def test_cache_salt_keeps_tenants_prefixes_apart(client):
    """vLLM's cache_salt: a conversation's cached prefix serves the same salt's next request
    and no other's (nor an unsalted one's); a salt that is not a non-empty string is a 400."""
    story = "Parcel 4471 left the Shenzhen depot on Monday and clears customs in Rotterdam. " * 3
    messages = [{"role": "user", "content": story + "Where is it now?"}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body=extra
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0  # nothing another request cached, though the template's
    own = cached("tenant-a")  # head is every chat's: its own entries
    assert own > 0 and cached("tenant-b") == 0
    plain = cached(None)  # unsalted: at most that head, which other tests cached
    assert plain < own and cached(None) > plain
    with pytest.raises(openai.BadRequestError) as e:
        cached("")
    assert e.value.body["param"] == "cache_salt"


def test_official_client_parse_with_a_pydantic_model(client):
    """`chat.completions.parse(response_format=Model)`: the strict schema pydantic writes
    holds the answer; the client reads it back as the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Delivery(BaseModel):
        status: Literal["in_transit", "delivered", "delayed"]
        days_left: int = Field(ge=0, le=30)

    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Where is parcel 4471?"}],
        response_format=Delivery, max_tokens=40, temperature=0,
    )  # fmt: skip
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Delivery) and reply.choices[0].finish_reason == "stop"
