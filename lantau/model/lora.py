"""LoRA adapters (PEFT's folders) served beside their base model, several in one batch.

An adapter is PEFT's `adapter_config.json` and `adapter_model.safetensors`: low-rank pairs
(A [r, in], B [out, r]) on some of each layer's q/k/v/o/gate/up/down projections, adding
x A^T B^T times alpha / r (alpha / sqrt(r) with rslora) to the projection of x. At start
(`--lora-modules NAME=PATH`) each adapter takes a slot, and each fused projection of each
layer holds every slot's pair stacked (`LoRAWeights`: A [slots, R, in], B [slots, out, R]):
q, k and v side by side as the fused qkv's (A's rows one adapter's q, k and v ranks, B block-
diagonal), gate and up alike, the scale folded into B, a projection an adapter leaves alone
zeros. Split over ranks, A and B are sliced as the weight they adapt: a column-split
projection's B by rows, a row-split one's A by columns (its partial deltas are summed by the
all-reduce that sums its partial products).

Each token of a step has its adapter's slot (`LoRABatch.index`, -1: the base model) and
gets its delta after the base product (Ops.linear), before rotary, SiLU-and-mul and the
all-reduce: x A_all^T (every slot's ranks side by side, [tokens, slots * R]) with each token's
other slots' columns masked to zero, times B_all^T. Fixed shapes whatever the batch mixes, so
the CUDA graphs capture it (the slot index is one more row of their input buffers) and a step
of base-model tokens alone runs its graph too; eagerly, such a step skips the deltas.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lantau.errors import ModelLoadError

if TYPE_CHECKING:  # NOTE: the frontend reads --lora-modules here without loading torch
    import torch

# each fused projection: the HF projections it stacks, in order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip
TARGETS = tuple(p for parts in PARTS.values() for p in parts)  # the HF projections adapted
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# PEFT config fields that change what the pairs compute: refused unless at their defaults
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
            "lora_bias": False}  # fmt: skip
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass
class Adapter:
    """One PEFT LoRA adapter, read: its pairs by (layer, HF projection), on the host."""

    name: str
    path: Path
    rank: int
    scale: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def check_name(name: str, what: str = "lora module") -> None:
    """ValueError unless `name` may name an adapter (it is a model name to clients)."""
    if not NAME.match(name):
        raise ValueError(f"{what} {name!r}: a name of letters, digits, . _ : -")


def parse_lora_modules(specs) -> tuple[tuple[str, str], ...]:
    """`--lora-modules NAME=PATH ...` (or vLLM's JSON `{"name": ..., "path": ...}`) to
    (name, path) pairs; ValueError naming the bad one."""
    modules: dict[str, str] = {}
    for spec in specs or ():
        if spec.lstrip().startswith("{"):
            try:
                item = json.loads(spec)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora module {spec!r}: expected NAME=PATH") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not path:
                raise ValueError(f"lora module {spec!r}: expected NAME=PATH")
        check_name(name)
        if name in modules:
            raise ValueError(f"lora module {name!r}: given twice")
        modules[name] = path
    return tuple(modules.items())


def read_adapter(name: str, path: str | Path, model_config) -> Adapter:
    """The adapter at `path` for a model of `model_config`; ModelLoadError saying what does
    not fit (not LoRA, a setting lantau does not apply, a module it does not adapt, a shape
    that is not the model's)."""
    folder = Path(path)
    where = f"lora module {name!r} ({folder})"
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except OSError as e:
        raise ModelLoadError(f"{where}: no adapter_config.json ({e.strerror})") from None
    except ValueError as e:
        raise ModelLoadError(f"{where}: adapter_config.json is not JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{where}: peft_type {config.get('peft_type')!r}, not LORA")
    for key, default in _REFUSED.items():
        if config.get(key, default) not in (default, None, False, {}):
            raise ModelLoadError(f"{where}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"{where}: bias={config['bias']!r} is not supported (only none)")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.exists():
        raise ModelLoadError(f"{where}: no adapter_model.safetensors")
    from safetensors.torch import load_file

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_file).items():
        found = _KEY.search(key)
        if found is None or found.group(2) not in TARGETS:
            raise ModelLoadError(f"{where}: {key!r} is not a pair lantau applies "
                                 f"(it adapts {', '.join(TARGETS)})")  # fmt: skip
        layer, module, half = int(found.group(1)), found.group(2), found.group(3)
        halves.setdefault((layer, module), {})[half] = tensor
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"} or layer >= model_config.num_hidden_layers:
            raise ModelLoadError(f"{where}: layer {layer} {module}: not a whole pair of the "
                                 "model's layers")  # fmt: skip
        a, b = ab["A"], ab["B"]
        size_in, size_out = _shape(module, model_config)
        if tuple(a.shape) != (rank, size_in) or tuple(b.shape) != (size_out, rank):
            raise ModelLoadError(
                f"{where}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"expected ({rank}, {size_in}) and ({size_out}, {rank})"
            )
        pairs[(layer, module)] = (a, b)
    if not pairs:
        raise ModelLoadError(f"{where}: no LoRA pairs in adapter_model.safetensors")
    return Adapter(name, folder, rank, scale, pairs)


def _shape(module: str, c) -> tuple[int, int]:
    """(in, out) of an HF projection of the whole model."""
    return {
        "q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
        "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }[module]  # fmt: skip


@dataclass
class LoRAWeights:
    """Every slot's pair of one fused projection on one rank, side by side: A [slots * R, in]
    (slot s's rows at s * R), B [out, slots * R] (the scale in B)."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int  # R: a slot's rows of A (the parts' ranks stacked)


class LoRABatch:
    """The adapter slot of each token of a step ([tokens] int64 on the device, -1: the base
    model), and the column masks made from it, once a forward for each width."""

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index
        self._masks: dict = {}

    def mask(self, rank: int, width: int, dtype) -> torch.Tensor:
        """[tokens, width]: 1 where column j (slot j // rank) is the token's slot, else 0."""
        import torch

        key = (rank, width, dtype)
        if key not in self._masks:
            slots = torch.arange(width, device=self.index.device) // rank
            self._masks[key] = (slots[None, :] == self.index[:, None]).to(dtype)
        return self._masks[key]


DEFAULT_MAX_RANK = 16  # a runtime adapter's largest rank when no start-up adapter sets it


class AdapterSlots:
    """A model's adapter slots: every fused projection's `lora_weights` sized for
    `num_slots` adapters of rank up to `max_rank`, and which adapter holds which slot.
    Adapters come and go at runtime (`load`, `unload`): a slot's columns are written in
    place, so the CUDA graphs that read them stay valid."""

    def __init__(self, model, num_slots: int, max_rank: int) -> None:
        import torch

        self.model, self.num_slots, self.max_rank = model, num_slots, max_rank
        self.names: dict[str, int] = {}  # adapter -> slot
        device, dtype = model.lm_head.weight.device, model.model.embed_tokens.weight.dtype
        for _, _, target, parts, outs in self._projections():
            width = num_slots * len(parts) * max_rank
            target.lora_weights = LoRAWeights(
                torch.zeros(width, target.in_features, dtype=dtype, device=device),
                torch.zeros(sum(outs), width, dtype=dtype, device=device),
                len(parts) * max_rank,
            )

    def _projections(self):
        """(layer, its attention's or MLP's name prefix, the fused module, its HF parts, each
        part's rows on this rank), each fused projection of each layer."""
        model = self.model
        for i, layer in enumerate(model.model.layers):
            for fused, parts in PARTS.items():
                attn = fused in ("qkv_proj", "o_proj")
                target = getattr(layer.self_attn if attn else layer.mlp, fused)
                prefix = f"model.layers.{i}.{'self_attn' if attn else 'mlp'}"
                outs = [
                    _part_rows(model.tp, f"{prefix}.{p}.weight", _shape(p, model.config)[1])
                    for p in parts
                ]
                yield i, prefix, target, parts, outs

    def load(self, adapter: Adapter) -> int:
        """`adapter` into a free slot (ValueError: its name is taken, its rank too large, no
        slot free); returns the slot."""
        if adapter.name in self.names:
            raise ValueError(f"lora adapter {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"lora adapter {adapter.name!r}: rank {adapter.rank} is over the engine's "
                f"max_lora_rank {self.max_rank}"
            )
        free = sorted(set(range(self.num_slots)) - set(self.names.values()))
        if not free:
            raise ValueError(
                f"lora adapter {adapter.name!r}: all {self.num_slots} slots are taken "
                "(--max-loras); unload one first"
            )
        self._write(free[0], adapter)
        self.names[adapter.name] = free[0]
        return free[0]

    def unload(self, name: str) -> None:
        slot = self.names.pop(name)
        self._write(slot, None)

    def _write(self, slot: int, adapter: Adapter | None) -> None:
        """Slot `slot`'s columns of every projection: the adapter's pairs (this rank's
        slices, the scale in B), or zeros."""
        import torch

        model, r = self.model, self.max_rank
        config, tp = model.config, model.tp
        for i, prefix, target, parts, outs in self._projections():
            w = target.lora_weights
            cols = slice(slot * w.rank, (slot + 1) * w.rank)
            w.a[cols].zero_()
            w.b[:, cols].zero_()
            if adapter is None:
                continue
            row = 0
            for j, part in enumerate(parts):
                pair = adapter.pairs.get((i, part))
                if pair is not None:
                    pa, pb = pair
                    name = f"{prefix}.{part}.weight"
                    if part in ("o_proj", "down_proj"):  # row split: A's input columns
                        pa = tp.shard(name, pa, config)
                    else:  # column split: B's output rows
                        pb = tp.shard(name, pb, config)
                    k, start = adapter.rank, slot * w.rank + j * r
                    w.a[start : start + k] = pa.to(w.a.device, w.a.dtype)
                    w.b[row : row + outs[j], start : start + k] = (
                        pb.to(w.b.device, torch.float32) * adapter.scale
                    ).to(w.b.dtype)
                row += outs[j]


def attach_adapters(
    model, adapters: list[Adapter], max_loras: int = 0, max_rank: int = 0
) -> AdapterSlots | None:
    """`model`'s adapter slots (None: no adapters and no slots asked): `max_loras` slots or
    one per adapter, of rank up to `max_rank` or the adapters' largest, the adapters in them
    in order."""
    num_slots = max(max_loras, len(adapters))
    if not num_slots:
        return None
    rank = max_rank or max((a.rank for a in adapters), default=DEFAULT_MAX_RANK)
    slots = AdapterSlots(model, num_slots, rank)
    for adapter in adapters:
        slots.load(adapter)
    return slots


def _part_rows(tp, name: str, whole_rows: int) -> int:
    """A part's output rows on this rank."""
    if tp.size == 1 or name.split(".")[-2] in ("o_proj", "down_proj"):
        return whole_rows
    return whole_rows // tp.size


def add_lora(y: torch.Tensor, x: torch.Tensor, weights: LoRAWeights, batch: LoRABatch) -> None:
    """y += each token's adapter delta, in place (y: the base product of x, [tokens, out]):
    x A^T over every slot, the other slots' columns masked, times B^T (summed into y by the
    GEMM itself: one launch, no [tokens, out] temporary)."""
    xa = x @ weights.a.t()  # [tokens, slots * R]
    xa *= batch.mask(weights.rank, xa.shape[1], xa.dtype)
    y.addmm_(xa, weights.b.t())
