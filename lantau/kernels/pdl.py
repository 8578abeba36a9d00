"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

A batch-1 decode step is ~230 kernels of a few microseconds each; between two of them the GPU
drains one grid and ramps up the next. Launched with PDL, a kernel's programs may start while
the previous kernel's last programs still run: they read what no kernel writes (weights) and
then wait in `griddepcontrol.wait` until the previous grid has finished and its writes are
visible.

The contract every kernel taking `USE_PDL` keeps, in every program, on every path:
1. before `pdl_wait` it loads only tensors no kernel writes (weights, the rotary cos/sin
   cache) and stores nothing; the exceptions, decode attention's `early_kv` and the fused
   rotary + KV write, load cache slots and step inputs (positions, slots, sequence lengths,
   block tables) that no kernel of the running step writes, the step's first kernel waiting
   for the host-to-device copy of those inputs (in stream order, or through an event when
   the copy runs on a copy stream: cuda_graph.py) and for every earlier kernel;
2. it calls `pdl_wait` before anything else but those loads, early returns included.
Then each kernel starts only after all earlier ones have finished (by induction), so buffers
the caching allocator hands out again are never written early.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_enabled = os.environ.get("LANTAU_PDL", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (for same-run comparisons)."""
    global _enabled
    _enabled = enabled


def enabled(device: torch.device) -> bool:
    return _enabled and device.type == "cuda" and _supported(device.index)


@functools.cache
def _supported(index: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device, on: bool = True) -> dict:
    """Kwargs for launching a kernel that takes USE_PDL: the constexpr, and the launch flag when
    on (left out when off, as the interpreter takes no such flag). `on` False: off for this
    launch whatever the device (a kernel's own knob, for same-run comparisons)."""
    if on and enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one to finish (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
