"""The two implementations of the model's non-GEMM ops: `torch` (reference, any device) and
`triton` (fused kernels from lantau/kernels, CUDA). The model calls one `Ops` object; nothing
else in it depends on the backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lantau.kernels import reference as ref
from lantau.kernels import require_triton
from lantau.model.forward_context import AttentionMetadata


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


class NormSums:
    """Batch-1 fused steps (TritonOps.fuses) hand each RMSNorm its input's sum of squares: every
    write of the residual stream (the embedding, then each o_proj and down_proj with its
    residual add) adds the sum to a slot of its own (fp64), which the norm folded into the next
    GEMV reads instead of summing the 4,096-wide row again in every one of its programs.

    Slot j's writer also zeroes slot j - 1, read by then: a step leaves only its last slot set
    (the final norm's), and the next step's embedding zeroes it. Layer i reads slot 2i, writes
    2i + 1 (o_proj) and 2i + 2 (down_proj)."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.sums = torch.zeros(2 * num_layers + 1, dtype=torch.float64, device=device)

    def writer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slot, the slot before it, zeroed by the same launch)."""
        return self.sums[slot : slot + 1], self.sums[slot - 1 : slot or None]

    def reader(self, slot: int) -> torch.Tensor:
        return self.sums[slot : slot + 1]

    @property
    def last(self) -> int:
        return self.sums.shape[0] - 1


class _Compositions:
    """The model's composite ops, as both backends run them unfused; TritonOps runs them as one
    GEMV launch each at one row (`fuses`)."""

    def fuses(self, num_rows: int) -> bool:
        """Whether the model should take the fused single-row path (norm_linear, linear_add,
        norm_linear_silu_mul in place of the add + norm pairs)."""
        return False

    def norm_linear(self, h, norm, layer: torch.nn.Linear, sumsq=None) -> torch.Tensor:
        """layer(rms_norm(h)), with norm an RMSNorm module; `sumsq`: h's sum of squares, when
        known (NormSums.reader; the fused path may use it)."""
        return self.linear(self.rms_norm(h, norm.weight, norm.eps), layer)

    def linear_add(self, x, layer: torch.nn.Linear, residual, sumsq_out=None) -> torch.Tensor:
        """residual + layer(x): the new residual stream (in place on it when fused);
        `sumsq_out`: where the fused path may leave its sum of squares (NormSums.writer)."""
        return self.linear(x, layer) + residual

    def linear_silu_mul(self, x, layer: torch.nn.Linear) -> torch.Tensor:
        """silu_and_mul(layer(x)) for layer = gate_up_proj: [num_tokens, intermediate]."""
        return self.silu_and_mul(self.linear(x, layer))

    def norm_linear_silu_mul(self, h, norm, layer: torch.nn.Linear, sumsq=None) -> torch.Tensor:
        """linear_silu_mul(rms_norm(h)), with norm an RMSNorm module (`sumsq` as norm_linear's)."""
        return self.linear_silu_mul(self.rms_norm(h, norm.weight, norm.eps), layer)

    def qkv_rotary_write_kv(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        slot_mapping, norm=None, sumsq=None,
    ) -> torch.Tensor:  # fmt: skip
        """The attention's input side: the qkv projection of x (of rms_norm(x), x the residual
        stream, with `norm`; `sumsq` as norm_linear's), rotary on q and k, k and v to their
        cache slots: q [num_tokens, num_heads, head_dim]."""
        num_kv_heads, head_dim = kv_cache.shape[3:]
        qkv = self.linear(x, layer) if norm is None else self.norm_linear(x, norm, layer, sumsq)
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        return self.rotary_and_write_kv(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping)

    def qkv_attention(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        meta: AttentionMetadata, scale: float, norm=None, sumsq=None,
    ) -> torch.Tensor:  # fmt: skip
        """qkv_rotary_write_kv, then attention: [num_tokens, num_heads, head_dim]."""
        q = self.qkv_rotary_write_kv(
            x, layer, num_heads, positions, cos_sin_cache, kv_cache, meta.slot_mapping, norm,
            sumsq,
        )  # fmt: skip
        return self.attention(q, kv_cache, meta, scale)


class TorchOps(_Compositions):
    """The kernels' torch references (lantau/kernels/reference.py), on any device; imports no
    Triton."""

    name = "torch"

    @staticmethod
    def short_context_keys(num_rows: int) -> int:
        return 0  # one attention for every context length

    @staticmethod
    def embed(input_ids, weight, pick_src=None, prev_ids=None, sumsq_out=None) -> torch.Tensor:
        """weight[ids]: [num_tokens, hidden]; with pick_src, row i's id is prev_ids[pick_src[i]]
        where pick_src[i] >= 0 (a token the previous step sampled on the device). `sumsq_out`
        as linear_add's (ignored here)."""
        return ref.embedding_ref(input_ids, weight, pick_src, prev_ids)

    @staticmethod
    def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    rms_norm = staticmethod(ref.rms_norm_ref)
    add_rms_norm = staticmethod(ref.add_rms_norm_ref)  # (rms_norm(x + residual), x + residual)
    rotary = staticmethod(ref.rotary_ref)
    silu_and_mul = staticmethod(ref.silu_and_mul_ref)

    @staticmethod
    def rotary_and_write_kv(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping):
        """Rotated q; the rotated k and v go to their cache slots."""
        q, k = ref.rotary_ref(q, k, positions, cos_sin_cache)
        ref.write_kv_cache_ref(k, v, kv_cache, slot_mapping)
        return q

    @staticmethod
    def attention(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return ref.paged_attention_ref(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, meta.max_seq_len, scale,
        )  # fmt: skip


class TritonOps(_Compositions):
    """Fused Triton kernels; decode-only steps take the split-context decode kernel, and
    batch-1 projections the GEMV kernel (when `use_gemv`), with the norms, SiLU-and-mul and
    residual adds around them folded in (when `fuse_decode` too)."""

    name = "triton"

    def __init__(self) -> None:
        from lantau.kernels import (
            activation,
            embedding,
            gemv,
            kv_cache_write,
            paged_attention,
            rms_norm,
            rotary,
        )

        self._act, self._kv, self._gemv = activation, kv_cache_write, gemv
        self._embedding = embedding
        self._attn, self._norm, self._rope = paged_attention, rms_norm, rotary
        self.use_gemv = True
        self.gemv_max_m = 1  # see lantau/kernels/gemv.py: faster than cuBLAS at 1 row only
        self.fuse_rope_kv = True
        # batch 1: rotary and the KV-cache write in qkv_proj's GEMV epilogue (its norm folded
        # in too with `fuse_decode`). NOTE: off: no measurable gain on the H200 (W2 4.070 vs
        # 4.085, graph 3.986 vs 3.990; with early KV loads 4.006 vs 4.002, same run,
        # runs/2026-12-03h-gemv_ab.log)
        self.fuse_qkv_rope = False
        # batch 1: the norms and residual adds folded into the GEMVs, the SiLU-and-mul into
        # gate_up's (`fuses`). NOTE: off: slower on the H200 every way tried. Graph at 384 keys,
        # same run (runs/2026-12-03y-norm_sweep.log): 3.751 / 3.753 ms apart; 3.972 with every
        # GEMV program summing its row's squares; 3.823 with the sums handed over (norm_sums);
        # 3.784 with the norms' weights folded into the projections too (fold_norm_weights).
        # W2 3.845 / 3.846 and 3.802 / 3.802 vs 3.771 / 3.769 ms/token. Real-weight parity of
        # the decode logits 1.41e-2 and 1.55e-2 (9.34e-3 apart; runs/2026-12-03y-parity_*.log).
        # Nor did the add + norm done by the o / down GEMV launch's last program (an atomic
        # count, no work added to the other programs): 3.892 / 3.818 vs 3.794 ms
        # (runs/2026-12-03zj-w2_chain.log)
        self.fuse_decode = False
        # with fuse_decode: each residual write leaves the row's sum of squares for the norm
        # folded into the next GEMV (NormSums), so no GEMV program sums the row itself (the
        # figures above)
        self.norm_sums = True
        # batch 1: the SiLU-and-mul in the gate_up GEMV's epilogue (one launch, no gate_up write;
        # each program preloads its gate rows and their up rows). W2 3.969 vs 4.010 ms/token,
        # graph 3.907 vs 3.943 ms, same run, greedy tokens and logits equal
        # (runs/2026-12-03l-gemv_l2.log; before the preload and the paired rows it was slower:
        # 4.410 vs 4.308, runs/2026-12-03c-w2_profile.log)
        self.fuse_gate_silu = True
        # split decode attention merges in its own launch (else a second kernel)
        self.fuse_attn_merge = True
        # decode attention's grid with a request's kv heads side by side (paged_attention.py):
        # 4.38 vs 4.32 TB/s at W3-1000's shape (runs/2026-12-03b-grid_order.log); in the engine
        # 22.70 / 22.35 ms a step on, 23.22 off in between (runs/2026-12-03c-w3_host.log)
        self.attn_heads_first = True
        # decode-only steps of at most this many rows: each attention split's first tile of
        # keys and values is loaded before the PDL wait (paged_decode_attention's early_kv).
        # W2 4.002 vs 4.085 / 4.086 ms/token, graph 3.898 vs 3.990 ms, same run
        # (runs/2026-12-03h-gemv_ab.log); measured at 1 row, 2-8 by analogy (latency-bound)
        self.attn_early_kv_rows = 8
        # the norms' weights, and rotary's positions, cos/sin and slots, loaded before the PDL
        # wait (pdl.py's contract): no measurable effect on the H200 (W2 3.913 vs 3.907 off,
        # same run, runs/2026-12-03m-gemv_ab.log); one dependent load fewer after the wait
        self.early_inputs = True
        # decode attention's in-launch merge for batches above attn_early_kv_rows: splits of
        # partials loaded at once (None: all, up to paged_attention.default_merge_chunk; 1: one
        # by one; 0: unrolled, one load a split)
        self.attn_merge_chunk: int | None = None
        # the same for early-KV batches, and their (BLOCK_N, num_warps, num_stages) (None: the
        # kernel's 64 keys over 4 warps, where ptxas spills): the unrolled merge over 64-key
        # tiles and 8 warps (no spills). W2 3.839 / 3.839 vs 3.887 / 3.884 ms/token (chunks of
        # 16 over 64 x 4), same run (runs/2026-12-03s-fused_norms.log; 3.840 vs 3.886 in
        # runs/2026-12-03r); batch-1 attention alone 5.67 vs 7.39 us at 384 keys, 7.69 vs 10.32
        # at 2,048, 19.2 vs 21.2 at 8,192, 70.3 vs 70.1 at 32,768. Either alone gains less
        # (graph at 384 keys 3.885 and 3.903 vs 3.824 together, 3.915 neither)
        self.attn_early_merge_chunk: int | None = 0
        self.attn_early_config: tuple[int, int, int] | None = (64, 8, 2)
        # early-KV batches whose contexts are all at most attn_short_keys long: this
        # (BLOCK_N, num_warps, num_stages) instead, over attn_short_keys / BLOCK_N splits (one
        # tile each, so no loop to pipeline); the decode graphs capture such batches apart
        # (short_context_keys), so long contexts keep attn_early_config (at 32k keys 64 x 8 at
        # 1 stage takes 93.2 us a launch, 70.7 at 2, runs/2026-12-03u-final_w2.log). W2 3.767 /
        # 3.768 vs 3.786 / 3.786 ms/token, same run, alternated; 3.771 / 3.771 with
        # attn_short_keys 512 (runs/2026-12-03x-sweep.log)
        self.attn_short_config: tuple[int, int, int] | None = (64, 8, 1)
        self.attn_short_keys = 1024
        # early-KV decode attention's register cap a thread (paged_decode_attention's
        # `maxnreg`). NOTE: off: at 168 (no spills; room for one preloading o_proj program
        # beside each attention program, none at 254) with gemv_maxnreg 168 too, W2 3.782 /
        # 3.781 vs 3.786 / 3.786 ms/token, same run (runs/2026-12-03x-sweep.log): within noise
        self.attn_early_maxnreg: int | None = None
        # decode attention's splits of each context (None: paged_attention.default_num_splits)
        self.attn_num_splits: int | None = None
        # early-KV batches: decode attention's splits merged by a second launch, not in-launch
        self.attn_early_merge_kernel = False
        # decode batches of at most attn_early_kv_rows: rotary and the KV write inside decode
        # attention (paged_decode_attention's `rope`), one launch a layer fewer. With the
        # unrolled 64 x 8 attention: W2 3.783 / 3.783 vs 3.790 / 3.790 ms/token, graph 3.765 vs
        # 3.775 / 3.772 ms, same run (runs/2026-12-03t-rope_fusions.log); over the spilling
        # 64 x 4 attention it was slower (3.959 vs 3.905, runs/2026-12-03n-gemv_ab.log)
        self.fuse_rope_attention = True
        # (N, K) -> GEMV tile configuration to use instead of gemv.default_config (tuning)
        self.gemv_configs: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        # batch 1, K <= preload_max_k: each GEMV program loads its whole weight slice
        # before waiting on the previous kernel (gemv's `preload`); tiles in preload_configs.
        # W2 4.122 vs 4.323 ms/token, same run (runs/2026-12-03e-gemv_preload.log); real-weight
        # parity decode 9.3e-3, as without (runs/2026-12-03f-parity_preload.log)
        self.gemv_preload = True
        # the preloading GEMVs' register cap (gemv's `maxnreg`; None: ptxas's choice, 185 for
        # 4 rows x 4 warps, 2 programs an SM). NOTE: off: 168 fits 3 programs an SM (no
        # spills), yet W2 took 3.787 / 3.786 vs 3.786 / 3.786 ms/token, same run
        # (runs/2026-12-03x-sweep.log)
        self.gemv_maxnreg: int | None = None
        # down_proj's K = 14336 preloading (gemv allows it) was slower: graph at 384 keys 3.821
        # to 4.327 ms over 4 tilings vs 3.794 (runs/2026-12-03zj-w2_chain.log)
        self.preload_max_k = 4096
        self.preload_configs: dict[tuple[int, int], tuple[int, int, int, int]] = {}

    def embed(self, input_ids, weight, pick_src=None, prev_ids=None, sumsq_out=None):
        """TorchOps.embed in one launch (the pick included; the row's sum of squares too, with
        `norm_sums`)."""
        sumsq_out = sumsq_out if self.norm_sums else None
        return self._embedding.embedding(input_ids, weight, pick_src, prev_ids, sumsq_out)

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        if self.use_gemv and x.shape[0] <= self.gemv_max_m:
            return self._gemv_linear(x, layer)
        return F.linear(x, layer.weight, layer.bias)

    def _gemv_linear(self, x, layer: torch.nn.Linear, **fusions) -> torch.Tensor:
        shape = tuple(layer.weight.shape)
        if self.gemv_preload and x.shape[0] == 1 and shape[1] <= self.preload_max_k:
            config = self.preload_configs.get(shape)
            if self.gemv_maxnreg is not None:
                fusions["maxnreg"] = self.gemv_maxnreg
            return self._gemv.gemv(x, layer.weight, layer.bias, config, preload=True, **fusions)
        return self._gemv.gemv(x, layer.weight, layer.bias, self.gemv_configs.get(shape), **fusions)

    def fuses(self, num_rows: int) -> bool:
        return self.use_gemv and self.fuse_decode and num_rows == 1

    def _norm_fusions(self, norm, sumsq) -> dict:
        """The GEMV's fusions for a norm before it: its weight unless folded into the GEMV's
        (RMSNorm.folded), and the row's sum of squares when handed over (`norm_sums`)."""
        fusions = dict(norm=True, eps=norm.eps)
        if not norm.folded:
            fusions["norm_weight"] = norm.weight
        if self.norm_sums and sumsq is not None:
            fusions["sumsq"] = sumsq
        return fusions

    def norm_linear(self, h, norm, layer: torch.nn.Linear, sumsq=None) -> torch.Tensor:
        if self.fuses(h.shape[0]):
            return self._gemv_linear(h, layer, **self._norm_fusions(norm, sumsq))
        return super().norm_linear(h, norm, layer)

    def linear_add(self, x, layer: torch.nn.Linear, residual, sumsq_out=None) -> torch.Tensor:
        if self.fuses(x.shape[0]):
            sums = {"sumsq_out": sumsq_out} if self.norm_sums and sumsq_out else {}
            return self._gemv_linear(x, layer, residual=residual, **sums)
        return super().linear_add(x, layer, residual)

    def norm_linear_silu_mul(self, h, norm, layer: torch.nn.Linear, sumsq=None) -> torch.Tensor:
        if self.fuses(h.shape[0]):
            return self._gemv_linear(h, layer, gated=True, **self._norm_fusions(norm, sumsq))
        return super().norm_linear_silu_mul(h, norm, layer)

    def qkv_rotary_write_kv(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        slot_mapping, norm=None, sumsq=None,
    ) -> torch.Tensor:  # fmt: skip
        rows = x.shape[0]
        if (
            self.use_gemv and self.fuse_qkv_rope and rows == 1
            and (norm is None or self.fuses(rows))
        ):  # fmt: skip
            rope = self._gemv.Rope(positions, cos_sin_cache, kv_cache, slot_mapping)
            fusions = {} if norm is None else self._norm_fusions(norm, sumsq)
            return self._gemv_linear(x, layer, rope=rope, **fusions).view(1, num_heads, -1)
        return super().qkv_rotary_write_kv(
            x, layer, num_heads, positions, cos_sin_cache, kv_cache, slot_mapping, norm, sumsq
        )

    def qkv_attention(
        self, x, layer: torch.nn.Linear, num_heads, positions, cos_sin_cache, kv_cache,
        meta: AttentionMetadata, scale: float, norm=None, sumsq=None,
    ) -> torch.Tensor:  # fmt: skip
        """Small decode batches (early KV loads): rotary and the KV write inside the attention
        launch (`fuse_rope_attention`), one launch fewer a layer."""
        rows = x.shape[0]
        qkv_rope = self.use_gemv and self.fuse_qkv_rope and rows == 1
        if not (
            self.fuse_rope_attention and meta.is_decode_only and not qkv_rope
            and rows <= self.attn_early_kv_rows
        ):  # fmt: skip
            return super().qkv_attention(
                x, layer, num_heads, positions, cos_sin_cache, kv_cache, meta, scale, norm, sumsq
            )
        qkv = self.linear(x, layer) if norm is None else self.norm_linear(x, norm, layer, sumsq)
        num_kv_heads, head_dim = kv_cache.shape[3:]
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        rope = self._attn.DecodeRope(k, v, positions, cos_sin_cache, meta.slot_mapping)
        return self._decode_attention(q, kv_cache, meta, scale, rope)

    def linear_silu_mul(self, x, layer: torch.nn.Linear) -> torch.Tensor:
        if self.use_gemv and self.fuse_gate_silu and x.shape[0] == 1:
            return self._gemv_linear(x, layer, gated=True)
        return super().linear_silu_mul(x, layer)

    def rms_norm(self, x, weight, eps) -> torch.Tensor:
        return self._norm.rms_norm(x, weight, eps, early=self.early_inputs)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        # in place on both
        self._norm.fused_add_rms_norm(x, residual, weight, eps, early=self.early_inputs)
        return x, residual

    def rotary_and_write_kv(self, q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping):
        """One kernel: q rotated in place, rotated k and v stored to their cache slots (two,
        rotary then KV write, when `fuse_rope_kv` is off: for same-run comparisons)."""
        if not self.fuse_rope_kv:
            self._rope.apply_rotary(q, k, positions, cos_sin_cache)
            self._kv.write_kv_cache(k, v, kv_cache, slot_mapping)
            return q
        self._rope.apply_rotary_and_write_kv(
            q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, early=self.early_inputs
        )
        return q

    def silu_and_mul(self, x) -> torch.Tensor:
        return self._act.silu_and_mul(x)

    def _decode_attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, rope=None):
        """Split-context decode attention with this instance's knobs (early KV loads for up to
        attn_early_kv_rows rows, with their tiling and merge); `rope` as
        paged_decode_attention's. Returns out, [num_reqs, num_heads, head_dim]."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        early_kv = q.shape[0] <= self.attn_early_kv_rows
        second_merge = not self.fuse_attn_merge or early_kv and self.attn_early_merge_kernel
        config, num_splits = self.attn_early_config if early_kv else None, self.attn_num_splits
        if self.short_context_keys(q.shape[0]) >= meta.max_seq_len:
            config = self.attn_short_config
            num_splits = -(-self.attn_short_keys // config[0])  # one tile a split
        self._attn.paged_decode_attention(
            q, kv_cache, out, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale,
            merge_kernel=second_merge, heads_first=self.attn_heads_first, early_kv=early_kv,
            merge_chunk=self.attn_early_merge_chunk if early_kv else self.attn_merge_chunk,
            num_splits=num_splits, config=config, rope=rope,
            maxnreg=self.attn_early_maxnreg if early_kv else None,
        )  # fmt: skip
        return out

    def short_context_keys(self, num_rows: int) -> int:
        """The context length up to which a decode batch of num_rows rows takes
        attn_short_config (0: none): CUDA graphs capture such batches apart."""
        if self.attn_short_config is None or num_rows > self.attn_early_kv_rows:
            return 0
        return self.attn_short_keys

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode_attention(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        self._attn.unified_attention(
            q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, meta.max_seq_len, scale,
        )  # fmt: skip
        return out


Ops = TorchOps | TritonOps


def make_ops(name: str) -> Ops:
    if name == "torch":
        return TorchOps()
    if name == "triton":
        require_triton("attention_backend='triton'")
        return TritonOps()
    raise ValueError(f"attention_backend: {name!r} is not one of torch, triton")
