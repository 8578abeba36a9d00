"""One frozen config tree, built once at the edge (`LLM(...)`, the CLI) and passed down.

A value found at run time (the number of KV blocks after memory profiling) makes a new object
with `dataclasses.replace`; nothing here is mutated after construction.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# "auto": the model's dtype; "fp8": e4m3 (float8_e4m3fn), half a bf16 cache's bytes a token
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}")
        return cls(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


# None: weights in the engine's dtype; "fp8": e4m3 linear weights (ModelConfig.quantization)
QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # "fp8": every decoder layer's linear weights in e4m3 with one scale an output channel,
    # activations quantized per token (lantau/model/fp8.py); embedding, norms and lm_head in the
    # engine's dtype. None: every weight in the engine's dtype. Set by `dtype="fp8"`
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def check_split(self, num_ranks: int) -> None:
        """ValueError naming the first size that tensor parallelism over `num_ranks` cannot
        split evenly (lantau/model/parallel.py: each rank its heads, columns, vocabulary)."""
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "vocab_size"):  # fmt: skip
            if getattr(self, name) % num_ranks:
                raise ValueError(
                    f"tensor_parallel_size {num_ranks} does not divide {name} "
                    f"({getattr(self, name)})"
                )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict (transformers 4.x or 5.x field names)."""
        model_type = d.get("model_type", "llama")
        num_heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if model_type == "mistral" and d.get("sliding_window") not in (None, 0):
            # NOTE: sliding-window attention is not implemented; only contexts within the
            # window are correct, so cap the usable length there.
            max_pos = min(d.get("max_position_embeddings", 4096), d["sliding_window"])
        else:
            max_pos = d.get("max_position_embeddings", 4096)
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: sized at start from the memory budget below
    gpu_memory_utilization: float = 0.90  # share of the card the engine may use (CUDA)
    cpu_kv_cache_bytes: int = 1 << 30  # KV budget on CPU
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            names = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {names}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching under a per-step token budget."""

    max_model_len: int = 4096  # prompt + output tokens of one request
    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 4096  # tokens in one step (the token budget)
    enable_chunked_prefill: bool = True  # a prompt may be split across steps
    # the most prompt tokens one request computes in a step (0: the whole budget). Below the
    # budget it bounds how long an arriving prompt stalls the running decodes (their ITL)
    # while steps still fill with several prompts' chunks under load
    long_prefill_token_threshold: int = 0
    # "max_utilization": admit while blocks are free now, preempt (recompute) when they run
    # out; "guaranteed_no_evict": admit only when the blocks every running request may still
    # need (up to max_tokens) stay free, so nothing is ever preempted
    policy: str = "max_utilization"

    def __post_init__(self) -> None:
        if self.policy not in ("max_utilization", "guaranteed_no_evict"):
            raise ValueError(
                f"policy: {self.policy!r} is not max_utilization or guaranteed_no_evict"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens must be >= 1, max_model_len >= 2"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len without chunked prefill"
            )


class AttnMerge(enum.Enum):
    """How split decode attention's last split of a (request, kv head) folds the splits'
    partials, in the same launch."""

    CHUNKED = "chunked"  # several splits' partials a load, folded online (default_merge_chunk)
    UNROLLED = "unrolled"  # one load a split, all in flight at once, each thread its own dims


Tile = tuple[int, ...]


@dataclass(frozen=True)
class KernelConfig:
    """The triton backend's kernel choices. The defaults are the fastest measured on an H200
    (benchmarks/RESULTS.md); benchmarks compare other values, one KernelConfig an arm."""

    # programmatic dependent launch (lantau/kernels/pdl.py) where the GPU has it
    enable_pdl: bool = True
    # batch-1 projections through the GEMV kernel, not cuBLAS
    enable_gemv: bool = True
    # batch 1: the SiLU-and-mul in gate_up's GEMV epilogue
    enable_gate_silu: bool = True
    # batch-1 GEMVs whose weight rows are at most this many bytes (bf16 K = 4,096, e4m3 K =
    # 8,192) load each program's weights at once, before the PDL wait (0: none); longer rows
    # (down_proj's) loop over K
    gemv_preload_max_bytes: int = 8192
    # ((N, K), tile) pairs replacing gemv.default_config / gemv.preload_config for that shape
    gemv_tiles: tuple[tuple[tuple[int, int], Tile], ...] = ()
    preload_tiles: tuple[tuple[tuple[int, int], Tile], ...] = ()
    # decode batches of at most this many rows ("small"): each attention split's first KV
    # tile read before the PDL wait, rotary and the KV write inside the attention launch
    attn_small_rows: int = 8
    # decode attention's (BLOCK_N, num_warps, num_stages): small batches, and small batches
    # whose contexts all fit attn_short_keys (their own CUDA graphs; one tile a split)
    attn_small_tile: Tile = (64, 8, 2)
    attn_short_tile: Tile = (64, 8, 1)
    attn_short_keys: int = 1024  # 0: no short-context graphs
    attn_merge: AttnMerge = AttnMerge.CHUNKED
    attn_small_merge: AttnMerge = AttnMerge.UNROLLED
    # decode attention's splits of each context (None: paged_decode_attention's heuristic)
    attn_num_splits: int | None = None
    # fp8 projections of lo..hi rows: a tensor-wise _scaled_mm (the raw product), its row and
    # column scales applied by the kernel that reads it (qkv: rotary and the KV write;
    # gate_up: SiLU-and-mul; o_proj, down_proj: the residual add + norm, without tensor
    # parallelism) ((0, 0): never). cuBLAS's tensor-wise kernels beat its row-wise ones at
    # 256-384 rows (H200: 8B qkv 1,202 vs 836 TFLOP/s, 70B down 1,394 vs 1,090 at 384 rows),
    # row-wise wins from 1,024 rows; W3-fp8-128 +2.3 % on an H100 (RESULTS.md, 2026-12-06)
    fp8_tensorwise_rows: tuple[int, int] = (128, 768)
    # the input of an fp8 projection (qkv, gate_up, down) quantized by row by the kernel that
    # writes it (the RMSNorms, SiLU-and-mul) instead of in a launch of its own
    fuse_fp8_quant: bool = True
    # steps of at most this many tokens add LoRA deltas with lantau/kernels/lora.py (a step
    # without adapter rows costs its launches only), larger ones with the masked GEMMs of
    # lantau.model.lora.add_lora, faster there when rows use adapters (H100, 4 slots of rank
    # 16: 20 rows 6-12 us a projection against 10-11, 64 rows 8-22 against 10-12; RESULTS.md)
    lora_kernel_max_tokens: int = 32


@dataclass(frozen=True)
class EngineConfig:
    model: str  # "path/to/hf-folder" | "file.gguf" | "random:NAME"
    model_config: ModelConfig
    # torch dtype name of activations, and of the weights unless model_config.quantization
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0  # for unseeded sampling and random weights
    tensor_parallel_size: int = 1
    attention_backend: str = "torch"  # "torch" (reference) | "triton" (fused kernels, CUDA)
    enforce_eager: bool = False  # no CUDA graphs
    # schedule step N+1 while step N runs (engine/core.py); False: one step at a time
    async_scheduling: bool = True
    kernels: KernelConfig = field(default_factory=KernelConfig)  # the triton backend's
    # LoRA adapters served beside the model, (name, PEFT folder) each (lantau/model/lora.py)
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0  # adapter slots (0: one a module); more: room to load at runtime
    max_lora_rank: int = 0  # 0: the modules' largest rank (16 without modules)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def num_lora_slots(self) -> int:
        """LoRA adapter slots: max_loras, or one a start-up module (0: no adapters)."""
        return max(self.max_loras, len(self.lora_modules))

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        return dataclasses.replace(
            self, cache=dataclasses.replace(self.cache, num_blocks=num_blocks)
        )
