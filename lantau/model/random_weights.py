"""Named model shapes for random weights (`random:NAME`): benchmarks and tests.

Speed does not depend on weight values, so these stand in for real checkpoints of the same
shape; they are generated directly on the target device in the target dtype.
"""

from __future__ import annotations

import dataclasses

from lantau.config import ModelConfig, RopeScaling
from lantau.errors import ModelLoadError

_LLAMA3_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

RANDOM_SHAPES: dict[str, ModelConfig] = {
    # vocab of SmolLM2's tokenizer, so text prompts work with its tokenizer
    "tiny": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama3.2-1b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=dataclasses.replace(_LLAMA3_ROPE, factor=32.0),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "llama3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "llama3-70b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
}


def random_model_config(name: str) -> ModelConfig:
    try:
        return RANDOM_SHAPES[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown random shape {name!r}; known: {', '.join(sorted(RANDOM_SHAPES))}"
        ) from None
