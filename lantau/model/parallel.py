"""Tensor parallelism in Megatron's layout: each of `size` ranks holds 1/size of every layer's
attention heads (q, k and v alike, so each rank's KV cache holds its own heads) and of its MLP's
intermediate columns, and 1/size of lm_head's vocabulary rows. o_proj and down_proj each end in
an all-reduce (the sum of the ranks' partial products); the logits in an all-gather. The
embedding and the norms are whole on every rank.

    x ──► qkv_proj (column split: this rank's heads) ─► attention ─► o_proj (row split) ─► Σ ranks
      ──► gate_up_proj (column split) ─► SiLU·mul ─► down_proj (row split) ─► Σ ranks
      ──► lm_head (its vocabulary rows) ─► all-gather ─► [tokens, vocab]

A rank's tensors are slices of the whole model's (`TensorParallel.shard`): a checkpoint loads
the same on every rank, each taking its part, and random weights are drawn whole and sliced,
so a model split over N ranks computes what it computes on one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the fused parameters' parts, in the order they are stacked (their sizes: q_size, kv_size,
# intermediate_size; `TensorParallel.shard`)
_STACKED = {"qkv_proj": ("q", "kv", "kv"), "gate_up_proj": ("i", "i")}
# HF's unfused projections: what each is a part of
_PART_OF = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "i", "up_proj": "i"}
_ROW_SPLIT = frozenset({"o_proj", "down_proj"})  # their input columns split: outputs summed


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (size 1: the whole model here)."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group (None: the world's)

    def part(self, n: int, what: str) -> slice:
        """This rank's share of n rows (or columns); ValueError when n does not split."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({n})")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, rank 0's first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, name: str, whole: torch.Tensor, config) -> torch.Tensor:
        """This rank's slice of the whole model's tensor `name`: a fused parameter's name
        (`...qkv_proj.weight`, `...gate_up_proj.weight`) or an HF one (`...q_proj.weight`);
        the whole tensor for what every rank holds (embedding, norms). A view where it can."""
        axis = split_axis(name)
        if self.size == 1 or axis is None:
            return whole
        module = name.split(".")[-2]
        sizes = {"q": config.q_size, "kv": config.kv_size, "i": config.intermediate_size}
        if module in _STACKED:  # each stacked part split, the rank's pieces stacked again
            pieces, start = [], 0
            for kind in _STACKED[module]:
                piece = whole[start : start + sizes[kind]]
                pieces.append(piece[self.part(sizes[kind], f"{module} {kind}")])
                start += sizes[kind]
            return torch.cat(pieces)
        if module in _PART_OF:
            kind = _PART_OF[module]
            return whole[self.part(sizes[kind], f"{module} {kind}")]
        if axis == 1:
            return whole[:, self.part(whole.shape[1], f"{module} input columns")]
        return whole[self.part(whole.shape[0], "vocab_size")]  # lm_head

    def shard_row_values(self, name: str, per_row: torch.Tensor, config) -> torch.Tensor:
        """This rank's part of a vector with one value a row of the whole tensor `name` (an
        fp8 weight's row scales): sliced as those rows are, whole where the ranks split the
        columns or nothing."""
        if split_axis(name) != 0:
            return per_row
        return self.shard(name, per_row[:, None], config)[:, 0]

    def whole_shape(self, name: str, shape: torch.Size) -> tuple[int, ...]:
        """The whole model's shape of a tensor whose slice on this rank has `shape`."""
        whole = list(shape)
        axis = split_axis(name)
        if axis is not None:
            whole[axis] *= self.size
        return tuple(whole)


def split_axis(name: str) -> int | None:
    """The axis a tensor's ranks split (0: its rows, 1: its input columns), None: whole on
    every rank."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _STACKED or module in _PART_OF:
        return 0
    if module in _ROW_SPLIT:
        return 1 if parts[-1] == "weight" else None
    return 0 if name == "lm_head.weight" else None


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device
) -> TensorParallel:
    """Join the group of `size` ranks at `init_method` (a `tcp://host:port` or `file://`
    address every rank is given): NCCL for ranks on GPUs, gloo on the CPU (the tests, or
    `--device cpu` on a machine that has GPUs too)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size
    )
    return TensorParallel(rank, size, torch.distributed.group.WORLD)
