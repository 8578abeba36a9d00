"""OpenAI tool calling (`--enable-auto-tool-choice --tool-call-parser`): the parsers on known
texts, and the real app under uvicorn driven by the official `openai` client, with an engine
whose answers are scripted (a random model writes no calls) and a real tokenizer whose chat
template renders the tools and earlier calls."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import openai
import pytest

from lantau.bench.echo_engine import EchoEngine
from lantau.outputs import CompletionOutput, RequestOutput
from lantau.server.app import ServerConfig, build_app
from lantau.server.tool_calls import tool_parser
from tests.servers import app_server, lantau_serve

NAMES = {"get_weather", "lookup_order"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


# -- the parsers ----------------------------------------------------------------------------


def test_hermes_blocks_content_and_what_is_not_a_call():
    hermes = tool_parser("hermes")
    text = (
        f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n"
        '<tool_call>{"name": "lookup_order", "arguments": {"id": 7}}'
    )
    content, calls = hermes.extract(text, NAMES)  # the last block unclosed: the answer ended
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("lookup_order", {"id": 7}),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    for plain in (
        "no call here",
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a tool
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
    ):
        assert hermes.extract(plain, NAMES) == (plain, [])
    # what may be sent while the answer runs: up to a call, or a marker's possible start
    assert hermes.streamable("Sure, <tool_call>{") == len("Sure, ")
    assert hermes.streamable("Sure <tool") == len("Sure ")
    assert hermes.streamable("Sure <b>") == len("Sure <b>")


def test_llama3_json_calls():
    llama = tool_parser("llama3_json")
    two = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "lookup_order", "parameters": {"note": "a;b}"}}'
    )
    content, calls = llama.extract(two, NAMES)
    assert content == "" and [c.name for c in calls] == ["get_weather", "lookup_order"]
    assert json.loads(calls[1].arguments) == {"note": "a;b}"}
    assert llama.extract(f"  {CALL}\n", NAMES)[1][0].name == "get_weather"  # arguments too
    for plain in (
        "Paris is sunny.",
        '{"name": "get_weather", "parameters": {}} and more',
        '{"answer": 42}',
        '{"name": "get_weather", "parameters": {}}; oops',
    ):
        assert llama.extract(plain, NAMES) == (plain, [])
    assert [llama.streamable(t) for t in ("", "  {", "<|py", "Hello")] == [0, 0, 0, 5]
    with pytest.raises(ValueError, match="unknown tool call parser 'x'"):
        tool_parser("x")


def test_forced_calls_follow_the_parsers_format_on_a_real_server():
    """tool_choice "required" or a named function on `lantau serve random:tiny` with each
    parser: a random model's answer is still one call of a given tool, its arguments following
    the tool's parameters, read back as tool_calls."""
    import httpx

    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "lookup_order", "parameters": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                    "maximum": 99}},
            "required": ["id"], "additionalProperties": False}}},
    ]  # fmt: skip
    for parser in ("hermes", "llama3_json"):
        flags = ("--enable-auto-tool-choice", "--tool-call-parser", parser)
        with lantau_serve("random:tiny", *flags, num_kv_blocks=64) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
            messages = [{"role": "user", "content": "Where is my order?"}]
            for choice, names in (
                ("required", {"get_weather", "lookup_order"}),
                ({"type": "function", "function": {"name": "lookup_order"}}, {"lookup_order"}),
            ):
                for seed in range(3):
                    reply = client.chat.completions.create(
                        model="random:tiny", messages=messages, tools=tools, tool_choice=choice,
                        temperature=1.0, seed=seed, max_tokens=60,
                    ).choices[0]  # fmt: skip
                    assert reply.finish_reason == "tool_calls", (parser, reply)
                    (call,) = reply.message.tool_calls
                    arguments = json.loads(call.function.arguments)
                    assert call.function.name in names
                    if call.function.name == "lookup_order":
                        assert 0 <= arguments["id"] <= 99
                    else:
                        assert arguments["city"] in ("Paris", "Rome")
            assert httpx.get(f"{base}/status").json()["num_running"] == 0


def test_serve_takes_the_two_flags_together():
    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        run = subprocess.run(
            [sys.executable, "-m", "lantau.cli", "serve", "random:tiny", *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2 and "go together" in run.stderr


# -- served ---------------------------------------------------------------------------------

# a template in the shape of Hermes/Qwen ones: the tools' signatures in the system turn, an
# assistant's earlier calls with their arguments read as an object, tools' answers
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}: "
    "{{ tool.function.description }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}{%- if m.tool_calls %}"
    "{% for call in m.tool_calls %} call {{ call.function.name }}"
    "(city={{ call.function.arguments.city }}){% endfor %}{% endif %}"
    "{%- if m.content %} {{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ANSWERS = {  # the last user message -> the model's scripted answer
    "weather?": f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
    "two calls": f"<tool_call>{CALL}</tool_call>"
    '<tool_call>{"name": "lookup_order", "arguments": {"id": 7}}</tool_call>',
    "hello": "Hello! <b>How</b> can I help?",
    "fake": '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
}


