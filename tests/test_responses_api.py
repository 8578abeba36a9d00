"""OpenAI's Responses API through the official client: on a real `lantau serve`, a response is
the chat completion of the same conversation (text, usage, length cut as `incomplete`),
streamed as OpenAI's typed events whose deltas add up to it, with structured outputs; with
tools (a scripted engine, the hermes parser), function calls come back as items and earlier
calls and their outputs go to the template; what needs storage or hosted tools is refused
by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.servers import lantau_serve
from tests.test_openai_server import SCHEMA

# the scripted engine behind the hermes parser, on uvicorn (a fixture)
from tests.test_tool_calls import ANSWERS, served  # noqa: F401

MODEL = "random:tiny"


@pytest.fixture(scope="module")
def server():
    with lantau_serve(MODEL) as (base, _):
        yield base


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x")


def chat_text(client, messages: list[dict], **extra) -> tuple[str, object]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           **extra)  # fmt: skip
    return reply.choices[0].message.content, reply


def test_response_is_the_chat_completion_of_its_conversation(client):
    """A string input is one user message; instructions a system message before the input;
    a list of items (developer as system, an assistant's earlier output_text) is the
    conversation; greedy text and token counts equal the chat route's, and a length cut is
    `incomplete` with reason max_output_tokens."""
    r = client.responses.create(model=MODEL, input="Where is my parcel?", max_output_tokens=6,
                                temperature=0)  # fmt: skip
    text, chat = chat_text(client, [{"role": "user", "content": "Where is my parcel?"}],
                           max_tokens=6)  # fmt: skip
    assert r.object == "response" and r.output_text == text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == chat.usage.total_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"

    conversation = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Where is my parcel?"},
    ]  # fmt: skip
    r = client.responses.create(model=MODEL, instructions="Be kind.", input=conversation,
                                max_output_tokens=5, temperature=0)  # fmt: skip
    text, _ = chat_text(client, [
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Where is my parcel?"},
    ], max_tokens=5)  # fmt: skip
    assert r.output_text == text and r.instructions == "Be kind."


def test_stream_events_add_up_to_the_response(client):
    """OpenAI's event order, numbered; the deltas are the unstreamed text; the last event
    carries the whole response."""
    kwargs = dict(model=MODEL, input="Where is my parcel?", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert (
        events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 8
    )


def test_text_format_json_schema(client):
    """text.format json_schema holds the answer to the schema: the chat route's answer under
    the same response_format."""
    fmt = {"type": "json_schema", "name": "reply", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Is it raining?", max_output_tokens=40,
                                temperature=0, text={"format": fmt})  # fmt: skip
    value = json.loads(r.output_text)
    assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9
    chat_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "Is it raining?"}]
    text, _ = chat_text(client, messages, max_tokens=40, response_format=chat_format)
    assert r.output_text == text and r.status == "completed" and r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),  # no --tool-call-parser
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)  # fmt: skip
def test_unserved_fields_refused_by_name(client, extra, field):
    body = {"model": MODEL, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    assert e.value.body["param"] == field, e.value.body


def test_fields_set_to_nothing_are_accepted(client):
    """What agent frameworks send unset (reasoning with null effort, an empty include, store)
    is not a refusal."""
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=True,
                                reasoning={"effort": None, "summary": None}, include=[],
                                truncation="disabled", metadata={"ticket": "42"})  # fmt: skip
    assert r.status == "incomplete" and r.metadata == {"ticket": "42"}


def test_nothing_is_stored(server):
    r = httpx.get(f"{server}/v1/responses/resp_123")
    assert r.status_code == 404 and "stores no responses" in r.json()["error"]["message"]


TOOLS = [
    {"type": "function", "name": "get_weather", "description": "the weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "function", "name": "lookup_order", "description": "an order"},
]  # fmt: skip


def test_function_calls_as_items_and_back(served):  # noqa: F811 - pytest fixture
    """Function tools reach the template; the answer's calls come back as function_call items
    after the message, streamed as their own items; the next turn's function_call and
    function_call_output items render as the assistant's call and the tool's answer."""
    engine, client = served
    r = client.responses.create(model="lantau", input="weather?", tools=TOOLS)
    message, call = r.output
    assert message.type == "message" and r.output_text == "Let me check.\n"
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert "get_weather: the weather in a city lookup_order: an order" in engine.rendered[-1]
    two = client.responses.create(model="lantau", input="two calls", tools=TOOLS)
    assert [o.type for o in two.output] == ["function_call", "function_call"]
    assert [o.name for o in two.output] == ["get_weather", "lookup_order"]

    events = list(client.responses.create(model="lantau", input="weather?", tools=TOOLS,
                                          stream=True))  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me check.\n"  # the call's markup never streamed as text
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris", "unit": "C"}
    assert events[-1].type == "response.completed" and len(events[-1].response.output) == 2

    follow = client.responses.create(model="lantau", tools=TOOLS, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        {"role": "user", "content": "hello"},
    ])  # fmt: skip
    assert follow.output_text == ANSWERS["hello"]
    assert "assistant call get_weather(city=Paris)" in engine.rendered[-1]
    assert "tool 18 C, sunny" in engine.rendered[-1]


def test_forced_unknown_function_named(served):  # noqa: F811 - pytest fixture
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="lantau", input="hello", tools=TOOLS,
                                tool_choice={"type": "function", "name": "nope"})  # fmt: skip
    assert e.value.body["param"] == "tool_choice.name"


def test_fuzz_any_body_is_an_answer_or_a_named_4xx(server):
    """Any body, plausible or not (items, tools, formats, tool choices of every shape): a
    response or a 4xx with a message, never a 5xx; the server answers after."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.strategies import json_values

    anything = json_values()
    text = st.sampled_from(["input_text", "output_text", "refusal", "input_image", "x"])
    part = st.fixed_dictionaries({"type": text}, optional={"text": anything, "refusal": anything})
    item = st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"])
        | anything,
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | anything,
        "content": st.text(max_size=8) | st.lists(part, max_size=2) | anything,
        "call_id": st.text(max_size=4) | anything, "name": st.text(max_size=4) | anything,
        "arguments": st.text(max_size=8) | anything, "output": st.text(max_size=8) | anything,
    })  # fmt: skip
    tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | anything},
                                 optional={"name": anything, "parameters": anything})  # fmt: skip
    fields = st.fixed_dictionaries(
        {
            "max_output_tokens": st.integers(1, 2) | anything,
            "input": st.text(max_size=8) | st.lists(item, min_size=1, max_size=3) | anything,
        },
        optional={
            "instructions": anything, "temperature": anything, "top_p": anything,
            "tools": st.lists(tool, max_size=2) | anything,
            "tool_choice": st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries({"type": anything, "name": anything}) | anything,
            "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                optional={"schema": anything, "name": anything})}) | anything,
            "reasoning": anything, "include": anything, "store": anything, "metadata": anything,
            "previous_response_id": anything, "truncation": anything, "stream": st.just(False),
        },
    )  # fmt: skip
    # NOTE: json, not orjson: integers past 64 bits and NaN too
    bodies = st.one_of(fields.map(lambda b: json.dumps(b).encode()), st.binary(max_size=32))
    client = httpx.Client(timeout=30)
    answered: list[int] = []

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def fuzz(body: bytes) -> None:
        r = client.post(f"{server}/v1/responses", content=body)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code != 200:
            assert "message" in r.json()["error"]
        answered.append(r.status_code)

    fuzz()
    assert 200 in answered and len(set(answered)) > 1
    ok = client.post(f"{server}/v1/responses", json={"input": "still here", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def test_official_client_parse_with_a_pydantic_model(client):
    """The client's `responses.parse(text_format=Model)`: its strict JSON schema holds the
    answer, and the client reads it back as the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reply(BaseModel):
        answer: Literal["yes", "no"]
        n: int = Field(ge=0, le=9)

    r = client.responses.parse(model=MODEL, input="Is it raining?", text_format=Reply,
                               max_output_tokens=40, temperature=0)  # fmt: skip
    assert isinstance(r.output_parsed, Reply) and r.status == "completed"
