"""Triton kernels behind `w4a16.py` (imported only when triton is; never import this directly).

Four kernels over the packed layout that `w4a16.py` documents:
  _gemv_kernel     reduction form, one activation row per program: y[m, n] = sum_k x[m, k] * W[n, k]
  _gemv_h2_kernel  the same for fp16 x with half2 dequantization, fp16 products summed in short fp16
                   runs, the runs in fp32 (fewer instructions per weight than the fp32 unpack)
  _dot_kernel      tensor cores with the weight tile as the left operand ("swap AB"): acc[n, m] = W x^T,
                   for decode batches (M padded to 16) and for prefill (a W4A16 GEMM)
  _dequant_kernel  packed -> dense [N, K] weight, for the dequantize + cuBLAS prefill path

Within a word, k = 8j + 2t + e sits at bits 4t + 16e (t = 0..3, e = 0..1): the two 16-bit halves hold
the even and the odd k of each pair. Two ways to turn a word into floats without an int->float
conversion instruction (I2F runs at a quarter of the FMA rate and would cap a batch-1 GEMV below the
bandwidth bound), both exact:
  fp16 (_dequant_f16): (w >> 4t) & 0x000F000F | 0x64006400 is two fp16 numbers 1024 + code for one
      consecutive pair of k; subtracting 1024 + zero and multiplying by the scale are packed half2
      instructions, and the product rounds once, as `dequantize(...).half()` does.
  fp32 (_unpack_f32): the word (even k) and the word >> 12 (odd k) are masked with 0xF << 4t (<< 4
      for the odd ones) and ORed with 0x4B000000; read as float32 that is 2**23 + code * 16**(t + e),
      so one subtraction gives code * 16**(t + e), and 16**-(t + e) is folded into the scale (dot,
      dequant) or into the activation (GEMV). Used for bf16 (whose 8-bit significand cannot hold the
      scale exactly) and by the GEMV, which accumulates in fp32.
A tile is [BN, NGB, WPG, 2, 2, 2]: rows, groups in the K block, words per group, then t // 2, t % 2
and e, which stay within a thread; reshaped to [BN, BK] it is in natural k order.

Split-K: each of SPLIT_K programs of a tile writes its fp32 partial to a workspace, then takes a ticket
from a per-tile counter; the program that draws the last ticket sums the partials in a fixed order
(so results do not depend on arrival order), adds the bias, stores, and resets the counter to zero so
the next launch (or a CUDA-graph replay) finds it clean.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .fused import act_f32


@triton.jit
def _unpack_f32(words, magic):
    """int32 [BN, NGB, WPG] -> float32 [BN, NGB, WPG, 2, 2, 2] holding code * 16**(t + e) (k order), exactly.

    The even half (e = 0) is masked in place (bits 4t), the odd half from word >> 12 (bits 4t + 4), so
    every code lands in bits 0..19, below the float32 exponent. `magic` is 0x4B000000 passed as a
    kernel argument: held in a register, each mask and the OR fuse into one LOP3."""
    h = tl.join(words, words >> 12)  # [..., e]
    e4 = (4 * tl.arange(0, 2))[None, None, None, :]
    q = tl.join(tl.join((h & (0xF << e4)) | magic, (h & (0xF00 << e4)) | magic),
                tl.join((h & (0xF0 << e4)) | magic, (h & (0xF000 << e4)) | magic))  # [..., e, t // 2, t % 2]
    f = q.to(tl.float32, bitcast=True) - 8388608.0
    return tl.permute(f, (0, 1, 2, 4, 5, 3))  # [..., t // 2, t % 2, e]: natural k order


@triton.jit
def _pow16_neg():
    """float32 [2, 2, 2]: 16**-(t + e) for (t // 2, t % 2, e), built from exponent bits so it is exact."""
    i = tl.arange(0, 8)
    t = i // 2
    e = i % 2
    return tl.reshape(((127 - 4 * (t + e)) << 23).to(tl.float32, bitcast=True), (2, 2, 2))


@triton.jit
def _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, it0, KW, KG, G: tl.constexpr, BK: tl.constexpr,
                NGB: tl.constexpr, WPG: tl.constexpr):
    """Pointers to the words [BN, NGB, WPG] of the first K block, and the scale / zero-point row bases
    [BN, NGB] (add k0 // G per block)."""
    g = tl.arange(0, NGB)
    j = tl.arange(0, WPG)
    w_ptrs = qw_ptr + (offs_n[:, None, None] * KW + (it0 * (BK // 8) + g * WPG)[None, :, None] + j[None, None, :])
    m_off = offs_n[:, None] * KG + g[None, :]
    return w_ptrs, s_ptr + m_off, z_ptr + m_off


@triton.jit
def _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, k0, G: tl.constexpr, EVEN_N: tl.constexpr):
    """Words [BN, NGB, WPG], scales and zero points [BN, NGB] (float32) of the K block at k0."""
    if EVEN_N:  # no row mask: unpredicated loads, no zero-fill
        words = tl.load(w_ptrs)
        s = tl.load(s_ptrs + k0 // G).to(tl.float32)
        z = tl.load(z_ptrs + k0 // G).to(tl.float32)
    else:
        words = tl.load(w_ptrs, mask=n_mask[:, None, None], other=0)
        s = tl.load(s_ptrs + k0 // G, mask=n_mask[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptrs + k0 // G, mask=n_mask[:, None], other=0).to(tl.float32)
    return words, s, z


@triton.jit
def _k_offsets(NGB: tl.constexpr, WPG: tl.constexpr):
    """int32 [NGB, WPG, 2, 2, 2]: offset of each element within the K block (natural order)."""
    g = tl.arange(0, NGB)
    j = tl.arange(0, WPG)
    t = tl.arange(0, 2)
    return (g[:, None, None, None, None] * (WPG * 8) + j[None, :, None, None, None] * 8
            + t[None, None, :, None, None] * 4 + t[None, None, None, :, None] * 2 + t[None, None, None, None, :])


@triton.jit
def _dequant_f32(words, s, z, magic):
    """Exact float32 weights [BN, NGB, WPG, 2, 2, 2]: (code - zero) * scale as one FMA per element."""
    f = _unpack_f32(words, magic)
    sp = s[:, :, None, None, None, None] * _pow16_neg()[None, None, None, :, :, :]
    zs = (z * s)[:, :, None, None, None, None]
    return f * sp - zs


@triton.jit
def _dequant_f16(words, s, z, magic16, ASM: tl.constexpr):
    """fp16 weights [BN, NGB, WPG, 2, 2, 2] (k order), each (code - zero) * scale rounded once.

    s: fp16 scales, z: fp16 zero points, both [BN, NGB]; magic16 is 0x64006400 (fp16 1024 twice).
    ASM: split each word into its two halves with one PTX mov (the portable shift/truncate form
    costs two extra PRMT per pair on sm_90); the interpreter takes the portable form."""
    a = tl.join(words, words >> 8)  # [..., t // 2]
    b = tl.join(a, a >> 4)  # [..., t // 2, t % 2]
    v = (b & 0x000F000F) | magic16  # halves: fp16 1024 + code for k = 2t (low) and 2t + 1 (high)
    if ASM:
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [v],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo = v.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h = tl.join(lo, hi)  # [..., t // 2, t % 2, e]
    zf = (z + 1024.0)[:, :, None, None, None, None]  # exact: integers below 2048 are exact in fp16
    return (h - zf) * s[:, :, None, None, None, None]


@triton.jit
def _dequant(words, s, z, magic, magic16, dtype: tl.constexpr, ASM: tl.constexpr):
    """[BN, BK] weights in dtype (fp16: packed half2 path; otherwise the exact fp32 path, rounded once)."""
    BN: tl.constexpr = words.shape[0]
    BK: tl.constexpr = words.shape[1] * words.shape[2] * 8
    if dtype == tl.float16:
        w = _dequant_f16(words, s.to(tl.float16), z.to(tl.float16), magic16, ASM)
    else:
        w = _dequant_f32(words, s, z, magic).to(dtype)
    return tl.reshape(w, (BN, BK))


@triton.jit
def _gemv_pids(KMAJOR: tl.constexpr):
    """(pid_n, pid_m, pid_k, row tiles) of a GEMV or dot program. KMAJOR: the grid is (split, m, n tiles), so
    the programs the hardware runs together are the K slices of the same rows, which then stream each
    row's words end to end between them (long split-K over long rows otherwise has every running
    program read a few hundred bytes from thousands of rows)."""
    if KMAJOR:
        return tl.program_id(2), tl.program_id(1), tl.program_id(0), tl.num_programs(2)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0)


@triton.jit
def _k_slice(K, BK: tl.constexpr, SPLIT_K, pid_k):
    """(K blocks in all, this split's first block, one past its last): slices of ceil(n / SPLIT_K)
    blocks, so the last slices may be short or empty."""
    n_iter = K // BK
    per = tl.cdiv(n_iter, SPLIT_K)
    it0 = pid_k * per
    return n_iter, it0, tl.minimum(it0 + per, n_iter)


@triton.jit
def _gemv_rows(pid_n, N, BN: tl.constexpr, ACT: tl.constexpr):
    """(rows, row mask) of a GEMV tile. ACT >= 0 (a gate_up weight, gate rows then up rows): BN // 2
    gate rows, then their up rows N / 2 further on, so the tile's epilogue has both halves. (Pairing
    each gate row with its up row instead, interleaved, made the 7B gate_up GEMV 20 % slower on an H200.)"""
    j = tl.arange(0, BN)
    if ACT >= 0:
        r = pid_n * (BN // 2) + j % (BN // 2)
        return r + (j // (BN // 2)) * (N // 2), r < N // 2
    offs_n = pid_n * BN + j
    return offs_n, offs_n < N


@triton.jit
def _finish(acc, offs_n, n_mask, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr, tile_id, pid_k, SPLIT_K,
            HAS_BIAS: tl.constexpr, ACT: tl.constexpr = -1):
    """acc [BN, BM] float32 -> y[m, n] (+ bias), through the split-K workspace when SPLIT_K > 1.
    ACT >= 0 (`_gemv_rows`' gate/up tiles): y[m, r] = act(gate) * up [M, N / 2] instead, each half
    rounded to y's dtype first, so it equals the act_mul kernel applied to the plain output."""
    mask = n_mask[:, None] & (offs_m[None, :] < M)
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
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        dt: tl.constexpr = y_ptr.dtype.element_ty
        if ACT >= 0:
            BN: tl.constexpr = acc.shape[0]
            BM: tl.constexpr = acc.shape[1]
            g, u = tl.split(tl.permute(tl.reshape(acc.to(dt), (2, BN // 2, BM)), (1, 2, 0)))
            out = (act_f32(g.to(tl.float32), ACT).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
            r, _ = tl.split(tl.permute(tl.reshape(offs_n, (2, BN // 2)), (1, 0)))  # gate rows: output columns
            tl.store(y_ptr + offs_m[None, :] * (N // 2) + r[:, None], out,
                     mask=(r[:, None] < N // 2) & (offs_m[None, :] < M))
        else:
            tl.store(y_ptr + out_off, acc.to(dt), mask=mask)


@triton.jit
def _prefetch_words(qw_ptr, offs_n, N, KW, it0, it1, n_iter, BK: tl.constexpr, L2PF: tl.constexpr):
    """Bulk-prefetch into L2 the words of up to L2PF K blocks from it0 of rows offs_n (clamped to N - 1;
    an empty slice prefetches the last block, which exists)."""
    first = tl.minimum(it0, n_iter - 1)
    nb = tl.maximum(tl.minimum(it1 - first, L2PF), 1)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    pdl.prefetch_l2(qw_ptr + rows * KW + first * (BK // 8), (nb * (BK // 2)).to(tl.int32) + tl.zeros_like(offs_n))


@triton.jit
def _gemv_block(acc, words, s, z, xv, pw, magic, BN: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr):
    """acc [BN] += this K block's sum_k x * (code - zero) * scale, computed as
    scale * (sum_k (x * 16**-(t+e)) * (code * 16**(t+e)) - zero * sum_k x): one FFMA per weight."""
    xv = xv.to(tl.float32)  # [NGB, WPG, 2, 2, 2]
    xsum = tl.sum(tl.reshape(xv, (NGB, WPG * 8)), axis=1)  # [NGB]
    prod = _unpack_f32(words, magic) * (xv * pw)[None, :, :, :, :, :]
    part = tl.sum(tl.reshape(prod, (BN, NGB, WPG * 8)), axis=2)  # [BN, NGB]
    return acc + tl.sum((part - z * xsum[None, :]) * s, axis=1)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "MAGIC", "MAGIC16"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, K, stride_xm, SPLIT_K, MAGIC, MAGIC16,
                 G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr,
                 KMAJOR: tl.constexpr = False, PDL: tl.constexpr = False, L2PF: tl.constexpr = 0,
                 ACT: tl.constexpr = -1):
    """PREFETCH: load the next K block into registers before computing this one (the loop's loads do
    not feed a tl.dot, so Triton's pipeliner leaves them alone); each warp then keeps two blocks of
    loads in flight instead of stalling on every block. PDL (`pdl`): the first block of weights is
    loaded before waiting for the previous kernel. ACT >= 0: a gate_up weight whose output is
    act(gate) * up (`_gemv_rows`, `_finish`)."""
    pdl.release(PDL)
    pid_n, pid_m, pid_k, n_tiles = _gemv_pids(KMAJOR)
    offs_n, n_mask = _gemv_rows(pid_n, N, BN, ACT)
    KW = K // 8
    KG = K // G
    n_iter, it0, it1 = _k_slice(K, BK, SPLIT_K, pid_k)
    if L2PF > 0:  # the first L2PF blocks of this program's rows into L2 before the wait (`pdl.prefetch_l2`)
        _prefetch_words(qw_ptr, offs_n, N, KW, it0, it1, n_iter, BK, L2PF)
    k_off = _k_offsets(NGB, WPG)
    pw = _pow16_neg()[None, None, :, :, :]  # 16**-(t + e), matching _unpack_f32
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((BN,), dtype=tl.float32)
    if PREFETCH:
        first = tl.minimum(it0, n_iter - 1)  # an empty split slice still loads a valid block (unused)
        w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, first, KW, KG, G, BK, NGB, WPG)
        words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, first * BK, G, EVEN_N)
        pdl.wait(PDL)
        xv = tl.load(x_row + first * BK + k_off)
        for it in range(it0, it1):
            nxt = tl.minimum(it + 1, it1 - 1)  # the last block reloads itself: no branch, nothing out of range
            w_ptrs += (nxt - it) * (BK // 8)
            words_n, s_n, z_n = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, nxt * BK, G, EVEN_N)
            xv_n = tl.load(x_row + nxt * BK + k_off)
            acc = _gemv_block(acc, words, s, z, xv, pw, MAGIC, BN, NGB, WPG)
            words, s, z, xv = words_n, s_n, z_n, xv_n
    else:
        w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, it0, KW, KG, G, BK, NGB, WPG)
        pdl.wait(PDL)
        for it in range(it0, it1):
            k0 = it * BK
            words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, k0, G, EVEN_N)
            w_ptrs += BK // 8
            acc = _gemv_block(acc, words, s, z, tl.load(x_row + k0 + k_off), pw, MAGIC, BN, NGB, WPG)
    offs_m = pid_m + tl.arange(0, 1)
    _finish(acc[:, None], offs_n, n_mask, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * n_tiles + pid_n, pid_k, SPLIT_K, HAS_BIAS, ACT)


def _h2_run_asm(nw: int) -> str:
    """PTX for one run of nw packed words of one row (8 * nw consecutive k of one group): operands
    $0 (float32 out, as int32 bits), $1..$nw the words, then 4 * nw half2 activations (word i, pair t:
    x[8i + 2t], x[8i + 2t + 1]), then 1024 + zero and the scale, each as half2 twice. Per pair of
    weights: one LOP3 (mask | 1024), sub.f16x2, mul.f16x2 (the weight, rounded once as
    `dequantize(...).half()`) and fma.f16x2 into the run's half2 sum (plus a shift for t > 0); .rn
    everywhere so that ptxas contracts nothing. The run's two halves are added in fp32."""
    zf, sc = f"${1 + 5 * nw}", f"${2 + 5 * nw}"
    body = ["{", ".reg .b32 q, t, a;", ".reg .b16 l, h;", ".reg .f32 f, g;"]
    for i in range(nw):
        w = f"${1 + i}"
        for t in range(4):
            src = w
            if t:
                body.append(f"shr.u32 t, {w}, {4 * t};")
                src = "t"
            x = f"${1 + nw + 4 * i + t}"
            body += [f"lop3.b32 q, {src}, 0x000F000F, 0x64006400, 0xEA;",  # (src & mask) | magic
                     f"sub.rn.f16x2 q, q, {zf};", f"mul.rn.f16x2 q, q, {sc};",
                     f"mul.rn.f16x2 a, q, {x};" if i == 0 and t == 0 else f"fma.rn.f16x2 a, q, {x}, a;"]
    body += ["mov.b32 {l, h}, a;", "cvt.f32.f16 f, l;", "cvt.f32.f16 g, h;", "add.f32 $0, f, g;", "}"]
    return "\n".join(body)


_H2_ASM_1 = tl.constexpr(_h2_run_asm(1))
_H2_ASM_2 = tl.constexpr(_h2_run_asm(2))
_H2_CONS_1 = tl.constexpr("=r" + ",r" * 7)
_H2_CONS_2 = tl.constexpr("=r" + ",r" * 12)


@triton.jit
def _split4(v):
    """[..., 2, 2] -> the four [...] tensors at (0, 0), (0, 1), (1, 0), (1, 1) (t = 0, 1, 2, 3)."""
    a, b = tl.split(v)  # last axis: t % 2
    a0, a1 = tl.split(a)  # then t // 2
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _gemv_h2_block(acc, words, s, z, xv, magic16, BN: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr,
                   RUNW: tl.constexpr, ASM: tl.constexpr):
    """acc [BN, NGB, WPG // RUNW] (float32) += this K block's runs of RUNW words (8 * RUNW weights of
    one group): w dequantized in half2 (`_dequant_f16`'s trick, each weight rounded once as
    `dequantize(...).half()`), x * w summed over the run in fp16, then added to its own fp32 lane; the
    caller sums the lanes once, after the K loop.

    ASM (sm_90): one inline-PTX block per run (`_h2_run_asm`); xv are the activations as int32 half2
    pairs [NGB, WPG // RUNW, 2, 2(, RUNW)] (see `_h2_x_offsets`). Otherwise (the interpreter) the same
    arithmetic in Triton ops on fp16 xv [NGB, WPG, 2, 2, 2]; its fp16 sums run as a tree rather than a
    chain, so the two may differ by fp16 rounding (both within the tested bound)."""
    WR: tl.constexpr = WPG // RUNW
    if ASM:
        zi = z.to(tl.int32)
        zf2 = ((zi | 0x6400) * 0x10001)[:, :, None]  # fp16 1024 + zero in both halves (exact below 16)
        si = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s2 = (si * 0x10001)[:, :, None]
        if RUNW == 1:
            x0, x1, x2, x3 = _split4(tl.reshape(xv, (NGB, WR, 2, 2)))
            r = tl.inline_asm_elementwise(_H2_ASM_1, _H2_CONS_1,
                                          [words, x0[None], x1[None], x2[None], x3[None], zf2, s2],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            xa, xb = tl.split(xv)  # word 0 / word 1 of each run
            a0, a1, a2, a3 = _split4(xa)
            b0, b1, b2, b3 = _split4(xb)
            w0, w1 = tl.split(tl.reshape(words, (BN, NGB, WR, 2)))
            r = tl.inline_asm_elementwise(_H2_ASM_2, _H2_CONS_2,
                                          [w0, w1, a0[None], a1[None], a2[None], a3[None],
                                           b0[None], b1[None], b2[None], b3[None], zf2, s2],
                                          dtype=tl.int32, is_pure=True, pack=1)
        return acc + r.to(tl.float32, bitcast=True)
    else:
        w = _dequant_f16(words, s.to(tl.float16), z.to(tl.float16), magic16, False)  # [BN, NGB, WPG, 2, 2, 2]
        prod = w * xv[None, :, :, :, :, :]
        runs = tl.sum(tl.reshape(prod, (BN, NGB, WR, RUNW * 8)), axis=3)  # fp16
        return acc + runs.to(tl.float32)


@triton.jit
def _h2_x_offsets(NGB: tl.constexpr, WPG: tl.constexpr, RUNW: tl.constexpr, ASM: tl.constexpr):
    """Offsets of the activations `_gemv_h2_block` takes within a K block: int32 half2 pairs
    [NGB, WPG // RUNW, 2, 2] (RUNW 1) or [NGB, WPG // RUNW, 2, 2, 2] (RUNW 2: t // 2, t % 2, word of
    the run) with ASM, else fp16 elements [NGB, WPG, 2, 2, 2] in natural order."""
    if ASM:
        WR: tl.constexpr = WPG // RUNW
        g = tl.arange(0, NGB)[:, None, None, None, None]
        wr = tl.arange(0, WR)[None, :, None, None, None]
        th = tl.arange(0, 2)[None, None, :, None, None]
        tlo = tl.arange(0, 2)[None, None, None, :, None]
        r = tl.arange(0, RUNW)[None, None, None, None, :]
        off = g * (WPG * 4) + (wr * RUNW + r) * 4 + th * 2 + tlo
        if RUNW == 1:
            off = tl.reshape(off, (NGB, WR, 2, 2, 1))  # the caller drops the last axis
    else:
        off = _k_offsets(NGB, WPG)
    return off


@triton.jit(do_not_specialize=["M", "SPLIT_K", "MAGIC", "MAGIC16"])
def _gemv_h2_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                    M, N, K, stride_xm, SPLIT_K, MAGIC, MAGIC16,
                    G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, RUNW: tl.constexpr,
                    ASM: tl.constexpr, KMAJOR: tl.constexpr = False, PDL: tl.constexpr = False,
                    L2PF: tl.constexpr = 0, ACT: tl.constexpr = -1):
    """The GEMV for fp16 activations with half2 dequantization and short fp16 runs (see
    `_gemv_h2_block`); otherwise as `_gemv_kernel` (one x row per program, PREFETCH, split-K, PDL, ACT)."""
    pdl.release(PDL)
    pid_n, pid_m, pid_k, n_tiles = _gemv_pids(KMAJOR)
    offs_n, n_mask = _gemv_rows(pid_n, N, BN, ACT)
    KW = K // 8
    KG = K // G
    n_iter, it0, it1 = _k_slice(K, BK, SPLIT_K, pid_k)
    if L2PF > 0:  # the first L2PF blocks of this program's rows into L2 before the wait (`pdl.prefetch_l2`)
        _prefetch_words(qw_ptr, offs_n, N, KW, it0, it1, n_iter, BK, L2PF)
    if ASM:  # the activations as int32 half2 pairs (x_ptr is fp16 and 16-byte aligned)
        x_row = (x_ptr + pid_m * stride_xm).to(tl.pointer_type(tl.int32))
        XS: tl.constexpr = 2
    else:
        x_row = x_ptr + pid_m * stride_xm
        XS: tl.constexpr = 1
    k_off = _h2_x_offsets(NGB, WPG, RUNW, ASM)
    acc = tl.zeros((BN, NGB, WPG // RUNW), dtype=tl.float32)
    if PREFETCH:
        first = tl.minimum(it0, n_iter - 1)
        w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, first, KW, KG, G, BK, NGB, WPG)
        words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, first * BK, G, EVEN_N)
        pdl.wait(PDL)
        xv = tl.load(x_row + first * (BK // XS) + k_off)
        for it in range(it0, it1):
            nxt = tl.minimum(it + 1, it1 - 1)
            w_ptrs += (nxt - it) * (BK // 8)
            words_n, s_n, z_n = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, nxt * BK, G, EVEN_N)
            xv_n = tl.load(x_row + nxt * (BK // XS) + k_off)
            acc = _gemv_h2_block(acc, words, s, z, xv, MAGIC16, BN, NGB, WPG, RUNW, ASM)
            words, s, z, xv = words_n, s_n, z_n, xv_n
    else:
        w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, it0, KW, KG, G, BK, NGB, WPG)
        pdl.wait(PDL)
        for it in range(it0, it1):
            k0 = it * BK
            words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, k0, G, EVEN_N)
            w_ptrs += BK // 8
            acc = _gemv_h2_block(acc, words, s, z, tl.load(x_row + k0 // XS + k_off), MAGIC16, BN, NGB, WPG, RUNW, ASM)
    offs_m = pid_m + tl.arange(0, 1)
    out = tl.sum(tl.reshape(acc, (BN, NGB * (WPG // RUNW))), axis=1)  # across the lanes, once
    _finish(out[:, None], offs_n, n_mask, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * n_tiles + pid_n, pid_k, SPLIT_K, HAS_BIAS, ACT)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "MAGIC", "MAGIC16"])
def _dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, SPLIT_K, MAGIC, MAGIC16,
                G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, NGB: tl.constexpr,
                WPG: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, EVEN_N: tl.constexpr,
                KMAJOR: tl.constexpr = False):
    pid_n, pid_m, pid_k, n_tiles = _gemv_pids(KMAJOR)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_mask = offs_n < N
    m_mask = offs_m < M
    KW = K // 8
    KG = K // G
    n_iter, it0, it1 = _k_slice(K, BK, SPLIT_K, pid_k)
    offs_k = tl.arange(0, BK)
    dtype = x_ptr.dtype.element_ty
    w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, it0, KW, KG, G, BK, NGB, WPG)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for it in range(it0, it1):
        k0 = it * BK
        words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, k0, G, EVEN_N)
        w_ptrs += BK // 8
        w = _dequant(words, s, z, MAGIC, MAGIC16, dtype, ASM)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=m_mask[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    _finish(acc, offs_n, n_mask, offs_m, M, N, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
            pid_m * n_tiles + pid_n, pid_k, SPLIT_K, HAS_BIAS)


@triton.jit(do_not_specialize=["MAGIC", "MAGIC16"])
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, MAGIC, MAGIC16,
                    G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NGB: tl.constexpr, WPG: tl.constexpr,
                    ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    k0 = pid_k * BK
    w_ptrs, s_ptrs, z_ptrs = _block_ptrs(qw_ptr, s_ptr, z_ptr, offs_n, pid_k, K // 8, K // G, G, BK, NGB, WPG)
    words, s, z = _load_block(w_ptrs, s_ptrs, z_ptrs, n_mask, k0, G, False)
    w = _dequant(words, s, z, MAGIC, MAGIC16, w_ptr.dtype.element_ty, ASM)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=n_mask[:, None])
