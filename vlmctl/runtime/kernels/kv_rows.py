"""Triton helpers of the 8-bit KV cache's formats (`vlmctl.runtime.kv_quant` defines them and holds the torch
reference): one float32 scale a (token, KV head) row, its largest magnitude / the format's largest value (448
for float8 e4m3, 127 for int8), and the row divided by it (`div_rn`: rounded to nearest, as torch divides two
tensors), then rounded to nearest even onto the format's grid. Also the kernel that gathers a context's K and V
back from 8-bit pools, dequantized (`gather_dequantized`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compile_ahead import run as run_triton


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


# 8-bit values -> fp16, four a PTX block. int8: the byte + 128 placed under fp16's exponent of 1024 (PRMT) is
# 1024 + 128 + value exactly, and one packed subtraction of 1152 leaves the value. e4m3: the hardware's packed
# converter. Opaque to the compiler, which therefore converts where the tile is loaded, before the tile's trip
# through shared memory to the tensor cores (16-bit values by ldmatrix, as a 16-bit cache's), rather than after
# it (8-bit values by scalar shared-memory loads, then an unpacked convert for int8). The blocks are declared impure
# only so that the compiler keeps them where they are: a pure elementwise op it moves after the trip.
_WIDEN_I8 = tl.constexpr("{\n.reg .b32 t, c;\nxor.b32 t, $2, 0x80808080;\nmov.b32 c, 0x64806480;\n"
                         "prmt.b32 $0, t, 0x64646464, 0x5140;\nprmt.b32 $1, t, 0x64646464, 0x7362;\n"
                         "sub.f16x2 $0, $0, c;\nsub.f16x2 $1, $1, c;\n}")
_WIDEN_E4M3 = tl.constexpr("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\n"
                           "cvt.rn.f16x2.e4m3x2 $1, hi;\n}")


@triton.jit
def widen(x, dtype: tl.constexpr, ASM: tl.constexpr):
    """8-bit cache values x (int8 or float8 e4m3) as `dtype`, exactly. ASM (a GPU, fp16): by `_WIDEN_*`;
    otherwise (the interpreter, bf16) by a cast."""
    if ASM and dtype == tl.float16:
        if x.dtype == tl.int8:
            y = tl.inline_asm_elementwise(_WIDEN_I8, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
        else:
            y = tl.inline_asm_elementwise(_WIDEN_E4M3, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(dtype)
    return y


# A context's K and V rows from an 8-bit pool, dequantized in one launch (a chunk that continues a prompt, or follows
# a prefix found in the cache, attends over them): the torch reference (`ops.gather_context`, once for K and once
# for V) gathers the 8-bit rows and their scales, widens the rows to float32, scales and rounds them: four passes
# over the context through a float32 copy twice its size, and some ten launches.
# The context length varies from call to call: left unspecialized, it cannot make Triton compile a new variant in
# the middle of serving (the engine's warm-up compiles this kernel at load).
@triton.jit
def _gather_rows(cache_ptr, scale_ptr, out_ptr, slot, pos, keep, h, H: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr):
    col = tl.arange(0, D_PAD)
    m = keep[:, None] & (col < D)[None, :]
    q = tl.load(cache_ptr + (slot * H + h)[:, None] * D + col[None, :], mask=m)
    s = tl.load(scale_ptr + slot * H + h, mask=keep, other=0.0)
    y = q.to(tl.float32) * s[:, None]  # exact widening, one float32 product, one rounding: as kv_quant.dequantize
    tl.store(out_ptr + (pos.to(tl.int64) * H + h)[:, None] * D + col[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m)


@triton.jit(do_not_specialize=["length"])
def _gather_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, k_out_ptr, v_out_ptr, length, H: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1)
    keep = pos < length
    slot = tl.load(bt_ptr + pos // BS, mask=keep, other=0).to(tl.int64) * BS + pos % BS
    if tl.program_id(2) == 0:
        _gather_rows(k_ptr, ks_ptr, k_out_ptr, slot, pos, keep, h, H, D, D_PAD)
    else:
        _gather_rows(v_ptr, vs_ptr, v_out_ptr, slot, pos, keep, h, H, D, D_PAD)


def gather_dequantized(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                       block_table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` positions of one sequence's K and V from 8-bit pools [blocks, bs, H, d] and their scales
    [blocks, bs, H] (all contiguous) through its block table -> two [length, H, d] in `dtype`, bit for bit what
    `ops.gather_context` returns for each."""
    _, bs, H, d = k_cache.shape
    k = torch.empty((length, H, d), dtype=dtype, device=k_cache.device)
    v = torch.empty_like(k)
    if length:
        rows = 32
        run_triton(_gather_kernel, (triton.cdiv(length, rows), H, 2), k_cache, v_cache, k_scale, v_scale,
                   block_table, k, v, length, H=H, D=d, D_PAD=triton.next_power_of_2(d), BS=bs, ROWS=rows,
                   num_warps=4)
    return k, v
