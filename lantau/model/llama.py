"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) as plain nn.Modules.

HF parameter names are kept, except that q/k/v and gate/up are fused at load time
(`qkv_proj`, `gate_up_proj`) so each layer runs two GEMMs where HF runs five. Split over a
tensor-parallel group, each rank holds its slice of every layer (lantau/model/parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lantau.config import KernelConfig, ModelConfig, RopeScaling
from lantau.errors import ModelLoadError
from lantau.model.forward_context import ForwardContext, KeptRows
from lantau.model.fp8 import (
    E4M3,
    BlockQuantizedWeight,
    Fp8Linear,
    QuantizedWeight,
    linear_layer,
)
from lantau.model.ops import Ops, build_cos_sin_cache, make_ops
from lantau.model.parallel import SINGLE, TensorParallel


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or llama3 scaling, as HF computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size  # this rank's
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        quant = config.quantization
        self.qkv_proj = linear_layer(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, quant
        )
        self.o_proj = linear_layer(self.q_size, config.hidden_size, False, quant)

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, ops: Ops, keep: KeptRows | None = None
    ) -> torch.Tensor:
        """The qkv projection of x, rotary, KV-cache write, attention and o_proj; with keep,
        attention and o_proj of keep.rows only ([len(keep.rows), hidden_size])."""
        # x: [num_tokens, hidden_size]
        out = ops.qkv_attention(
            x, self.qkv_proj, self.num_heads, ctx.positions, ctx.cos_sin_cache,
            ctx.kv_caches[self.layer_idx], ctx.attn, self.scale, keep,
        )  # fmt: skip  # [num_tokens, num_heads, head_dim]
        if not len(out):  # no row kept: the keys and values were all the layer owed
            return x[:0]
        out = out.reshape(-1, self.q_size)
        if self.tp.size > 1:  # each rank's partial product, scaled before the all-reduce
            return self.tp.all_reduce(ops.linear(out, self.o_proj))
        return ops.residual_linear(out, self.o_proj)  # [num_tokens, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, quant = config.hidden_size, config.quantization
        i = config.intermediate_size // tp.size  # this rank's columns
        self.tp = tp
        self.gate_up_proj = linear_layer(h, 2 * i, False, quant)
        self.down_proj = linear_layer(i, h, False, quant)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        x = ops.linear_silu_mul(x, self.gate_up_proj, next_layer=self.down_proj)
        if self.tp.size > 1:  # each rank's partial product, scaled before the all-reduce
            return self.tp.all_reduce(ops.linear(x, self.down_proj))
        return ops.residual_linear(x, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        ops: Ops,
        keep: KeptRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the normalised input so that the add and the
        next norm are one fused op: returns (this layer's output delta, residual). keep: every
        row's keys and values, the rest for keep.rows only (their rows returned)."""
        norm, qkv = self.input_layernorm, self.self_attn.qkv_proj
        if residual is None:
            residual, x = x, ops.rms_norm(x, norm.weight, norm.eps, next_layer=qkv)
        else:
            x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps, next_layer=qkv)
        x = self.self_attn(x, ctx, ops, keep)
        if keep is not None:
            residual = residual[keep.rows]
            if not len(x):
                return x, residual
        norm, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps, next_layer=gate_up)
        return self.mlp(x, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # fused parameter -> (HF parameter, shard index) it is built from
    STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        ops: str = "torch",
        max_positions: int = 0,
        kernels: KernelConfig | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        config.check_split(tp.size)
        self.config = config  # the whole model's shape (each layer knows its own slice)
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp.size, bias=False)
        # NOTE: split, a tied lm_head is a copy of this rank's embedding rows (`_tie`)
        self.tied_copy = config.tie_word_embeddings and tp.size > 1
        if config.tie_word_embeddings and not self.tied_copy:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: Ops = make_ops(ops, kernels)
        self.adapter_slots = None  # model/lora.py's AdapterSlots, where adapters may run
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        device = self.lm_head.weight.device
        max_positions = max_positions or config.max_position_embeddings
        # NOTE: a plain attribute, not a buffer: it stays fp32 whatever the model's dtype
        self.cos_sin_cache = build_cos_sin_cache(inv_freq.to(device), max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        pick: tuple[torch.Tensor, torch.Tensor] | None = None,
        final_norm: bool = False,
    ) -> torch.Tensor:
        """input_ids: [num_tokens] -> the residual stream after the last layer, [num_tokens,
        hidden_size] (the final norm is compute_logits', on the rows that need logits); with
        ctx.keep, of keep.rows only (the last layer computes no other row's output).
        pick: (pick_src, prev_ids), token i's id taken from prev_ids[pick_src[i]] where
        pick_src[i] >= 0 (Ops.embed). final_norm: the final norm's output instead, the last
        residual add and the norm one op (decode_logits)."""
        ctx.cos_sin_cache = self.cos_sin_cache
        self.ops.lora = ctx.lora  # the adapters' deltas, for this forward only
        try:
            x = self.ops.embed(input_ids, self.model.embed_tokens.weight, *(pick or ()))
            residual = None
            *body, last = self.model.layers
            for layer in body:
                x, residual = layer(x, residual, ctx, self.ops)
            x, residual = last(x, residual, ctx, self.ops, ctx.keep)
            if final_norm:
                norm = self.model.norm
                return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]
            return self.ops.resolve(x) + residual
        finally:
            self.ops.end_forward()

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        pick: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """forward, then compute_logits of every row (a decode step): [num_tokens,
        vocab_size], the last residual add and the final norm in one op (one launch fewer, and
        no torch add between the PDL launches around it). out: a [>= num_tokens, vocab_size]
        buffer whose first rows take the logits (returned), as the CUDA graphs' one a turn."""
        hidden = self(input_ids, ctx, pick, final_norm=True)
        if self.tp.size > 1:  # this rank's vocabulary columns, gathered
            logits = self.tp.all_gather(self.ops.linear(hidden, self.lm_head))
            return logits if out is None else out[: len(hidden)].copy_(logits)
        return self.ops.linear(hidden, self.lm_head, None if out is None else out[: len(hidden)])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab_size]: the final norm and lm_head on rows of forward's output."""
        norm = self.model.norm
        normed = self.ops.rms_norm(hidden, norm.weight, norm.eps)
        return self.tp.all_gather(self.ops.linear(normed, self.lm_head))

    def _shard_slice(self, fused: str, shard: int) -> slice:
        """Where HF's projection `shard` of `fused` sits in this rank's fused parameter."""
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        i = mlp.down_proj.in_features
        sizes = [attn.q_size, attn.kv_size, attn.kv_size] if fused == "qkv_proj" else [i, i]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    @torch.no_grad()
    def _tie(self) -> None:
        """A split tied lm_head: this rank's rows of the embedding."""
        if self.tied_copy:
            whole = self.model.embed_tokens.weight
            self.lm_head.weight.copy_(self.tp.shard("lm_head.weight", whole, self.config))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}  # fused parameter -> shards copied so far
        for hf_name, tensor in weights:
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            tensor = self._shard(hf_name, tensor)  # this rank's part
            parts = hf_name.split(".")
            target, rows = hf_name, slice(None)
            if len(parts) >= 2 and parts[-2] in self.STACKED:
                fused, shard = self.STACKED[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
                rows = self._shard_slice(fused, shard)
                shards.setdefault(target, set()).add(shard)
            else:
                loaded.add(target)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected weight {hf_name!r}")
            dst = param[rows]
            if dst.shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dst.shape)}"
                )
            if param.dtype == E4M3:  # quantized as it loads (or copied), a tensor at a time
                self.get_submodule(target.removesuffix(".weight")).load_rows(rows, tensor)
            elif isinstance(tensor, QuantizedWeight):  # an FP8 checkpoint's, kept wide here
                dst.copy_(tensor.dequantize(dst.dtype))
            else:
                dst.copy_(tensor)
        for target, done in shards.items():
            if len(done) == (3 if ".qkv_proj." in target else 2):
                loaded.add(target)
        if self.tied_copy and "model.embed_tokens.weight" in loaded:
            self._tie()
            loaded.add("lm_head.weight")
        # an fp8 weight's scales are set with it
        loaded |= {f"{name}_scale" for name in loaded if f"{name}_scale" in params}
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[:8]}")

    def _shard(self, hf_name: str, tensor: torch.Tensor | QuantizedWeight | BlockQuantizedWeight):
        if isinstance(tensor, BlockQuantizedWeight):  # dequantized on the model's device
            tensor = tensor.dequantize(self.lm_head.weight.device)
        if isinstance(tensor, QuantizedWeight):  # its row scales sliced as its rows
            return QuantizedWeight(
                self.tp.shard(hf_name, tensor.q, self.config),
                self.tp.shard_row_values(hf_name, tensor.scale, self.config),
            )
        return self.tp.shard(hf_name, tensor, self.config)

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices and unit norms, drawn on the parameters' own device. An
        fp8 layer's weight is drawn in the activation dtype and quantized, one layer at a
        time: no wide copy of the model ever exists. Split over ranks, each tensor is drawn
        whole and sliced: the same model as on one rank."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        fp8_layers = {n: m for n, m in self.named_modules() if isinstance(m, Fp8Linear)}
        dtype = self.lm_head.weight.dtype  # the activations'
        for name, param in self.named_parameters():
            module_name, _, param_name = name.rpartition(".")
            if name == "lm_head.weight" and self.tied_copy:
                continue  # the embedding's rows (_tie)
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif module_name in fp8_layers:
                if param_name == "weight":  # weight_scale: set by load_rows
                    # NOTE: the same draws as the unquantized model's with the same seed
                    wide = self._draw(name, param, dtype, gen)
                    fp8_layers[module_name].load_rows(slice(None), wide)
                    del wide
            elif self.tp.size > 1:
                param.copy_(self._draw(name, param, param.dtype, gen))
            else:
                param.normal_(0.0, 0.02, generator=gen)
        self._tie()

    def _draw(self, name: str, param, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        """Normal(0, 0.02) draws of the whole model's tensor `name`, this rank's slice."""
        shape = self.tp.whole_shape(name, param.shape)
        whole = torch.empty(shape, dtype=dtype, device=param.device)
        return self.tp.shard(name, whole.normal_(0.0, 0.02, generator=gen), self.config)
