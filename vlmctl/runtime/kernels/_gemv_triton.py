"""Triton kernel behind `gemv.py` (imported only when triton is; never import this directly).

_gemv_f16_kernel: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias) for a dense fp16/bf16 W [N, K], one
activation row per program, fp32 accumulation. A program owns a [BN, BK] tile per K step; each thread
reads 16 contiguous bytes of a row (Triton vectorizes the K-contiguous loads) and keeps BN x BK / threads
fp32 partial products in registers, summed across K only once after the loop, so the loop is loads,
conversions and FMAs. Rows past N are read clamped to row N - 1 (valid memory, results discarded), so
the loads carry no row mask; only a K tail (K not a multiple of BK) is masked.

SILU: x is not read from x_ptr[m, :K] but computed as silu(g) * u from the gate_up output row
[g (K) | u (K)] (rounded as the separate act_mul kernel rounds it: the SiLU, then the product), so a
down_proj needs neither that kernel nor its intermediate.

Split-K is reduced in-kernel by `_w4a16_triton._finish` (fp32 partials in a workspace, a per-tile ticket,
the last program sums in a fixed order and resets the ticket).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from ._w4a16_triton import _finish


@triton.jit
def _x_block(x_row, k, K, SILU: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation block x[k] as float32 (SILU: silu(gate[k]) * up[k], rounded to x's dtype)."""
    if EVEN_K:
        a = tl.load(x_row + k)
        if SILU:
            u = tl.load(x_row + K + k)
    else:
        a = tl.load(x_row + k, mask=k < K, other=0.0)
        if SILU:
            u = tl.load(x_row + K + k, mask=k < K, other=0.0)
    if SILU:  # rounded as torch's F.silu(g) * u: the SiLU to the activation dtype, then the product
        dt = x_row.dtype.element_ty
        g = a.to(tl.float32)
        a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
    return a.to(tl.float32)


@triton.jit
def _w_block(w_ptrs, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(k < K)[None, :], other=0.0)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _gemv_f16_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                     M, N, K, stride_xm, stride_wn, SPLIT_K,
                     BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     SILU: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
                     L2PF: tl.constexpr = 0):
    """PREFETCH: load the next K block into registers before multiplying this one (Triton's pipeliner
    leaves loads that do not feed a tl.dot alone), so each warp keeps two blocks of loads in flight.
    PDL (`pdl`): the first weight block is loaded before waiting for the previous kernel."""
    pdl.release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1)  # clamped: no row mask on the loads
    offs_k = tl.arange(0, BK)
    n_iter = tl.cdiv(K, BK)
    per = tl.cdiv(n_iter, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_iter)
    x_row = x_ptr + pid_m * stride_xm
    w_base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if L2PF > 0:  # the first L2PF blocks of this program's rows into L2 before the wait (EVEN_K only)
        first = tl.minimum(it0, n_iter - 1)
        nb = tl.maximum(tl.minimum(it1 - first, L2PF), 1)
        pdl.prefetch_l2(w_ptr + rows.to(tl.int64) * stride_wn + first * BK,
                        (nb * (BK * 2)).to(tl.int32) + tl.zeros_like(rows))
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if PREFETCH:
        first = tl.minimum(it0, n_iter - 1)  # an empty split slice still loads a valid block (unused)
        k = first * BK + offs_k
        w = _w_block(w_base + first * BK, k, K, EVEN_K)
        pdl.wait(PDL)
        x = _x_block(x_row, k, K, SILU, EVEN_K)
        for it in range(it0, it1):
            nxt = tl.minimum(it + 1, it1 - 1)  # the last block reloads itself: no branch, nothing out of range
            kn = nxt * BK + offs_k
            w_n = _w_block(w_base + nxt * BK, kn, K, EVEN_K)
            x_n = _x_block(x_row, kn, K, SILU, EVEN_K)
            acc += w.to(tl.float32) * x[None, :]
            w, x = w_n, x_n
    else:
        pdl.wait(PDL)
        for it in range(it0, it1):
            k = it * BK + offs_k
            w = _w_block(w_base + it * BK, k, K, EVEN_K)
            acc += w.to(tl.float32) * _x_block(x_row, k, K, SILU, EVEN_K)[None, :]
    out = tl.sum(acc, axis=1)
    offs_m = pid_m + tl.arange(0, 1)
    _finish(out[:, None], offs_n, offs_n < N, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, HAS_BIAS)
