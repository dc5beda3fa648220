"""The Hopper kernel's persistent grid: the two work counters its programs take items from.

A persistent launch (one program per multiprocessor) hands out work items through a global
counter that the kernel increments atomically and leaves at zero when it ends; a launch
with one program per item never reads it. The buffers live here, one per device and
stream, so launches reuse them instead of allocating and zeroing a pair each time.
"""

from __future__ import annotations

import torch

_COUNTERS: dict = {}
#: One-program-per-item launches never read the counters: one buffer per device serves them.
_NO_COUNTER: dict = {}


def unread_counter(device: torch.device) -> torch.Tensor:
    if device.type != "cuda":  # arguments built on the CPU (tests, compiles): a fresh pair
        return torch.empty(2, device=device, dtype=torch.int32)
    if device.index not in _NO_COUNTER:
        _NO_COUNTER[device.index] = torch.empty(2, device=device, dtype=torch.int32)
    return _NO_COUNTER[device.index]


def work_counter(device: torch.device) -> torch.Tensor:
    """The persistent grid's two work counters on ``device``, zeroed once: the kernel
    leaves them at zero, so every launch on the device's streams takes them in turn (launches
    on one stream run one after another)."""
    if device.type != "cuda":  # arguments built on the CPU (tests, compiles): a fresh pair
        return torch.zeros(2, device=device, dtype=torch.int32)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, device=device, dtype=torch.int32)
    return _COUNTERS[key]
