"""Structured outputs: a request's tokens held to a grammar (a JSON schema, any JSON object, a
regex, a choice of strings, or a Lark grammar) through llguidance.

`SamplingParams.structured_outputs` names the grammar as vLLM's does (`{"json": schema}`,
`{"json_object": True}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": Lark or GBNF}`); the
OpenAI routes map `response_format` onto it. `grammar_of` turns it into llguidance's grammar
and checks it (a bad schema or regex is an InvalidRequestError naming the field), in the
frontend and again in the engine core, which holds one matcher a request (`Grammars`): before
each sampling, each constrained row's bitmask of the tokens its grammar allows next (EOS once
the grammar is complete); after each step, the sampled token consumed. The masks are applied
with the other logit processing (sampler.py), so a constrained batch never takes the CUDA
graph's greedy pick.

The core builds llguidance's tokenizer once, at the first constrained request (the model's
tokenizer.json; about a second for a 128k vocabulary), from the model's own tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lantau.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it, no free whitespace (a weak model's runs of it never end the
# object); a schema's own "x-guidance" options override these
JSON_OPTIONS = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True
}  # fmt: skip


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(FIELD, "needs the llguidance package") from None
    return llguidance


def grammar_of(spec: Any) -> str:
    """llguidance's grammar for a structured_outputs spec; InvalidRequestError if the spec or
    its grammar is not valid."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise InvalidRequestError(FIELD, f"must name exactly one of {', '.join(KINDS)}")
    ((kind, value),) = spec.items()
    llg = _llguidance()
    matcher = llg.LLMatcher
    try:
        if kind == "json":
            if not isinstance(value, dict | str):
                raise InvalidRequestError(FIELD, "json: expected a JSON schema (an object)")
            grammar = matcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError(FIELD, "json_object: expected true")
            grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise InvalidRequestError(FIELD, "choice: expected non-empty strings")
            grammar = matcher.grammar_from_regex("|".join(re.escape(c) for c in value))
        elif not isinstance(value, str) or not value:
            raise InvalidRequestError(FIELD, f"{kind}: expected a non-empty string")
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(value)
        else:  # Lark, or GBNF (llama.cpp's and xgrammar's EBNF) taken to Lark
            from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

            try:
                grammar = matcher.grammar_from_lark(any_to_lark(value))
            except GbnfToLarkError as e:
                raise InvalidRequestError(FIELD, f"{kind}: {e}") from None
        error = matcher.validate_grammar(grammar)
    except InvalidRequestError:
        raise
    except ValueError as e:  # a schema that is not valid JSON
        raise InvalidRequestError(FIELD, f"{kind}: {e}") from None
    except BaseException as e:  # NOTE: a Rust panic in llguidance is a BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise InvalidRequestError(FIELD, f"{kind}: the grammar library could not read it") from None
    if error:
        raise InvalidRequestError(FIELD, f"{kind}: {error.splitlines()[0][:300]}")
    return grammar


