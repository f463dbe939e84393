"""Small host-to-device copies that do not wait for the device.

The engine launches a step (decode rows, prompt chunks) before it reads the previous step's tokens (async
scheduling), so nothing on the way may synchronize with the stream. `torch.tensor(values, device="cuda")`
does: it copies from pageable memory, blocking until the stream's queued work is done. Through pinned memory the copy is queued
like any kernel; the caching host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations


def to_device(values, dtype, device):
    """`values` (a list or a numpy array; dtype None keeps the array's) as a tensor on `device`, without
    waiting for the device's queued work."""
    import torch

    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
