"""The 8-bit KV cache's formats, in one place (`--kv-cache-dtype fp8 | int8`).

Each K or V row of one (token, KV head) is stored as 8-bit values with one float32 scale, the row's largest
magnitude / the format's largest value, so that a row of any magnitude uses the format's whole range: no
calibration, and nothing saturates (keys of real models reach the hundreds; a per-tensor scale of 1, vLLM's
default for fp8, clips them at 448).
- "fp8": float8 e4m3 (OCP "fn": finite, largest 448), the row / scale rounded to nearest even (3 mantissa bits:
  a relative step of 1/8 at every magnitude);
- "int8": the row / scale (largest 127) rounded to the nearest even integer (steps of scale: fine for the
  row's large values, coarse for its small ones).
On SmolLM2-135M (WikiText-2, 40 x 512 tokens, float32 compute) perplexity rose 0.09 % with int8 and 0.83 % with
fp8 (docs/serving.md). The scale costs 4 bytes a row: with 128-wide heads the pool holds 1.94x the tokens of a
16-bit one. Both divisions round to nearest (tensor by tensor: on CUDA torch multiplies by the reciprocal of a
Python scalar divisor, which is not the same number); the Triton kernels use `div_rn` to match.

Every attention reads K/V as stored, the chunk that wrote them included: a prompt's prefill attends to its own
K/V as the pool holds them (a chunk that starts a prompt reads them from qkv, where `rope_and_cache` leaves the
stored values; a later chunk gathers them back from the pool), so a token's output does not depend on how its
prompt was chunked or whether a prefix came from the cache.

The Triton kernels read the 8-bit values, convert them to the model dtype (exact for both formats) and apply
the scale to the scores (K) and the probabilities (V); the references here dequantize to the model dtype
first. The two agree to the model dtype's rounding (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from ..errors import OptionError

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8 = torch.float8_e4m3fn
STORAGE = {"fp8": FP8, "int8": torch.int8}  # --kv-cache-dtype -> the pool's element type
LARGEST = {FP8: 448.0, torch.int8: 127.0}


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise OptionError(f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)} (got {name!r})")
    return name


def quantize(x: torch.Tensor, storage: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (`storage` values [..., d], float32 scale [...]): a row of zeros gets scale 1."""
    top = LARGEST[storage]
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, torch.div(amax, torch.full_like(amax, top)), torch.ones_like(amax))
    y = torch.div(xf, scale[..., None]).clamp(-top, top)
    return (y.to(FP8) if storage == FP8 else torch.round(y).to(storage)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize` stored, in `dtype` (one rounding, from float32)."""
    return (q.float() * scale[..., None]).to(dtype)


def write_rows(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, H, d] quantized into a pool [blocks, bs, H, d] of the cache's 8-bit type and its scales
    [blocks, bs, H] at `slots` [n] (block * bs + offset); returns the rows as stored, in their dtype. Through a
    byte view: torch has no CPU index_copy for float8."""
    q, s = quantize(rows, cache.dtype)
    H, d = cache.shape[2], cache.shape[3]
    cache.view(torch.uint8).view(-1, H, d).index_copy_(0, slots, q.view(torch.uint8))
    scales.view(-1, H).index_copy_(0, slots, s)
    return dequantize(q, s, rows.dtype)
