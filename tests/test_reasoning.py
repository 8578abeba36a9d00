"""A reasoning model's thinking apart from its answer (`--reasoning-parser`, vLLM's flag): the
parsers' split on whole and half-written texts, then through the official openai client on a
scripted engine: `reasoning_content` beside the content (tool calls read from the answer
only), streamed as its own deltas that add up to the same, cut while thinking; the Responses
API's reasoning item; nothing split without the flag."""

from __future__ import annotations

import json

import openai
import pytest

from lantau.server.app import ServerConfig, build_app
from lantau.server.reasoning import Split, reasoning_parser
from tests.servers import app_server
from tests.test_tool_calls import CALL, TOOLS, ScriptedChat

THOUGHT = "The user asks about order 7. It left the depot today, so: tomorrow."
SCRIPT = {  # the last user message -> the model's answer (and finish reason)
    "when?": f"<think>{THOUGHT}</think>\n\nIt arrives tomorrow.",
    "implicit": f"{THOUGHT}</think>It arrives tomorrow.",  # the template opened the thinking
    "weather?": f"<think>I need the weather.</think><tool_call>{CALL}</tool_call>",
    "cut": (f"<think>{THOUGHT}", "length"),
}


def test_split_whole_and_half_written():
    r1, qwen3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
    assert r1.split("<think>a b</think>\n\nc") == Split("a b", "\n\nc")
    assert r1.split("a b</think>c") == Split("a b", "c")  # opened by the template
    assert r1.split("a b") == Split("a b", None)  # cut while thinking
    assert r1.split("<think>a b</thi", final=False) == Split("a b", None)  # held back
    assert r1.split("<think>a b</th", final=True) == Split("a b</th", None)
    assert r1.split("<think></think>") == Split("", "")
    assert r1.split("<thi", final=False) == Split("", None)  # may yet open the thinking
    assert r1.split("\n", final=False) == Split("", None)  # blanks before it too
    assert r1.split("\n<think>a", final=False) == Split("a", None)
    assert qwen3.split("plain answer") == Split(None, "plain answer")  # thinking off
    assert qwen3.split("<think>x</think>y") == Split("x", "y")
    assert qwen3.split("<thi", final=False) == Split(None, None)  # may open thinking yet
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        reasoning_parser("r2")


