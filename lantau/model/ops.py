"""The two implementations of the model's ops: `torch` (the kernels' references, any device, no
Triton) and `triton` (the kernels of lantau/kernels, CUDA). The model calls one `Ops` object;
nothing else in it depends on the backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lantau.config import KernelConfig
from lantau.kernels import reference as ref
from lantau.kernels import require_triton
from lantau.kv_cache.manager import cdiv
from lantau.model import fp8
from lantau.model.forward_context import AttentionMetadata, KeptRows
from lantau.model.lora import LoRABatch, add_lora


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each pair's angle, then its sin (fp32)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]: strided views of a qkv
    projection's output [T, (num_heads + 2 num_kv_heads) head_dim]."""
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    return (
        q.view(-1, num_heads, head_dim),
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
    )


class _Compositions:
    """The model's composite ops, as both backends run them unfused; TritonOps fuses some."""

    # the step's adapter tokens (lantau/model/lora.py), set by the model for its forward
    lora: LoRABatch | None = None
    # a residual_linear product left unscaled and its scales, until read
    _pending: tuple[torch.Tensor, dict] | None = None
    # an op's output and its rows quantized for the fp8 projection that reads it next, until
    # read (TritonOps, KernelConfig.fuse_fp8_quant)
    _quantized: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def end_forward(self) -> None:
        """Forget the forward's adapters and anything left unread (a failed forward's, never
        the next one's)."""
        self.lora = self._pending = self._quantized = None

    def lora_on(self, layer) -> bool:
        """Whether this forward adds adapter deltas to `layer`'s products."""
        return self.lora is not None and getattr(layer, "lora_weights", None) is not None

    def product(self, x, layer: torch.nn.Linear) -> tuple[torch.Tensor, dict]:
        """layer(x) and the scales its reader still applies ({}: none, the product is
        final). TritonOps leaves fp8 products unscaled under fp8_tensorwise_rows."""
        return self.linear(x, layer), {}

    def linear_silu_mul(self, x, layer: torch.nn.Linear, next_layer=None) -> torch.Tensor:
        """silu_and_mul(layer(x)) for layer = gate_up_proj: [num_tokens, intermediate];
        next_layer: the projection that reads it (down_proj), see TritonOps.rms_norm."""
        y, scales = self.product(x, layer)
        return self.silu_and_mul(y, next_layer, **scales)

    def residual_linear(self, x, layer: torch.nn.Linear) -> torch.Tensor:
        """layer(x) for a product that goes into the residual stream (o_proj, down_proj),
        read next by add_rms_norm or `resolve`: an unscaled one stays pending until then."""
        y, scales = self.product(x, layer)
        if scales:
            assert self._pending is None, "an unscaled product was never read"
            self._pending = (y, scales)
        return y

    def _take_scales(self, x) -> dict:
        """The scales of x if it is the pending unscaled product (then no longer pending)."""
        if self._pending is None:
            return {}
        y, scales = self._pending
        assert y is x, "an unscaled product read by another op"
        self._pending = None
        return scales

    def resolve(self, x: torch.Tensor) -> torch.Tensor:
        """x as a tensor of values (a residual_linear product scaled, where it was not)."""
        scales = self._take_scales(x)
        if not scales:
            return x
        return (x * scales["row_scale"][:, None] * scales["col_scale"][None, :]).to(x.dtype)

    def qkv_attention(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        meta: AttentionMetadata, scale: float, keep: KeptRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The attention's input side, then attention: the qkv projection of x, rotary on q
        and k, k and v to their cache slots: [num_tokens, num_heads, head_dim]. In a step with
        prompt rows, a fresh prompt (every key this step's) attends over the step's own k and
        v as computed (`attention`'s `fresh`), not over the cache's copy (an fp8 cache's
        rounded one). keep: every row's k and v are written, but only keep.rows attend (each
        its request's last row, over the cache as a decode would): [len(keep.rows), ...]."""
        num_kv_heads, head_dim = kv_cache.shape[3:]
        qkv, scales = self.product(x, layer)
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        if keep is not None:
            q, _, _ = self.rotary_and_write_kv(
                q, k, v, positions, cos_sin_cache, kv_cache, meta.slot_mapping, **scales
            )
            if not len(keep.rows):
                return q[:0]
            return self.attention(q[keep.rows], kv_cache, keep.attn, scale)
        fresh = not meta.is_decode_only
        q, k, v = self.rotary_and_write_kv(
            q, k, v, positions, cos_sin_cache, kv_cache, meta.slot_mapping, store_kv=fresh,
            **scales,
        )  # fmt: skip
        return self.attention(q, kv_cache, meta, scale, fresh=(k, v) if fresh else None)


class TorchOps(_Compositions):
    """The kernels' torch references (lantau/kernels/reference.py), on any device; imports no
    Triton."""

    name = "torch"

    @staticmethod
    def short_context_keys(num_rows: int) -> int:
        return 0  # one attention for every context length

    # weight[ids]: [num_tokens, hidden]; with pick_src, row i's id is prev_ids[pick_src[i]]
    # where pick_src[i] >= 0 (a token the previous step sampled on the device)
    embed = staticmethod(ref.embedding_ref)

    def linear(self, x, layer, out: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear, or for an fp8 layer _scaled_mm's product emulated in fp32 (with the
        step's adapter deltas); written into `out` (returned) when given."""
        y = fp8.linear_ref(x, layer)
        if self.lora_on(layer):
            add_lora(y, x, layer.lora_weights, self.lora)
        return y if out is None else out.copy_(y)

    # next_layer (the projection that reads the output; TritonOps may quantize for it): unused
    @staticmethod
    def rms_norm(x, weight, eps, next_layer=None) -> torch.Tensor:
        return ref.rms_norm_ref(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps, next_layer=None):
        return ref.add_rms_norm_ref(x, residual, weight, eps)  # (norm(x + res), x + res)

    @staticmethod
    def silu_and_mul(x, next_layer=None) -> torch.Tensor:
        return ref.silu_and_mul_ref(x)

    rotary = staticmethod(ref.rotary_ref)

    @staticmethod
    def rotary_and_write_kv(
        q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, store_kv=False
    ):
        """Rotated q and k, and v; the rotated k and v go to their cache slots."""
        q, k = ref.rotary_ref(q, k, positions, cos_sin_cache)
        ref.write_kv_cache_ref(k, v, kv_cache, slot_mapping)
        return q, k, v

    @staticmethod
    def attention(q, kv_cache, meta: AttentionMetadata, scale: float, fresh=None):
        return ref.paged_attention_ref(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, meta.max_seq_len, scale, fresh=fresh,
        )  # fmt: skip


class TritonOps(_Compositions):
    """Fused Triton kernels under one KernelConfig: decode-only steps take the split-context
    decode kernel (small batches with rotary and the KV write inside it), batch-1 projections
    the GEMV kernel (gate_up's with the SiLU-and-mul in its epilogue)."""

    name = "triton"

    def __init__(self, config: KernelConfig | None = None) -> None:
        from lantau.kernels import (
            activation,
            decode_attention,
            embedding,
            fp8_quant,
            fresh_attention,
            gemv,
            lora,
            rms_norm,
            rotary,
            unified_attention,
        )

        self._act, self._gemv, self._embedding = activation, gemv, embedding
        self._fp8_quant, self._lora = fp8_quant, lora
        self._norm, self._rope = rms_norm, rotary
        self._decode, self._unified = decode_attention, unified_attention
        self._fresh = fresh_attention
        self.config = config = config or KernelConfig()
        self._pdl = config.enable_pdl
        self._gemv_tiles, self._preload_tiles = dict(config.gemv_tiles), dict(config.preload_tiles)

    def embed(self, input_ids, weight, pick_src=None, prev_ids=None) -> torch.Tensor:
        """TorchOps.embed in one launch, the pick included."""
        return self._embedding.embedding(input_ids, weight, pick_src, prev_ids, self._pdl)

    def linear(
        self,
        x: torch.Tensor,
        layer: torch.nn.Linear | fp8.Fp8Linear,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ W^T (+ b) (with the step's adapter deltas); written into `out` (returned)
        when given: the CUDA graphs' logits buffer (cuda_graph.py), which a plain layer's GEMM
        writes directly."""
        if self.lora_on(layer):
            y, w = self._base_linear(x, layer), layer.lora_weights
            if x.shape[0] <= self.config.lora_kernel_max_tokens:
                self._lora.add_lora(y, x, w.a, w.b, self.lora.index, w.rank, self._pdl)
            else:
                add_lora(y, x, w, self.lora)
            return y if out is None else out.copy_(y)
        return self._base_linear(x, layer, out)

    def _by_gemv(self, rows: int) -> bool:
        """Whether a projection of `rows` rows runs the batch-1 GEMV (x read as it is)."""
        return self.config.enable_gemv and rows == 1

    def _base_linear(self, x, layer, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._by_gemv(x.shape[0]):
            y = self._gemv_linear(x, layer)
        elif isinstance(layer, fp8.Fp8Linear):  # x quantized by token
            xq, xs = self._quantized_rows(x)
            y = fp8.fp8_linear_scaled_mm(x, layer, xq, xs)
        elif out is not None and layer.bias is None:
            return torch.mm(x, layer.weight.t(), out=out)  # F.linear's own GEMM
        else:
            y = F.linear(x, layer.weight, layer.bias)
        return y if out is None else out.copy_(y)

    def _gemv_linear(self, x, layer, gated: bool = False) -> torch.Tensor:
        """An fp8 layer's e4m3 weight read as it is, its row scales applied after the sum."""
        shape = tuple(layer.weight.shape)
        w, b = layer.weight, layer.bias
        kw = dict(gated=gated, use_pdl=self._pdl, weight_scale=getattr(layer, "weight_scale", None))
        if shape[1] * w.element_size() <= self.config.gemv_preload_max_bytes:
            return self._gemv.gemv(x, w, b, self._preload_tiles.get(shape), preload=True, **kw)
        return self._gemv.gemv(x, w, b, self._gemv_tiles.get(shape), **kw)

    def linear_silu_mul(self, x, layer: torch.nn.Linear, next_layer=None) -> torch.Tensor:
        gated = self._by_gemv(x.shape[0]) and self.config.enable_gate_silu
        if gated and not self.lora_on(layer):  # an adapter's delta comes before the SiLU
            return self._gemv_linear(x, layer, gated=True)
        return super().linear_silu_mul(x, layer, next_layer)

    def _quantize_for(self, rows: int, cols: int, device, next_layer) -> dict:
        """An op's `quant` and `store` arguments: buffers for its output quantized by row as
        it is written, when the projection that reads it next quantizes its input so (an fp8
        layer, not the batch-1 GEMV) and KernelConfig.fuse_fp8_quant (one launch and a read of
        the output fewer); the output itself stored only for an adapter's delta, the one
        reader of it beside the quantized rows ({}: no quantization, the output stored)."""
        fused = self.config.fuse_fp8_quant and isinstance(next_layer, fp8.Fp8Linear)
        if not fused or self._by_gemv(rows):
            return {}
        quant = self._fp8_quant.empty_quantized(rows, cols, device)
        return dict(quant=quant, store=self.lora_on(next_layer))

    def _keep_quantized(self, out: torch.Tensor, fused: dict) -> torch.Tensor:
        """out, its quantized rows (if written: _quantize_for's `fused`) kept for the
        projection that reads it (then out's values may never have been written)."""
        self._quantized = (out, fused["quant"]) if fused else None
        return out

    def _quantized_rows(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """x quantized by row: as the op that wrote x quantized it (then no longer kept), or
        in a launch of its own."""
        if self._quantized is not None and self._quantized[0] is x:
            quant, self._quantized = self._quantized[1], None
            return quant
        return self._fp8_quant.quantize_rows(x, use_pdl=self._pdl)

    def product(self, x, layer) -> tuple[torch.Tensor, dict]:
        """With fp8_tensorwise_rows, an fp8 layer's raw tensor-wise product of x (quantized
        by token) and its e4m3 weight, and the scales its reader applies (row_scale,
        col_scale)."""
        if not self._tensorwise(x, layer):
            return self.linear(x, layer), {}
        xq, xs = self._quantized_rows(x)
        raw = fp8.unscaled_mm(xq, layer.weight, x.dtype)
        return raw, dict(row_scale=xs, col_scale=layer.weight_scale)

    def _tensorwise(self, x, layer) -> bool:
        """Whether an fp8 layer's product is left unscaled for its reader to scale
        (KernelConfig.fp8_tensorwise_rows): no bias, no adapter delta, not the batch-1 GEMV."""
        lo, hi = self.config.fp8_tensorwise_rows
        rows = x.shape[0]
        return (
            isinstance(layer, fp8.Fp8Linear) and lo <= rows <= hi and layer.bias is None
            and not self.lora_on(layer) and not self._by_gemv(rows)
        )  # fmt: skip

    def qkv_attention(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        meta: AttentionMetadata, scale: float, keep: KeptRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Small decode batches: rotary and the KV write inside the attention launch, one
        launch fewer a layer."""
        if keep is not None or not (
            meta.is_decode_only and x.shape[0] <= self.config.attn_small_rows
        ):
            return super().qkv_attention(
                x, layer, num_heads, positions, cos_sin_cache, kv_cache, meta, scale, keep
            )
        num_kv_heads, head_dim = kv_cache.shape[3:]
        q, k, v = split_qkv(self.linear(x, layer), num_heads, num_kv_heads, head_dim)
        rope = self._decode.DecodeRope(k, v, positions, cos_sin_cache, meta.slot_mapping)
        return self._decode_attention(q, kv_cache, meta, scale, rope)

    def rms_norm(self, x, weight, eps, next_layer=None) -> torch.Tensor:
        """next_layer: the projection that reads the output (_quantize_for)."""
        fused = self._quantize_for(*x.shape, x.device, next_layer)
        out = self._norm.rms_norm(x, weight, eps, use_pdl=self._pdl, **fused)
        return self._keep_quantized(out, fused)

    def add_rms_norm(self, x, residual, weight, eps, next_layer=None):
        # in place on both; an unscaled residual_linear product scaled as it is read
        fused = self._quantize_for(*x.shape, x.device, next_layer)
        self._norm.fused_add_rms_norm(
            x, residual, weight, eps, use_pdl=self._pdl, **self._take_scales(x), **fused
        )
        return self._keep_quantized(x, fused), residual

    def rotary_and_write_kv(
        self, q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, store_kv=False,
        **scales,
    ):  # fmt: skip
        """One kernel: q rotated in place, rotated k and v stored to their cache slots (an
        unscaled product's `scales` applied as they are read); with store_kv, k rotated and
        v scaled in place too. Returns q, k, v (k, v as values only with store_kv)."""
        self._rope.apply_rotary_and_write_kv(
            q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, use_pdl=self._pdl,
            store_kv=store_kv, **scales,
        )  # fmt: skip
        return q, k, v

    def silu_and_mul(self, x, next_layer=None, **scales) -> torch.Tensor:
        fused = self._quantize_for(x.shape[0], x.shape[1] // 2, x.device, next_layer)
        out = self._act.silu_and_mul(x, use_pdl=self._pdl, **scales, **fused)
        return self._keep_quantized(out, fused)

    def _decode_attention(
        self, q, kv_cache, meta: AttentionMetadata, scale: float, rope=None, out=None
    ):
        """Split-context decode attention under this config: a small batch (`rope`, see
        paged_decode_attention) with the small tile and merge, or the short tile in one-tile
        splits when every context fits attn_short_keys. q: the step's first q.shape[0] requests,
        one row each. Returns [num_rows, num_heads, head_dim] (into `out` if given)."""
        c = self.config
        n = q.shape[0]
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tile, num_splits, merge = None, c.attn_num_splits, c.attn_merge
        if rope is not None:
            tile, merge = c.attn_small_tile, c.attn_small_merge
            if self.short_context_keys(n) >= meta.max_seq_len:
                tile, num_splits = c.attn_short_tile, cdiv(c.attn_short_keys, c.attn_short_tile[0])
        self._decode.paged_decode_attention(
            q, kv_cache, out, meta.seq_lens[:n], meta.block_tables[:n], meta.max_seq_len, scale,
            num_splits=num_splits, config=tile, merge=merge, rope=rope, use_pdl=self._pdl,
        )  # fmt: skip
        return out

    def short_context_keys(self, num_rows: int) -> int:
        """The context length up to which a decode batch of num_rows rows takes
        attn_short_tile (0: none): CUDA graphs capture such batches apart."""
        return self.config.attn_short_keys if num_rows <= self.config.attn_small_rows else 0

    def attention(
        self, q, kv_cache, meta: AttentionMetadata, scale: float, fresh=None
    ) -> torch.Tensor:
        """Decode-only steps through the decode kernel; a step with prompt rows in the unified
        launch, its leading decodes (meta.num_decodes) apart through the decode kernel: in a
        unified tile a decode fills one query row of many, and its keys go through the tile's
        MMA path at a fraction of the decode kernel's rate. fresh: the step's (k, v), rotated:
        requests with no keys before the step attend over them (fresh_attention: contiguous
        rows in q's dtype, no block table, no fp8 conversion), not over the cache."""
        if meta.is_decode_only:
            return self._decode_attention(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            self._decode_attention(q[:n], kv_cache, meta, scale, out=out[:n])
        qsl, seq_lens = meta.query_start_loc[n:], meta.seq_lens[n:]
        self._unified.unified_attention(
            q[n:], kv_cache, out[n:], qsl, seq_lens, meta.block_tables[n:], meta.max_query_len,
            meta.max_seq_len, scale, skip_fresh=fresh is not None,
        )  # fmt: skip
        if fresh is not None:
            k, v = fresh
            self._fresh.fresh_attention(q[n:], k[n:], v[n:], out[n:], qsl, seq_lens, scale)
        return out


Ops = TorchOps | TritonOps


def make_ops(name: str, kernels: KernelConfig | None = None) -> Ops:
    """The backend `name`; `kernels`: the triton backend's KernelConfig (default: defaults)."""
    if name == "torch":
        return TorchOps()
    if name == "triton":
        require_triton("attention_backend='triton'")
        return TritonOps(kernels)
    raise ValueError(f"attention_backend: {name!r} is not one of torch, triton")
