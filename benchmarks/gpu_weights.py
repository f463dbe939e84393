"""Random packed W4A16 weights for the kernel benchmarks: timing does not depend on the values, only on
the shapes, so every benchmark draws them the same way."""

from __future__ import annotations


def random_packed(n: int, k: int, group_size: int, seed: int, device="cuda") -> dict:
    """An [n, k] weight in the packed layout (`vlmctl.formats.w4a16`): random codes and zero points, and
    scales in 0.001-0.005 (|W| ~ 0.02, as in a typical AWQ layer), drawn from a generator seeded `seed`."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=gen, device=device, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // group_size, generator=gen, device=device) * 0.004 + 0.001).half()
    return {"q4weight": words, "q4scales": scales, "q4zeros": zeros}
