"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

A batch-1 decode step is ~230 kernels of a few microseconds each; between two of them the GPU
drains one grid and ramps up the next. Launched with PDL, a kernel's programs may start while
the previous kernel's last programs still run: they read what no kernel writes (weights) and
then wait in `griddepcontrol.wait` until the previous grid has finished and its writes are
visible.

The contract every kernel taking `USE_PDL` keeps, in every program, on every path:
1. before `pdl_wait` it loads only tensors no kernel writes (weights, the rotary cos/sin
   cache) and stores nothing; the exceptions, small-batch decode attention and the fused
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

import torch
import triton
import triton.language as tl

from lantau import envs


@functools.cache
def _supported(index: int | None) -> bool:
    if envs.triton_interpret():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device, on: bool) -> dict:
    """Kwargs for launching a kernel that takes USE_PDL: the constexpr, and the launch flag when
    `on` (KernelConfig.enable_pdl) and the device has PDL (left out when off, as the
    interpreter takes no such flag)."""
    if on and device.type == "cuda" and _supported(device.index):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one to finish (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
