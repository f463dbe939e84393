"""The fp8 KV cache's format, in one place (`--kv-cache-dtype fp8`).

Each K or V row of one (token, KV head) is stored as float8 e4m3 (OCP "fn": finite, largest 448) with one
float32 scale, the row's largest magnitude / 448, so that a row of any magnitude keeps e4m3's 3 mantissa
bits: no calibration, and no value saturates (keys of real models reach the hundreds; a per-tensor scale of
1, vLLM's default, clips them). The scale costs 4 bytes a row: with 128-wide heads the pool holds 1.94x the
tokens of a 16-bit one. The division rounds to nearest (the Triton kernels use `div_rn` to match), and the
cast to e4m3 rounds to nearest even.

Every attention reads K/V as stored, the chunk that wrote them included: a prompt's prefill attends to its own
K/V read back from the pool, so a token's output does not depend on how its prompt was chunked or whether a
prefix came from the cache.

The Triton kernels read the e4m3 values, convert them to the model dtype (exact) and apply the scale to the
scores (K) and the probabilities (V); the references here dequantize to the model dtype first. The two agree
to the model dtype's rounding (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from ..errors import OptionError

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise OptionError(f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)} (got {name!r})")
    return name


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (e4m3 [..., d], float32 scale [...]): a row of zeros gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize` stored, in `dtype` (one rounding, from float32)."""
    return (q.float() * scale[..., None]).to(dtype)


def write_rows(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [n, H, d] quantized into a pool [blocks, bs, H, d] (e4m3) and its scales [blocks, bs, H] at
    `slots` [n] (block * bs + offset). Through a byte view: torch has no CPU index_copy for float8."""
    q, s = quantize(rows)
    H, d = cache.shape[2], cache.shape[3]
    cache.view(torch.uint8).view(-1, H, d).index_copy_(0, slots, q.view(torch.uint8))
    scales.view(-1, H).index_copy_(0, slots, s)
