"""An engine's share of a GPU: `gpu_memory_utilization` of the card is this engine's, whatever
other processes on the card hold (another model's engine, the version being swapped out).

At start (`MemoryBaseline.take`, before the weights) the engine notes what the card already
holds and checks that its share is free; the KV cache then gets the share less what this
engine itself holds beside it: its weights and a worst-case step's activations (the profiled
peak) and what it allocated outside torch since it started (cuBLAS workspaces, NCCL buffers),
and never more than is free on the card (`kv_cache_budget`). So two engines of 0.45 each share
one card, as with vLLM, and a share that is not free fails at once with a message naming what
is, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryBaseline:
    """The card when the engine started: bytes in use on it (other processes' and this
    process's CUDA context), and this process's torch allocator counters (non-zero when an
    engine already runs in the same process)."""

    used: int
    reserved: int
    allocated: int

    @classmethod
    def take(cls, device, utilization: float) -> MemoryBaseline | None:
        """On CUDA, the baseline, after checking that the engine's share of the card is free
        (ValueError, saying "out of memory", otherwise); None elsewhere."""
        import torch

        if torch.device(device).type != "cuda":
            return None
        import gc

        gc.collect()  # an engine of this process let go of (LLM twice): its memory back
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        check_share_free(free, total, utilization, str(device))
        return cls(
            used=total - free,
            reserved=torch.cuda.memory_reserved(device),
            allocated=torch.cuda.memory_allocated(device),
        )


def engine_memory_baseline(config, device) -> MemoryBaseline | None:
    """The baseline an engine (or a tensor-parallel rank) on `device` takes before its
    weights; None off CUDA or where the KV cache's size is given (`num_kv_blocks`)."""
    if config.cache.num_blocks:
        return None
    return MemoryBaseline.take(device, config.cache.gpu_memory_utilization)


def check_share_free(free: int, total: int, utilization: float, device: str) -> None:
    share = int(total * utilization)
    if share > free:
        raise ValueError(
            f"out of memory: gpu_memory_utilization {utilization:g} asks for "
            f"{share / GIB:.1f} GiB of {device}'s {total / GIB:.1f} GiB, but only "
            f"{free / GIB:.1f} GiB are free (other processes hold the rest); lower "
            f"--gpu-memory-utilization to {int(free / total * 100) / 100:.2f} or less, or free "
            "the card"
        )


def kv_cache_budget(
    baseline: MemoryBaseline,
    *,
    total: int,
    free: int,
    reserved: int,
    allocated: int,
    peak: int,
    utilization: float,
) -> int:
    """Bytes the KV cache may take, measured after a worst-case step and an empty_cache:
    `free`, `reserved`, `allocated` as the card and torch's allocator say now, `peak` the
    step's highest allocation (the profiling run's own cache left out), all in bytes."""
    held = allocated - baseline.allocated  # this engine's weights
    peak_activations = max(peak - allocated, 0)
    outside_torch = max(total - free - baseline.used - (reserved - baseline.reserved), 0)
    share = int(total * utilization) - outside_torch - (held + peak_activations)
    # what the card has free for it, the activations' peak coming back out of it
    on_card = free + (reserved - allocated) - peak_activations
    return min(share, on_card)
