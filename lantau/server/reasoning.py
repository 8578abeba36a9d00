"""A reasoning model's thinking apart from its answer (`lantau serve --reasoning-parser NAME`,
vLLM's flag and names): the chat routes return it as `reasoning_content` (vLLM's field; also
as `reasoning`, its newer name) beside the `content`, streamed as its own deltas, and the
Responses API as a `reasoning` output item.

- `deepseek_r1` (DeepSeek-R1 and its Llama / Qwen distills): the answer follows the first
  `</think>`; the thinking before it may open with `<think>` or not (newer templates put the
  opening tag in the prompt). Cut before `</think>` (max_tokens), everything is thinking.
- `qwen3`: `<think>...</think>` only where the model opened it; an answer without one is
  all content (thinking switched off).

Tool calls and stop strings are read from the answer only. With `deepseek_r1`, a grammar
(structured outputs, a forced tool call) holds from the end of the thinking on (the engine
core's matcher waits for the `</think>` tokens: `SamplingParams.grammar_after`).
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS: dict[str, type[ReasoningParser]] = {}


@dataclass(frozen=True)
class Split:
    """A text as thinking and answer: `content` None while the thinking has not ended."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    implicit_start = True  # the text may begin inside the thinking, without `start`
    # a grammar (structured outputs, a forced call) holds from the end of thinking on: for
    # models that always think (not those whose thinking may be switched off)
    grammar_after_thinking = True

    def __init_subclass__(cls) -> None:
        PARSERS[cls.name] = cls

    def split(self, text: str, final: bool = True) -> Split:
        """The text's thinking and answer. Not `final` (streaming), what may be the start of
        the end tag stays out of the thinking until the next tokens say."""
        body = text
        stripped = text.lstrip()
        # NOTE: a text that may yet be the opening tag (blanks before it too) says nothing
        # until it is whole
        if not final and stripped != self.start and self.start.startswith(stripped):
            return Split("" if self.implicit_start else None, None)
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif not self.implicit_start:
            return Split(None, text)
        reasoning, found, content = body.partition(self.end)
        if found:
            return Split(reasoning, content)
        if not final:
            reasoning = reasoning[: len(reasoning) - _partial_suffix(reasoning, self.end)]
        return Split(reasoning, None)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"


class Qwen3(ReasoningParser):
    name = "qwen3"
    implicit_start = False
    grammar_after_thinking = False


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser `--reasoning-parser` names (None: none); ValueError for an unknown name."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(PARSERS)}")
    return PARSERS[name]()
