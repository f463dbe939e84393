"""Triton kernels behind `w4a16.py` (imported only when triton is; never import this directly).

Three kernels over the packed layout that `w4a16.py` documents:
  _gemv_kernel     reduction form, one activation row per program: y[m, n] = sum_k x[m, k] * W[n, k]
  _dot_kernel      tensor cores with the weight tile as the left operand ("swap AB"): acc[n, m] = W x^T,
                   for decode batches (M padded to 16) and for prefill (a W4A16 GEMM)
  _dequant_kernel  packed -> dense [N, K] weight, for the dequantize + cuBLAS prefill path

How a word becomes floats without an int->float conversion instruction (I2F runs at a quarter of the
FMA rate and would cap a batch-1 GEMV below the bandwidth bound): the word and the word shifted right
by 16 are masked with 0xF, 0xF0, 0xF00, 0xF000 and ORed with 0x4B000000; read as float32 that is
2**23 + code * 16**j exactly (j = k % 4), so one subtraction gives code * 16**j. The power of 16 is
folded into the per-group scale (dot, dequant) or into the activation (GEMV), both exact. The
tile is [BN, NGB, WPG, 2, 2, 2]: rows, groups in the block, words per group, and the three
within-word bits of k (k = 8*word + 4*i2 + 2*i1 + i0), all of which stay within a thread.

Split-K: each of SPLIT_K programs of a tile writes its fp32 partial to a workspace, then takes a ticket
from a per-tile counter; the program that draws the last ticket sums the partials in a fixed order
(so results do not depend on arrival order), adds the bias, stores, and resets the counter to zero so
the next launch (or a CUDA-graph replay) finds it clean.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack(words, magic):
    """int32 [BN, NGB, WPG] -> float32 [BN, NGB, WPG, 2, 2, 2] holding code * 16**(2*i1 + i0), exactly.

    `magic` is 0x4B000000 passed as a kernel argument: held in a register, the mask and the OR fuse
    into one LOP3 per element (two immediates do not fit one instruction)."""
    h = tl.join(words, words >> 16)  # [..., i2]
    q = tl.join(tl.join((h & 0xF) | magic, (h & 0xF00) | magic),
                tl.join((h & 0xF0) | magic, (h & 0xF000) | magic))  # [..., i2, i1, i0]
    return q.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _pow16_neg():
    """float32 [2, 2]: 16**-(2*i1 + i0), built from exponent bits so it is exact."""
    e = tl.arange(0, 4)
    return tl.reshape(((127 - 4 * e) << 23).to(tl.float32, bitcast=True), (2, 2))


@triton.jit
def _load_block(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, KG,
                G: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr):
    """Words [BN, NGB, WPG], scales and zero points [BN, NGB] (float32) of the K block at k0."""
    g = tl.arange(0, NGB)
    j = tl.arange(0, WPG)
    w_off = offs_n[:, None, None] * KW + (k0 // 8 + g * WPG)[None, :, None] + j[None, None, :]
    words = tl.load(qw_ptr + w_off, mask=n_mask[:, None, None], other=0, eviction_policy="evict_first")
    m_off = offs_n[:, None] * KG + (k0 // G + g)[None, :]
    s = tl.load(s_ptr + m_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + m_off, mask=n_mask[:, None], other=0).to(tl.float32)
    return words, s, z


@triton.jit
def _k_offsets(NGB: tl.constexpr, WPG: tl.constexpr):
    """int32 [NGB, WPG, 2, 2, 2]: offset of each element within the K block, in the unpack order."""
    g = tl.arange(0, NGB)
    j = tl.arange(0, WPG)
    t = tl.arange(0, 2)
    return (g[:, None, None, None, None] * (WPG * 8) + j[None, :, None, None, None] * 8
            + t[None, None, :, None, None] * 4 + t[None, None, None, :, None] * 2 + t[None, None, None, None, :])


@triton.jit
def _dequant_block(words, s, z, magic):
    """Exact float32 weights [BN, NGB, WPG, 2, 2, 2]: (code - zero) * scale as one FMA per element."""
    f = _unpack(words, magic)
    sp = s[:, :, None, None, None, None] * _pow16_neg()[None, None, None, None, :, :]
    zs = (z * s)[:, :, None, None, None, None]
    return f * sp - zs


@triton.jit
def _finish(acc, offs_n, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr, tile_id, pid_k, SPLIT_K,
            HAS_BIAS: tl.constexpr):
    """acc [BN, BM] float32 -> y[m, n] (+ bias), through the split-K workspace when SPLIT_K > 1."""
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_off = offs_m[None, :] * N + offs_n[:, None]
    last = SPLIT_K >= 1
    if SPLIT_K > 1:
        tl.store(ws_ptr + pid_k * M * N + out_off, acc, mask=mask)
        # every thread's partial is written before the ticket is taken (release); the last program
        # reads the others' partials from L2 (.cg) after its acquire
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        last = ticket == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                acc += tl.load(ws_ptr + s * M * N + out_off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "MAGIC"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, K, stride_xm, SPLIT_K, MAGIC,
                 G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    KW = K // 8
    KG = K // G
    n_iter = K // BK
    per = tl.cdiv(n_iter, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_iter)
    k_off = _k_offsets(NGB, WPG)
    pw = _pow16_neg()[None, None, None, :, :]
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((BN,), dtype=tl.float32)
    for it in range(it0, it1):
        k0 = it * BK
        words, s, z = _load_block(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, KG, G, NGB, WPG)
        xv = tl.load(x_row + k0 + k_off, eviction_policy="evict_last").to(tl.float32)  # [NGB, WPG, 2, 2, 2]
        # sum_k x*(code - zero)*scale = scale * (sum_k (x * 16**-j) * (code * 16**j) - zero * sum_k x)
        xsum = tl.sum(tl.reshape(xv, (NGB, WPG * 8)), axis=1)  # [NGB]
        prod = _unpack(words, MAGIC) * (xv * pw)[None, :, :, :, :, :]
        part = tl.sum(tl.reshape(prod, (BN, NGB, WPG * 8)), axis=2)  # [BN, NGB]
        acc += tl.sum((part - z * xsum[None, :]) * s, axis=1)
    offs_m = pid_m + tl.arange(0, 1)
    _finish(acc[:, None], offs_n, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "MAGIC"])
def _dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, SPLIT_K, MAGIC,
                G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, NGB: tl.constexpr,
                WPG: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_mask = offs_n < N
    m_mask = offs_m < M
    KW = K // 8
    KG = K // G
    n_iter = K // BK
    per = tl.cdiv(n_iter, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_iter)
    offs_k = tl.arange(0, BK)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for it in range(it0, it1):
        k0 = it * BK
        words, s, z = _load_block(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, KG, G, NGB, WPG)
        w = tl.reshape(_dequant_block(words, s, z, MAGIC).to(dtype), (BN, BK))
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=m_mask[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    _finish(acc, offs_n, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, HAS_BIAS)


@triton.jit(do_not_specialize=["MAGIC"])
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, MAGIC,
                    G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    k0 = pid_k * BK
    words, s, z = _load_block(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K // 8, K // G, G, NGB, WPG)
    w = tl.reshape(_dequant_block(words, s, z, MAGIC), (BN, BK)).to(w_ptr.dtype.element_ty)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=n_mask[:, None])