class Grammars:
    """The engine core's matchers, one a constrained request, over one llguidance tokenizer
    made on first use from `tokenizer_json()` (the model's tokenizer.json as text)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos: list[int]):
        self._tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, eos
        self._tokenizer = None
        self.matchers: dict[str, Any] = {}
        # requests whose grammar starts once their output ends with a token sequence (a
        # reasoning model's end of thinking): that sequence and the output's latest tokens
        self.waiting: dict[str, tuple[tuple[int, ...], list[int]]] = {}

    def prepare(self) -> None:
        """Make the tokenizer now if not yet (a constrained request arrived):
        InvalidRequestError if it cannot be made."""
        try:
            self._llg_tokenizer()
        except InvalidRequestError:
            raise
        except Exception as e:  # a tokenizer llguidance cannot read
            raise InvalidRequestError(FIELD, f"this model's tokenizer: {e}") from None

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            text = self._tokenizer_json()
            # NOTE: a random model's end token may lie past the tokenizer it borrows (a
            # 128,256-token Llama 3 shape on SmolLM2's 49,152): the tokenizer's own ends then
            data = json.loads(text)
            eos = [e for e in self.eos if e < _tokenizer_size(data)] or _tokenizer_eos(data)
            self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def add(
        self, request_id: str, spec: dict, done: list[int], after: tuple[int, ...] = ()
    ) -> None:
        """A matcher for the request, past the output tokens it has already (a resumed
        request's); with `after`, the grammar holds only once the output has ended with those
        tokens (until then the request samples freely)."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._llg_tokenizer(), grammar_of(spec), log_level=0)
        self.matchers[request_id] = matcher
        if after:
            start = _past(done, after)
            if start is None:
                self.waiting[request_id] = (tuple(after), list(done[-len(after) :]))
                return
            done = done[start:]
        if done:
            matcher.consume_tokens(done)

    def constrains(self, request_id: str) -> bool:
        """Whether the request's next token is held to its grammar now."""
        return request_id in self.matchers and request_id not in self.waiting

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def consume(self, request_id: str, token_id: int) -> None:
        waiting = self.waiting.get(request_id)
        if waiting is not None:
            after, latest = waiting
            latest.append(token_id)
            del latest[: -len(after)]
            if tuple(latest) == after:  # the grammar holds from the next token on
                del self.waiting[request_id]
            return
        matcher = self.matchers.get(request_id)
        if matcher is not None:
            matcher.consume_token(token_id)

    def masks(self, request_ids: list[str]) -> torch.Tensor:
        """[len(request_ids), words] int32 on the host: bit t of a row allows token t next.
        A matcher in an error state allows only EOS (the request then ends)."""
        import torch  # NOTE: not llguidance.torch: its import compiles with torch.jit

        words = (self.vocab_size + 31) // 32
        masks = torch.full((len(request_ids), words), -1, dtype=torch.int32)
        for row, request_id in enumerate(request_ids):
            matcher = self.matchers[request_id]
            if matcher.is_error():
                masks[row] = 0
                for eos in self.eos:  # NOTE: int32 words: bit 31 is the sign
                    bit = 1 << (eos % 32)
                    masks[row, eos // 32] |= bit if bit < 1 << 31 else -(1 << 31)
                continue
            matcher.unsafe_compute_mask_ptr(masks[row].data_ptr(), words * 4)  # its row's words
        return masks


def _tokenizer_size(data: dict) -> int:
    """How many ids a tokenizer.json (decoded) names: its vocabulary's and its added tokens'."""
    vocab = (data.get("model") or {}).get("vocab") or {}
    added = [t["id"] for t in data.get("added_tokens") or () if isinstance(t.get("id"), int)]
    return max([len(vocab), *(i + 1 for i in added)])


def _tokenizer_eos(data: dict) -> list[int]:
    """A tokenizer.json's (decoded) own end-of-text tokens (added tokens named so)."""
    names = ("<|endoftext|>", "<|im_end|>", "</s>", "<|end_of_text|>", "<|eot_id|>")
    return [t["id"] for t in data.get("added_tokens") or () if t.get("content") in names][:2]


def _past(tokens: list[int], seq: tuple[int, ...]) -> int | None:
    """The index just past the first occurrence of `seq` in `tokens`, or None."""
    n = len(seq)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i : i + n]) == seq:
            return i + n
    return None


def tokenizer_json(tokenizer) -> str:
    """An HF fast tokenizer's tokenizer.json, as text, a byte-level BPE's made plain: some
    transformers versions (5.17) convert a GGUF's GPT-2-style tokenizer (SmolLM2's) with
    byte fallback and a decoder sequence of ByteFallback, Replace and ByteLevel; llguidance
    then takes a token its mask allowed as an error once it reads it (' "' after '":' in a
    JSON schema), so the grammar's request ended on its end token (found on the H200)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
    return _plain_byte_level(backend.to_str())


def _plain_byte_level(text: str) -> str:
    if '"ByteFallback"' not in text:  # the plain form: no second decode of megabytes
        return text
    data = json.loads(text)
    pre, decoder, model = data.get("pre_tokenizer") or {}, data.get("decoder") or {}, data["model"]
    byte_level = [d for d in decoder.get("decoders") or () if d.get("type") == "ByteLevel"]
    if pre.get("type") != "ByteLevel" or decoder.get("type") != "Sequence" or not byte_level:
        return text
    data["decoder"] = byte_level[0]
    model["byte_fallback"] = False
    return json.dumps(data)


def model_tokenizer_json(source) -> str:
    """A model source's tokenizer.json as text (the engine core's and its workers'
    `Grammars`); InvalidRequestError if the model has no tokenizer."""
    from lantau.model.source import load_tokenizer

    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise InvalidRequestError(FIELD, "this model has no tokenizer")
    return tokenizer_json(tokenizer)