class Recording(ScriptedChat):
    """ScriptedChat keeping each request's SamplingParams (what the engine core would get)."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)
        self.params = []

    async def generate(self, request_id, prompt, params, priority=0):
        self.params.append(params)
        async for output in super().generate(request_id, prompt, params, priority):
            yield output


@pytest.fixture(scope="module", params=[True, False], ids=["parser", "no-parser"])
def served(request):
    engine = Recording()
    config = ServerConfig(grpc_port=0, tool_call_parser="hermes",
                          reasoning_parser="deepseek_r1" if request.param else None)  # fmt: skip
    with app_server(build_app(engine, config)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        client._lantau_engine = engine
        yield request.param, client


def ask(client, content: str, **kwargs):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="lantau", messages=messages, **kwargs)


def streamed(client, content: str, **kwargs) -> tuple[str, str, list, list[str]]:
    """(thinking, content, tool calls, the order of the kinds of deltas) of a stream."""
    thinking, text, calls, order = "", "", [], []
    for chunk in ask(client, content, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            thinking += extra["reasoning_content"]
            order.append("thinking")
        if delta.content:
            text += delta.content
            order.append("content")
        calls += delta.tool_calls or []
    return thinking, text, calls, order


def test_chat_thinking_apart(served):
    parsed, client = served
    for user in ("when?", "implicit"):
        message = ask(client, user).choices[0].message
        if not parsed:  # without the flag: the text as the model wrote it
            assert (
                message.content == SCRIPT[user] and "reasoning_content" not in message.model_extra
            )
            continue
        assert message.model_extra["reasoning_content"] == THOUGHT
        assert message.content.strip() == "It arrives tomorrow."
        thinking, text, _, order = streamed(client, user)
        assert thinking == THOUGHT and text == message.content
        assert order == sorted(order, key=["thinking", "content"].index)  # thinking first
        assert "</think>" not in thinking + text


def test_tool_calls_read_from_the_answer_only(served):
    parsed, client = served
    choice = ask(client, "weather?", tools=TOOLS).choices[0]
    if not parsed:  # the thinking is the text before the call
        assert choice.message.content == "<think>I need the weather.</think>"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        return
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    thinking, text, calls, _ = streamed(client, "weather?", tools=TOOLS)
    assert (
        thinking == "I need the weather." and text == "" and calls[0].function.name == "get_weather"
    )


def test_cut_while_thinking(served):
    parsed, client = served
    choice = ask(client, "cut").choices[0]
    assert choice.finish_reason == "length"
    if parsed:
        assert choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == THOUGHT
        thinking, text, _, _ = streamed(client, "cut")
        assert thinking == THOUGHT and text == ""
    else:
        assert choice.message.content == SCRIPT["cut"][0]


def test_responses_reasoning_item(served):
    parsed, client = served
    r = client.responses.create(model="lantau", input="when?")
    if not parsed:
        assert [o.type for o in r.output] == ["message"] and r.output_text == SCRIPT["when?"]
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        return
    thinking, message = r.output
    assert thinking.type == "reasoning" and thinking.content[0].text == THOUGHT
    spent = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < spent < r.usage.output_tokens
    assert message.type == "message" and r.output_text.strip() == "It arrives tomorrow."
    events = list(client.responses.create(model="lantau", input="when?", stream=True))
    added = [
        (e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"
    ]
    assert added == [(0, "reasoning"), (1, "message")]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == THOUGHT and text == r.output_text
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.content_part.added")
    assert events[-1].type == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_grammars_held_after_the_thinking(served):
    """A response format or a forced call beside deepseek_r1: the grammar goes to the engine
    to hold from the end of thinking on (its tokens: `grammar_after`); without the parser,
    from the first token."""
    parsed, client = served
    engine = client._lantau_engine
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    asks = [
        (dict(response_format={"type": "json_object"}), {"json_object": True}),
        (dict(tools=TOOLS, tool_choice="required"), None),
    ]
    for extra, spec in asks:
        ask(client, "when?", **extra)
        params = engine.params[-1]
        assert params.structured_outputs is not None
        if spec is not None:
            assert params.structured_outputs == spec
        assert params.grammar_after == (end if parsed else ())


def test_optional_thinking_refuses_grammars():
    """qwen3's thinking may be switched off, so where a grammar would start is not known: a
    400 naming the field."""
    from types import SimpleNamespace

    from lantau.errors import InvalidRequestError
    from lantau.request import SamplingParams
    from lantau.server.openai_api import OpenAIServer, parse_request
    from lantau.server.schemas import RequestLimits

    server = OpenAIServer(None, 1 << 20, RequestLimits(), None, reasoning_parser("qwen3"))
    body = parse_request(
        json.dumps({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_object"}}).encode(),
        chat=True, limits=RequestLimits(),
    )  # fmt: skip
    engine = SimpleNamespace(tokenizer=ScriptedChat().tokenizer)
    params = SamplingParams(structured_outputs={"json_object": True})
    with pytest.raises(InvalidRequestError, match="response_format: not served with"):
        server.after_thinking(body, engine, params, forced=False)


def test_grammar_waits_for_its_tokens():
    """The engine core's matcher: unconstrained until the output ends with the `after`
    tokens (split across steps, after a false start), held from the next token on; a resumed
    request picks up where its tokens say."""
    from lantau.model.source import load_tokenizer, resolve_model_source
    from lantau.structured import Grammars, tokenizer_json

    tokenizer = load_tokenizer(resolve_model_source("random:tiny"))
    grammars = Grammars(lambda: tokenizer_json(tokenizer), len(tokenizer), [0])
    grammars.add("r", {"json_object": True}, [], after=(5, 6))
    for token in (5, 7, 5):
        grammars.consume("r", token)
        assert not grammars.constrains("r")
    grammars.consume("r", 6)
    assert grammars.constrains("r")
    grammars.add("resumed", {"json_object": True}, [9, 5, 6], after=(5, 6))
    grammars.add("still", {"json_object": True}, [9, 5], after=(5, 6))
    assert grammars.constrains("resumed") and not grammars.constrains("still")
    grammars.consume("still", 6)
    assert grammars.constrains("still")
    mask = grammars.masks(["r"])[0]
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    allowed = [(int(mask[t // 32]) >> (t % 32)) & 1 for t in (brace, letter)]
    assert allowed == [1, 0]  # a JSON object opens with a brace
    grammars.drop("r")
    assert "r" not in grammars.matchers and "r" not in grammars.waiting


def test_engine_samples_freely_until_the_thinking_ends():
    """Offline on random:tiny: a token forced by a logit bias plays the end of thinking; the
    grammar holds only after it, and the rest is the schema's JSON."""
    from lantau import LLM, SamplingParams

    llm = LLM("random:tiny", device="cpu", num_kv_blocks=64, max_model_len=256)
    end = llm.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={end: 100},
                            structured_outputs={"json": schema}, grammar_after=(end,))  # fmt: skip
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
    assert out.token_ids[0] == end  # free: the bias won
    answer = llm.tokenizer.decode(out.token_ids[1:], skip_special_tokens=True)
    assert json.loads(answer) in ({"ok": True}, {"ok": False}) and out.finish_reason == "stop"
    at_once = SamplingParams(temperature=0, max_tokens=30, logit_bias={end: 100},
                             structured_outputs={"json": schema})  # fmt: skip
    held = llm.generate({"prompt_token_ids": [5, 6, 7]}, at_once)[0].outputs[0]
    assert held.token_ids[0] != end and json.loads(held.text) in ({"ok": True}, {"ok": False})


