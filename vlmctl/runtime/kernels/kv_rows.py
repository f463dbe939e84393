"""Triton helpers of the 8-bit KV cache's formats (`vlmctl.runtime.kv_quant` defines them and holds the torch
reference): one float32 scale a (token, KV head) row, its largest magnitude / the format's largest value (448
for float8 e4m3, 127 for int8), and the row divided by it (`div_rn`: rounded to nearest, as torch divides two
tensors), then rounded to nearest even onto the format's grid."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_scale(amax, dtype: tl.constexpr):
    """The scale of a row whose largest magnitude is amax (float32), stored as `dtype`; 1 for a row of zeros."""
    if dtype == tl.int8:
        s = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    else:
        s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    return s


@triton.jit
def quantize(x, scale, dtype: tl.constexpr):
    """x (any float dtype) / scale, rounded to nearest even on `dtype`'s grid and returned as `dtype`.
    The rounding is done in float32 and the cast then converts exactly: the same values as the GPU's own
    rounding cast, and ones Triton's interpreter converts right (it mis-rounds e4m3 values off the grid, e.g.
    31.4 to 16, so the CPU tests could not check the kernels otherwise)."""
    if dtype == tl.int8:
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -127.0, 127.0)
        q = ((y + 12582912.0) - 12582912.0).to(dtype)  # + 1.5 * 2^23 and back: to the nearest even integer
    else:
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
        e = ((y.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)  # biased exponent
        e = tl.maximum(e, 127 - 6)  # below 2^-6 (subnormals) the spacing stays 2^-9
        to_units = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - E): one e4m3 step becomes 1
        unit = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(E - 3)
        r = ((y * to_units + 12582912.0) - 12582912.0) * unit
        q = tl.where(r == 0, y * 0.0, r).to(dtype)  # a negative that rounds to zero stays -0, as the cast gives
    return q
