"""Random-weight models borrow the default model's tokenizer: ids past its vocabulary still
spell text (as id mod its size), so every token streams as a real model's would."""

from __future__ import annotations

import pytest

from lantau.engine.detokenizer import IncrementalDetokenizer
from lantau.model.source import (
    ModelSource,
    borrowed_vocab_size,
    load_tokenizer,
    read_model_config,
    resolve_model_source,
)
from lantau.request import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_source("random:tiny"))


def test_only_random_models_larger_than_their_tokenizer_fold(tokenizer):
    big = resolve_model_source("random:llama3-8b")  # 128,256 ids; the tokenizer spells 49,152
    assert borrowed_vocab_size(big, read_model_config(big), tokenizer) == len(tokenizer) == 49152
    tiny = resolve_model_source("random:tiny")  # the tokenizer's own size: nothing to fold
    assert borrowed_vocab_size(tiny, read_model_config(tiny), tokenizer) is None
    hf = ModelSource("hf", None, "some/folder")  # a real model's ids are its tokenizer's
    assert borrowed_vocab_size(hf, read_model_config(big), tokenizer) is None
    assert borrowed_vocab_size(big, read_model_config(big), None) is None


def test_ids_past_the_tokenizer_spell_text_when_folded(tokenizer):
    ids = tokenizer.encode("Hello world, streaming", add_special_tokens=False)
    past = [i + len(tokenizer) for i in ids]
    plain = IncrementalDetokenizer(tokenizer, SamplingParams(), [])
    folded = IncrementalDetokenizer(tokenizer, SamplingParams(), [], fold_ids_at=len(tokenizer))
    deltas = []
    for token_id in past:
        plain.add_token(token_id)
        before = folded.text
        folded.add_token(token_id)
        deltas.append(folded.text[len(before) :])
    assert plain.text == ""  # what a client saw before: no text, no chunk
    assert folded.text == "Hello world, streaming" and all(deltas)  # one delta a token
