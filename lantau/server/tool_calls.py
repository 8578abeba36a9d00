"""Tool calls in a chat model's text: OpenAI's `tools` on `/v1/chat/completions`, with
`lantau serve --enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags and parser
names). The tools go to the chat template (`tools=`, as HF templates take them); the model's
answer is read back for calls in its model family's format:

- `hermes` (Qwen2.5, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks, the text before the first one the message's content (none if blank);
- `llama3_json` (Llama 3.1 and later): the whole answer is one JSON object `{"name": ...,
  "parameters": {...}}` or several separated by `;`, optionally after `<|python_tag|>`.

A call must name one of the request's tools with object arguments, or the answer is plain
text (content), as it was written. Streamed, the text that may start a call is held back
until the answer ends; its calls then come in one chunk (`delta.tool_calls`, finish reason
`tool_calls`). `tool_choice` "required" or a named function forces one call: the answer is
held to a grammar of the parser's format around a JSON schema of the tools' parameters
(`ToolParser.forced`, through lantau/structured.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS: dict[str, type[ToolParser]] = {}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


def _call_of(obj, names: set[str], arguments_key: str) -> ToolCall | None:
    """A decoded object as a call of one of `names`, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def call_schema(tools: list[dict], names: list[str], arguments_key: str) -> dict:
    """The JSON schema of one call of one of `names` (OpenAI-shaped `tools`), its arguments
    under `arguments_key` following that tool's parameters, written as json.dumps does."""
    from lantau.structured import JSON_OPTIONS

    by_name = {t["function"]["name"]: t["function"] for t in tools}
    calls = []
    for name in names:
        parameters = by_name[name].get("parameters") or {"type": "object"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })  # fmt: skip
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"x-guidance": JSON_OPTIONS, **schema}


class ToolParser:
    name = ""

    def forced(self, tools: list[dict], names: list[str]) -> dict:
        """A structured_outputs spec whose every answer is one call of one of `names` in this
        format (`tool_choice` "required" or a named function)."""
        raise NotImplementedError

    def __init_subclass__(cls) -> None:
        PARSERS[cls.name] = cls

    def extract(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        """(the message's content, its calls); no calls: (text, [])."""
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        """How many leading characters of an unfinished answer may be sent now (the rest may
        be, or start, a call)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def forced(self, tools: list[dict], names: list[str]) -> dict:
        schema = json.dumps(call_schema(tools, names, "arguments"))
        return {"grammar": f'start: "{self.START}\\n" call "\\n{self.END}"\ncall: %json {schema}'}

    def extract(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        first = text.find(self.START)
        if first < 0:
            return text, []
        calls = []
        for block in self.BLOCK.findall(text[first:]):
            try:
                call = _call_of(json.loads(block), names, "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:first], calls

    def streamable(self, text: str) -> int:
        first = text.find(self.START)
        if first >= 0:
            return first
        for k in range(len(self.START) - 1, 0, -1):  # the end may start the marker
            if text.endswith(self.START[:k]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def forced(self, tools: list[dict], names: list[str]) -> dict:
        return {"json": call_schema(tools, names, "parameters")}

    def extract(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call_of(obj, names, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return text, []
            at = len(body) - len(rest) + (1 if rest else 0)
            while at < len(body) and body[at].isspace():
                at += 1
        return "", calls

    def streamable(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # it may be a call: held back whole
        return len(text)


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser `--tool-call-parser` names (None: none); ValueError for an unknown name."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(PARSERS)}")
    return PARSERS[name]()