class ScriptedChat(EchoEngine):
    """EchoEngine with a real tokenizer and a tools-aware template, answering each
    conversation from `script` (last user message -> answer, or (answer, finish reason);
    default ANSWERS) three characters a step; keeps the prompts it rendered."""

    def __init__(self, script: dict | None = None) -> None:
        super().__init__()
        self.script = ANSWERS if script is None else script
        from lantau.model.source import load_tokenizer, resolve_model_source

        self.tokenizer = load_tokenizer(resolve_model_source("random:tiny"))
        self.tokenizer.chat_template = TEMPLATE
        self.rendered: list[str] = []
        self.answers: dict[int, str] = {}

    async def encode_chat(self, conversation, tools=None, **options) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True
        )
        self.rendered.append(text)
        user = [m["content"] for m in conversation if m["role"] == "user"][-1]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.answers[len(ids)] = self.script[user]
        return ids

    async def generate(self, request_id, prompt, params, priority=0):
        text = self.answers[len(prompt["prompt_token_ids"])]
        text, reason = (text, "stop") if isinstance(text, str) else text
        output = RequestOutput(request_id, None, prompt["prompt_token_ids"])
        output.outputs = [CompletionOutput(0, "", [], None)]
        for at in range(0, len(text), 3):
            await asyncio.sleep(0)
            seq = output.outputs[0]
            seq.text, seq.token_ids = text[: at + 3], [*seq.token_ids, 1]
            if at + 3 >= len(text):
                seq.finish_reason, output.finished = reason, True
            yield output


@pytest.fixture(scope="module")
def served():
    engine = ScriptedChat()
    config = ServerConfig(grpc_port=0, tool_call_parser="hermes")
    with app_server(build_app(engine, config)) as base:
        yield engine, openai.OpenAI(base_url=f"{base}/v1", api_key="x")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }},
    {"type": "function", "function": {"name": "lookup_order", "description": "an order"}},
]  # fmt: skip


def ask(client, content: str, **kwargs):
    return client.chat.completions.create(
        model="lantau", messages=[{"role": "user", "content": content}], tools=TOOLS, **kwargs
    )


def test_calls_read_back_and_the_tools_rendered(served):
    engine, client = served
    reply = ask(client, "weather?").choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content == "Let me check.\n"
    (call,) = reply.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert "get_weather: the weather in a city lookup_order: an order" in engine.rendered[-1]
    both = ask(client, "two calls").choices[0].message
    assert both.content is None and [c.function.name for c in both.tool_calls] == [
        "get_weather", "lookup_order"
    ]  # fmt: skip
    for plain in ("hello", "fake"):  # no call, or a call of no tool given: plain text
        reply = ask(client, plain).choices[0]
        assert reply.message.content == ANSWERS[plain] and not reply.message.tool_calls
        assert reply.finish_reason == "stop"
    # the next turn: the assistant's call (arguments as OpenAI sends them, text) and the
    # tool's answer go to the template, the arguments as an object
    follow = client.chat.completions.create(
        model="lantau", tools=TOOLS,
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
            {"role": "user", "content": "hello"},
        ],
    )  # fmt: skip
    assert follow.choices[0].message.content == ANSWERS["hello"]
    assert "assistant call get_weather(city=Paris)" in engine.rendered[-1]
    assert "tool 18 C, sunny" in engine.rendered[-1]


def test_streamed_calls_come_whole_at_the_end(served):
    _, client = served
    chunks = list(ask(client, "weather?", stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check.\n"  # the call's text never streamed as content
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    plain = list(ask(client, "hello", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    assert text == ANSWERS["hello"] and len(plain) > 3  # streamed as it came, not at the end


def test_tool_choice_none_and_what_is_refused(served):
    engine, client = served
    reply = ask(client, "weather?", tool_choice="none").choices[0]
    assert reply.message.content == ANSWERS["weather?"] and not reply.message.tool_calls
    assert "Tools:" not in engine.rendered[-1]  # none: the tools are not rendered
    for kwargs, param in (
        (dict(tool_choice="always"), "tool_choice"),
        (dict(tool_choice={"type": "function", "function": {"name": "launch"}}),
         "tool_choice.function.name"),
        (dict(tool_choice="required", tools=[]), "tool_choice"),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    ):  # fmt: skip
        args = dict(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS) | kwargs
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="lantau", **args)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="lantau", tools=TOOLS,
            messages=[{"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{broken"}}]}],
        )  # fmt: skip
    assert e.value.body["param"] == "messages[0].tool_calls[0].function.arguments"