def test_streamed_split_adds_up_to_the_whole():
    """Whatever the text and wherever the chunks end, the thinking and the answer as a stream
    sees them (each prefix split with final=False, what was said never taken back) add up to
    the whole text's split: the property the chat stream's deltas rest on."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n"])
    texts = st.lists(pieces, max_size=12).map("".join)

    @settings(max_examples=1000, deadline=None)
    @given(text=texts, cuts=st.lists(st.integers(0, 60), max_size=6), name=st.sampled_from(
        ["deepseek_r1", "qwen3"]))  # fmt: skip
    def check(text: str, cuts: list[int], name: str) -> None:
        parser = reasoning_parser(name)
        said_reasoning, said_content = "", ""
        for cut in sorted({c for c in cuts if c < len(text)}):
            split = parser.split(text[:cut], final=False)
            reasoning, content = split.reasoning or "", split.content or ""
            assert reasoning.startswith(said_reasoning) and content.startswith(said_content)
            said_reasoning, said_content = reasoning, content
        whole = parser.split(text)
        assert (whole.reasoning or "").startswith(said_reasoning)
        assert (whole.content or "").startswith(said_content)

    check()


def test_grammars_on_a_model_larger_than_its_borrowed_tokenizer():
    """A random Llama 3 shape (128,256 ids, end token 128001) borrowing SmolLM2's 49,152-token
    tokenizer: the matcher takes the tokenizer's own end token instead of refusing (found on
    an H100: gpu_features.py's structured outputs on random:llama3.2-1b)."""
    from lantau.model.source import load_tokenizer, resolve_model_source
    from lantau.structured import Grammars, tokenizer_json

    tokenizer = load_tokenizer(resolve_model_source("random:tiny"))
    grammars = Grammars(lambda: tokenizer_json(tokenizer), 128256, [128001])
    grammars.prepare()
    grammars.add("r", {"json_object": True}, [])
    mask = grammars.masks(["r"])[0]
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert mask.shape == ((128256 + 31) // 32,) and (int(mask[brace // 32]) >> (brace % 32)) & 1
    # ids past the tokenizer spell nothing the grammar can check: never allowed (found on the
    # H200: random:llama3.2-1b's JSON-schema answers left their enum through such ids, which
    # the detokenizer spells as id mod 49,152)
    assert len(tokenizer) == 49152 and not mask[49152 // 32 :].any()
    grammars.consume("r", brace)
    assert not grammars.masks(["r"])[0][49152 // 32 :].any()
