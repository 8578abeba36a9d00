"""FP8 (e4m3) weights for the decoder's linear layers (`--dtype fp8`).

Each weight row (output channel) has its own fp32 scale, and each activation row (token) is
scaled on the fly, so a product is

    y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k]      (xq, wq e4m3; xs, ws fp32)

which is what `torch._scaled_mm` computes with row-wise scales (the CUDA path, bf16 out; it
runs on CPU too). `fp8_linear_ref` is the same product emulated in fp32: the reference the
torch backend runs and the tests compare against. Embedding, norms and lm_head stay in the
activation dtype. Only the math and the layer live here; the batch-1 GEMV reads the e4m3
weights itself (lantau/kernels/gemv.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# NOTE: an all-zero row gets this scale, not 0: its quantized values stay 0 and nothing divides
# by zero
MIN_SCALE = 1e-12
# row-wise _scaled_mm needs compute capability 8.9 (Ada) or newer
MIN_CAPABILITY = (8, 9)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled so its largest magnitude maps to E4M3_MAX, then rounded to e4m3.

    t: [R, C] (any float dtype) -> (q [R, C] e4m3, scale [R] fp32), t ~ q * scale[:, None].
    Weights are quantized by output channel and activations by token with this one function.
    """
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)  # [R]
    q = (t32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [R, C] e4m3, scale [R] -> [R, C] in dtype."""
    return (q.float() * scale[:, None]).to(dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """A checkpoint's e4m3 weight with one fp32 scale a row (a tensor-wide scale repeated):
    copied into an Fp8Linear as it is, or dequantized for a layer kept wide."""

    q: torch.Tensor  # [N, K] e4m3
    scale: torch.Tensor  # [N] fp32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.q, self.scale, dtype)


@dataclass(frozen=True)
class BlockQuantizedWeight:
    """A checkpoint's e4m3 weight with a scale a [rows, columns] block: no row-wise form, so it
    is dequantized where the model lives (`dequantize(device)`), and an Fp8Linear quantizes
    it again by row."""

    q: torch.Tensor  # [N, K] e4m3
    scale: torch.Tensor  # [ceil(N / rows), ceil(K / columns)] fp32
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, device: torch.device | None = None) -> torch.Tensor:
        """[N, K] fp32 on `device` (the host's copy of the e4m3 bytes only crosses once)."""
        (rows, columns), (n, k) = self.block, self.q.shape
        q, scale = self.q.to(device), self.scale.to(device)
        wide = scale.repeat_interleave(rows, dim=0)[:n].repeat_interleave(columns, dim=1)
        return q.float() * wide[:, :k]


def checkpoint_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> QuantizedWeight | BlockQuantizedWeight:
    """An FP8 checkpoint's weight q [N, K] (e4m3) with its scale (lantau/model/hf_quant.py):
    one for the tensor ([] or [1]) or one a row ([N] or [N, 1]) gives a QuantizedWeight as
    stored; one a `block` of [rows, columns] ([ceil(N / rows), ceil(K / columns)]) a
    BlockQuantizedWeight. ValueError for a scale of another shape."""
    if q.dtype != E4M3 or q.dim() != 2:
        raise ValueError(f"a {q.dtype} weight of shape {tuple(q.shape)}: only 2-D e4m3fn is read")
    n, k = q.shape
    scale = scale.float()
    if scale.numel() == 1:
        return QuantizedWeight(q, scale.reshape(1).expand(n).contiguous())
    if tuple(scale.shape) in ((n,), (n, 1)):
        return QuantizedWeight(q, scale.reshape(n).contiguous())
    if block is not None and scale.shape == (math.ceil(n / block[0]), math.ceil(k / block[1])):
        return BlockQuantizedWeight(q, scale, block)
    layout = f"blocks of {block[0]}x{block[1]}" if block else "no blocks"
    raise ValueError(
        f"scale of shape {tuple(scale.shape)} fits neither the tensor, its {n} rows nor "
        f"{layout} of the weight's {n}x{k}"
    )


class Fp8Linear(nn.Module):
    """A linear layer whose weight is e4m3 with one fp32 scale a row; bias in the activation
    dtype. Allocated in e4m3 directly (no wide intermediate); filled by `load_rows`. NOTE:
    build it with the activation dtype as torch's default; `.to(dtype)` would widen the e4m3."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # NOTE: parameters so that they move and load like nn.Linear's; never trained
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32), False)
        self.bias = nn.Parameter(torch.zeros(out_features), False) if bias else None

    @torch.no_grad()
    def load_rows(self, rows: slice, weight: torch.Tensor | QuantizedWeight) -> None:
        """Quantize `weight` (the rows `rows` of the full matrix, any float dtype, any device)
        on this layer's device into those rows: one tensor at a time, so loading needs no
        more than one wide tensor beside the model. A QuantizedWeight (an FP8 checkpoint's)
        is copied as it is."""
        if isinstance(weight, QuantizedWeight):
            q, scale = weight.q, weight.scale
        else:
            q, scale = quantize_rows(weight.to(self.weight.device))
        self.weight[rows].copy_(q)
        self.weight_scale[rows].copy_(scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


def fp8_linear_ref(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """_scaled_mm's product emulated in fp32: x quantized by token, both sides dequantized.
    x: [M, K] -> [M, N] in x's dtype."""
    xq, xs = quantize_rows(x)
    w = dequantize_rows(layer.weight, layer.weight_scale)  # [N, K] fp32
    y = dequantize_rows(xq, xs) @ w.T
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x.dtype)


def scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    fast_accum: bool = True,
) -> torch.Tensor:
    """`torch._scaled_mm` with row-wise scales: xq [M, K] e4m3 with its row scales xs [M], wq
    [N, K] e4m3 with ws [N] -> [M, N] bf16 (CUDA: tensor cores, compute capability 8.9+; CPU
    too). NOTE: Hopper's fp8 tensor cores sum the products in an accumulator narrower than
    fp32; without fast accumulation the kernel moves the sum into fp32 registers every few K
    steps (CUTLASS's promotion), at a cost in throughput. The model accumulates fast, as vLLM's
    and TensorRT-LLM's fp8 GEMMs do (no effect on CPU)."""
    return torch._scaled_mm(
        xq,
        wq.t(),  # [K, N] column-major, as _scaled_mm wants its second operand
        scale_a=xs[:, None],  # [M, 1]
        scale_b=ws[None, :],  # [1, N]
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def unscaled_mm(
    xq: torch.Tensor, wq: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`torch._scaled_mm` with unit tensor-wise scales: xq [M, K] @ wq [N, K]^T -> the raw
    product [M, N] (fast accumulation, as scaled_mm), still to be multiplied by the rows' and
    columns' scales by whatever reads it. The unit scale is one tensor a device (CUDA graphs
    keep its address)."""
    one = _UNIT_SCALES.get(xq.device)
    if one is None:
        one = _UNIT_SCALES[xq.device] = torch.ones((), dtype=torch.float32, device=xq.device)
    return torch._scaled_mm(
        xq, wq.t(), scale_a=one, scale_b=one, out_dtype=out_dtype, use_fast_accum=True
    )


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    layer: Fp8Linear,
    xq: torch.Tensor | None = None,
    xs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's product through `scaled_mm`. x: [M, K] bf16 -> [M, N] bf16. xq, xs: x
    already quantized (the Triton kernel's)."""
    if xq is None:
        xq, xs = quantize_rows(x)
    y = scaled_mm(xq, xs, layer.weight, layer.weight_scale)
    if layer.bias is not None:
        y = y + layer.bias
    return y.to(x.dtype)


def check_device(device: torch.device) -> None:
    """Raise where FP8 weights cannot run: a CUDA GPU without row-wise FP8 matmuls."""
    if device.type != "cuda":
        return  # CPU: _scaled_mm and the reference both run
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"dtype='fp8' needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
            f" or newer (Ada, Hopper, Blackwell) for its FP8 matmuls; {name} is "
            f"{capability[0]}.{capability[1]}: use dtype='bfloat16'"
        )


def linear_layer(in_features: int, out_features: int, bias: bool, quantization: str | None):
    """The model's projection layer: nn.Linear, or Fp8Linear for quantization='fp8'."""
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias=bias)


# the torch backend's product of one layer (F.linear, or the fp8 reference)
def linear_ref(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    if isinstance(layer, Fp8Linear):
        return fp8_linear_ref(x, layer)
    return F.linear(x, layer.weight, layer.bias)
