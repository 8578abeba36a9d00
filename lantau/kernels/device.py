"""What a kernel's launch reads of its device: the number of SMs its grid spreads over."""

from __future__ import annotations

import functools

import torch

DEFAULT_NUM_SMS = 132  # H100 / H200; used off CUDA (the interpreter)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (DEFAULT_NUM_SMS for a CPU tensor's device)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
