"""Structured outputs (lantau/structured.py) in the offline engine: each request's text follows
its grammar (a JSON schema, any object, a regex, a choice, a Lark or GBNF grammar) beside requests
without one, through preemption (a resumed request's grammar is where its text left it), and
what is not a grammar is an InvalidRequestError naming the field."""

from __future__ import annotations

import json
import re

import pytest

from lantau import LLM, SamplingParams
from lantau.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
    "additionalProperties": False,
}
LARK = r"""start: "The answer is " NUMBER "."
NUMBER: /[1-9][0-9]?/
"""

# (grammar, how to check a text that follows it)
CASES = [
    ({"json": SCHEMA}, lambda t: set(json.loads(t)) == {"name", "tags", "ok"}),
    ({"regex": r"(cat|dog)s? (run|sleep)"}, lambda t: re.fullmatch(r"(cat|dog)s? (run|sleep)", t)),
    ({"choice": ["red", "green", "light blue"]}, lambda t: t in ("red", "green", "light blue")),
    ({"grammar": LARK}, lambda t: re.fullmatch(r"The answer is [1-9][0-9]?\.", t)),
    ({"grammar": 'root ::= "id-" [a-f0-9]{4}'}, lambda t: re.fullmatch(r"id-[a-f0-9]{4}", t)),
]


@pytest.fixture(scope="module")
def llm():
    # few KV blocks: 24 requests of ~40 tokens preempt each other
    return LLM("random:tiny", device="cpu", max_model_len=256, num_kv_blocks=24)


def test_each_request_follows_its_grammar_through_preemption(llm):
    prompts, params = [], []
    for i in range(24):
        spec, _ = CASES[i % len(CASES)]
        constrained = i % 6 != 5  # some without a grammar beside them
        prompts.append(f"Request {i}: " + "word " * (10 + i % 7))
        params.append(
            SamplingParams(
                temperature=0.9, seed=i, max_tokens=48, ignore_eos=not constrained,
                structured_outputs=spec if constrained else None,
            )
        )  # fmt: skip
    outputs = llm.generate(prompts, params)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0  # or this test shows nothing about resuming
    for i, (out, p) in enumerate(zip(outputs, params, strict=True)):
        text = out.outputs[0].text
        if p.structured_outputs is None:
            assert len(out.outputs[0].token_ids) == 48
            continue
        assert out.outputs[0].finish_reason == "stop", (i, text)
        assert CASES[i % len(CASES)][1](text), (i, text)
        if "json" in p.structured_outputs:  # as json.dumps writes it: no free whitespace
            assert json.dumps(json.loads(text), ensure_ascii=False) == text, text
    scheduler.check_integrity()
    assert llm.engine.core.kv_cache.num_free_blocks == 24
    assert not llm.engine.core.runner.grammars.matchers  # each request's matcher dropped


def test_greedy_follows_the_grammar_and_equals_its_sampled_pick(llm):
    """Greedy over the allowed tokens: the CUDA-graph-style pick of the raw logits is not
    taken for a constrained row; a top_k=1 sample picks the same."""
    spec = {"choice": ["yes", "no", "maybe not"]}
    greedy = llm.generate("Well?", SamplingParams(temperature=0, structured_outputs=spec))[0]
    top1 = llm.generate(
        "Well?", SamplingParams(temperature=1.0, top_k=1, seed=3, structured_outputs=spec)
    )[0]
    assert greedy.outputs[0].text in spec["choice"]
    assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"regex": "("}, "regex"),
        ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "json"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"choice": []}, "choice"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": "a", "json": {}}, "exactly one"),
        ({"xml": "<a/>"}, "exactly one"),
        ("not a dict", "exactly one"),
    ],
)
def test_what_is_not_a_grammar_is_named(spec, words):
    with pytest.raises(InvalidRequestError, match="structured_outputs") as e:
        SamplingParams(structured_outputs=spec)
    assert words in str(e.value)


def test_any_spec_is_a_grammar_or_a_named_error():
    """Whatever a request puts in structured_outputs (any JSON under any kind), the result is
    a grammar or an InvalidRequestError naming the field: nothing else escapes."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from tests.strategies import json_values

    values = json_values(max_size=4, max_leaves=12, max_text=12)
    kinds = st.sampled_from(["json", "json_object", "regex", "choice", "grammar", "other"])
    schema_keys = st.sampled_from(["type", "properties", "items", "enum", "required", "pattern"])
    schemas = st.dictionaries(schema_keys, values, max_size=4)

    # NOTE: derandomized, so that CI runs the same 600 examples every time; a run that found
    # {"choice": true} escaping as a TypeError is pinned below
    @settings(
        max_examples=600, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(kind=kinds, value=st.one_of(values, schemas))
    @example(kind="choice", value=True)
    @example(kind="choice", value="red")
    @example(kind="json", value=[1])
    def check(kind, value):
        try:
            SamplingParams(structured_outputs={kind: value})
        except InvalidRequestError as e:
            assert e.field == "structured_outputs"

    check()


def test_a_byte_level_tokenizer_converted_with_byte_fallback_keeps_its_grammar():
    """transformers 5.17 converts SmolLM2's GGUF tokenizer (GPT-2 byte-level BPE) with byte
    fallback and a decoder sequence ending in ByteLevel; llguidance then takes ' "' after
    '{"answer":' as an error once read, though its mask allowed it (found on the H200: JSON
    schema answers ended on their end token). tokenizer_json hands llguidance the plain
    byte-level form, whose matcher follows the whole answer."""
    import json
    from types import SimpleNamespace

    import tokenizers

    from lantau.model.source import load_tokenizer, resolve_model_source
    from lantau.structured import Grammars, tokenizer_json

    tokenizer = load_tokenizer(resolve_model_source("random:tiny"))
    data = json.loads(tokenizer_json(tokenizer))
    data["normalizer"] = {"type": "Sequence", "normalizers": []}
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ]}  # fmt: skip
    data["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<|endoftext|>")
    converted = json.dumps(data)  # as transformers 5.17 writes it
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    answer = tokenizer.encode('{"answer": "yes"}', add_special_tokens=False)

    def follows(text: str) -> bool:
        grammars = Grammars(lambda: text, len(tokenizer), [0])
        grammars.add("r", {"json": schema}, [])
        for token in answer:
            mask = grammars.masks(["r"])[0]
            assert (int(mask[token // 32]) >> (token % 32)) & 1, tokenizer.decode([token])
            grammars.consume("r", token)
            if grammars.matchers["r"].is_error():
                return False
        return True

    assert not follows(converted)  # the bug, as llguidance reads that form
    fake = SimpleNamespace(backend_tokenizer=tokenizers.Tokenizer.from_str(converted))
    assert follows(tokenizer_json(fake))
