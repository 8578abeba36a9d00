"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) as plain nn.Modules.

HF parameter names are kept, except that q/k/v and gate/up are fused at load time
(`qkv_proj`, `gate_up_proj`) so each layer runs two GEMMs where HF runs five.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lantau.config import ModelConfig, RopeScaling
from lantau.errors import ModelLoadError
from lantau.model.forward_context import ForwardContext
from lantau.model.ops import NormSums, Ops, build_cos_sin_cache, make_ops


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
        # the weight is all ones, multiplied into the projection after the norm instead
        # (LlamaForCausalLM.fold_norm_weights)
        self.folded = False


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, ops: Ops) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        return ops.linear(self.attend(x, ctx, ops), self.o_proj)  # [num_tokens, hidden]

    def attend(
        self, x: torch.Tensor, ctx: ForwardContext, ops: Ops, norm=None, sumsq=None
    ) -> torch.Tensor:
        """The qkv projection of x (of norm(x), x the residual stream, when `norm` is given;
        `sumsq` x's sum of squares, NormSums), rotary, KV-cache write and attention:
        [num_tokens, q_size]."""
        out = ops.qkv_attention(
            x, self.qkv_proj, self.num_heads, ctx.positions, ctx.cos_sin_cache,
            ctx.kv_caches[self.layer_idx], ctx.attn, self.scale, norm=norm, sumsq=sumsq,
        )  # fmt: skip
        return out.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.linear(ops.linear_silu_mul(x, self.gate_up_proj), self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the normalised input so that the add and the
        next norm are one fused op: returns (this layer's output delta, residual)."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(x, ctx, ops)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(x, ops), residual

    def forward_fused(
        self, h: torch.Tensor, ctx: ForwardContext, ops: Ops, sums: NormSums
    ) -> torch.Tensor:
        """The same layer on the whole residual stream h, each norm folded into the projection
        after it, each residual add into the one before it, and the SiLU-and-mul into gate_up's
        (`ops.fuses`); each residual write hands its sum of squares to the next norm through
        `sums`: returns the new h."""
        attn, mlp, slot = self.self_attn, self.mlp, 2 * self.self_attn.layer_idx
        out = attn.attend(h, ctx, ops, norm=self.input_layernorm, sumsq=sums.reader(slot))
        h = ops.linear_add(out, attn.o_proj, h, sumsq_out=sums.writer(slot + 1))
        act = ops.norm_linear_silu_mul(
            h, self.post_attention_layernorm, mlp.gate_up_proj, sumsq=sums.reader(slot + 1)
        )
        return ops.linear_add(act, mlp.down_proj, h, sumsq_out=sums.writer(slot + 2))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
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

    def __init__(self, config: ModelConfig, ops: str = "torch", max_positions: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: Ops = make_ops(ops)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        device = self.lm_head.weight.device
        max_positions = max_positions or config.max_position_embeddings
        # NOTE: a plain attribute, not a buffer: it stays fp32 whatever the model's dtype
        self.cos_sin_cache = build_cos_sin_cache(inv_freq.to(device), max_positions)
        self._norm_sums: NormSums | None = None  # the fused path's, made on first use
        self._final_sumsq: torch.Tensor | None = None  # set by a fused forward, for its logits
        # decode_logits: the last residual add and the final norm in one op (off: for same-run
        # comparisons)
        self.fuse_final_norm = True

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        pick: tuple[torch.Tensor, torch.Tensor] | None = None,
        final_norm: bool = False,
    ) -> torch.Tensor:
        """input_ids: [num_tokens] -> the residual stream after the last layer, [num_tokens,
        hidden_size] (the final norm is compute_logits', on the rows that need logits).
        pick: (pick_src, prev_ids), token i's id taken from prev_ids[pick_src[i]] where
        pick_src[i] >= 0 (Ops.embed). final_norm (not on the fused path): the final norm's
        output instead, the last residual add and the norm one op (decode_logits)."""
        ctx.cos_sin_cache = self.cos_sin_cache
        self._final_sumsq = None
        if self.ops.fuses(input_ids.shape[0]):
            assert not final_norm, "the fused path folds the final norm into lm_head"
            return self._forward_fused(input_ids, ctx, pick)
        x = self.ops.embed(input_ids, self.model.embed_tokens.weight, *(pick or ()))
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx, self.ops)
        if final_norm:
            norm = self.model.norm
            return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]
        return x + residual

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        pick: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """forward, then compute_logits of every row (a decode step): [num_tokens,
        vocab_size], the last residual add and the final norm in one op (one launch fewer, and
        no torch add between the PDL launches around it)."""
        if self.ops.fuses(input_ids.shape[0]) or not self.fuse_final_norm:
            return self.compute_logits(self(input_ids, ctx, pick))
        return self.ops.linear(self(input_ids, ctx, pick, final_norm=True), self.lm_head)

    def _forward_fused(self, input_ids, ctx: ForwardContext, pick) -> torch.Tensor:
        """forward's single-row path (`ops.fuses`): the layers' forward_fused on the residual
        stream, which carries its sum of squares from each write to the norm after it."""
        sums = self._norm_sums
        if sums is None or sums.sums.device != input_ids.device:
            sums = self._norm_sums = NormSums(len(self.model.layers), input_ids.device)
        try:
            h = self.ops.embed(
                input_ids, self.model.embed_tokens.weight, *(pick or ()),
                sumsq_out=sums.writer(0),
            )  # fmt: skip
            for layer in self.model.layers:
                h = layer.forward_fused(h, ctx, self.ops, sums)
        except BaseException:
            sums.sums.zero_()  # a step cut short leaves no stale sum behind
            raise
        self._final_sumsq = sums.reader(sums.last)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab_size] of the rows of the last forward's output (one row after a
        fused forward, whose sum of squares the final norm then reads)."""
        sumsq = self._final_sumsq if hidden.shape[0] == 1 else None
        return self.ops.norm_linear(hidden, self.model.norm, self.lm_head, sumsq)

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """Multiply each RMSNorm's weight into the columns of the projection after it (qkv_proj,
        gate_up_proj, and lm_head unless tied to the embedding) and make it ones
        (RMSNorm.folded): the same model up to one rounding of those weights, whose fused
        single-row GEMVs then load no norm weight."""
        pairs = [
            pair
            for layer in self.model.layers
            for pair in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            )
        ]
        if self.lm_head.weight is not self.model.embed_tokens.weight:
            pairs.append((self.model.norm, self.lm_head))
        for norm, linear in pairs:
            if norm.folded:
                continue
            scale = norm.weight.float()
            for rows in linear.weight.split(8192):  # fp32 a slice at a time
                rows.copy_(rows.float() * scale)
            norm.weight.fill_(1.0)
            norm.folded = True

    def _shard_slice(self, fused: str, shard: int) -> slice:
        c = self.config
        sizes = (
            [c.q_size, c.kv_size, c.kv_size] if fused == "qkv_proj" else [c.intermediate_size] * 2
        )
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        if any(isinstance(m, RMSNorm) and m.folded for m in self.modules()):
            raise ModelLoadError("weights load into a model whose norms are not folded yet")
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}  # fused parameter -> shards copied so far
        for hf_name, tensor in weights:
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
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
            dst.copy_(tensor)
        for target, done in shards.items():
            if len(done) == (3 if ".qkv_proj." in target else 2):
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"weights missing from the checkpoint: {missing[:8]}")

    @torch.no_grad()
    def init_random_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices and unit norms, drawn on the parameters' own device."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
