"""Decode attention over the paged KV cache (Triton): one query token per sequence, reading K/V
blocks in place through the sequence's block table (no gather copy), grouped-query heads of one KV
head together, online softmax in float32, and optional split-K over the context (flash-decoding)
so a small batch still fills the GPU. Shapes are static per call and lengths are read on the
device, so the call is CUDA-graph capturable. A sliding-window layer passes its window: only the
last `window` positions are read (the splits divide that span). Reference:
`vlmctl.runtime.ops.paged_decode_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...errors import OptionError
from . import kv_rows, pdl
from .compile_ahead import run as run_triton


@triton.jit
def _split_span(lens_ptr, seq, split, num_splits, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(context length, first position attended, positions per split in whole tiles, this split's
    first position) for one sequence; a sliding window starts `window` positions before the end."""
    ctx = tl.load(lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    return ctx, lo, per_split, lo + split * per_split


@triton.jit
def online_softmax_tile(s, seen, m_i, l_i, acc, v_ptr, vs_ptr, row, srow, valid, d, dmask, scale_log2,
                        dtype: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr, ASM: tl.constexpr):
    """One context tile's step of the online softmax: scores s [rows, N] (an 8-bit K's scales applied), kept where
    `seen`; the tile's V rows (at `row`, valid where `valid`) loaded and added in. Returns the running (max, sum,
    un-normalized output) in float32. QUANT: V's scales in vs_ptr at `srow`, folded into the probabilities relative
    to the tile's largest (so p times them keeps the model dtype's precision), the 8-bit rows widened to `dtype`."""
    s = tl.where(seen, s * scale_log2, float("-inf"))  # log2 domain
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet (a sliding window that starts past this tile) keeps max -inf: exponents
    # against 0 then give it alpha and p of 0, where -inf - -inf would give NaN
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    vt = 1.0
    if QUANT:
        vsc = tl.load(vs_ptr + srow, mask=valid, other=0.0)
        vt = tl.max(vsc, 0)
        p = p * (vsc / tl.where(vt > 0, vt, 1.0))[None, :]
        v = kv_rows.widen(v, dtype, ASM)
    if IEEE:  # float32 caches: no TF32 rounding
        acc = acc * alpha[:, None] + vt * tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + vt * tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# The pool's block size is a compile-time constant (one value an engine): a position's block and slot are then a
# shift and a mask instead of runtime divisions in every layout a tile is loaded in (1.5-3 % of a decode step on
# an H100; docs/benchmarks.md, session 42).
# The block-table width and the split count vary from step to step outside the captured graphs (eager decode
# rows: graphs off, or rows a graph cannot take): left unspecialized, they cannot make Triton compile a new
# variant in the middle of serving (docs/benchmarks.md, session 19).
_VARYING = ["stride_bt", "num_splits"]


@triton.jit(do_not_specialize=_VARYING)
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
                   scale_log2, block_size: tl.constexpr, group, num_splits, window,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr = False,
                   PDL: tl.constexpr = False, QUANT: tl.constexpr = False, ASM: tl.constexpr = False):
    """QUANT: 8-bit caches (`kv_rows`) with a float32 scale a (position, KV head) in ks_ptr / vs_ptr: K's scales
    multiply the scores, V's the probabilities, so the 8-bit values enter the dots as they are (widened exactly to
    the model dtype; ASM: by `kv_rows.widen`'s PTX where the tiles are loaded)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx, lo, per_split, start = _split_span(lens_ptr, seq, split, num_splits, window, BLOCK_N, HAS_WINDOW)
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    gmask = g < group
    heads = kvh * group + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        tok = tile + n
        valid = tok < end
        blk = tl.load(bt_ptr + seq * stride_bt + tok // block_size, mask=valid, other=0)
        row = blk.to(tl.int64) * stride_kb + (tok % block_size) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        srow = (blk.to(tl.int64) * block_size + tok % block_size) * tl.num_programs(1) + kvh  # 8-bit scales' index
        if QUANT:
            k = kv_rows.widen(k, q.dtype, ASM)
        if IEEE:  # float32 caches: no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G, N]
        else:
            s = tl.dot(q, tl.trans(k))
        if QUANT:
            s = s * tl.load(ks_ptr + srow, mask=valid, other=0.0)[None, :]
        m_i, l_i, acc = online_softmax_tile(s, valid[None, :], m_i, l_i, acc, v_ptr, vs_ptr, row, srow, valid, d,
                                            dmask, scale_log2, q.dtype, IEEE, QUANT, ASM)
    if SPLIT:
        # partial results: un-normalized acc, and (max, sum) per head, for the combine kernel
        pidx = (seq * (tl.num_programs(1) * group) + heads) * num_splits + split
        tl.store(part_ptr + pidx[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(ml_ptr + pidx * 2, m_i, mask=gmask)
        tl.store(ml_ptr + pidx * 2 + 1, l_i, mask=gmask)
    else:
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(q.dtype),
                 mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _rope_tile_load(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq, kvh, tile, end, stride_bt, stride_kb, stride_ks,
                    stride_kh, n_kv_heads, block_size: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    QUANT: tl.constexpr):
    """One tile of cached positions [tile, tile + BLOCK_N) before `end` for `_decode_rope_kernel`: K's two
    rotary halves, V, an 8-bit pool's scales (else 1.0), and which positions are valid."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    tok = tile + tl.arange(0, BLOCK_N)
    valid = tok < end
    blk = tl.load(bt_ptr + seq * stride_bt + tok // block_size, mask=valid, other=0)
    row = blk.to(tl.int64) * stride_kb + (tok % block_size) * stride_ks + kvh * stride_kh
    k1 = tl.load(k_ptr + row[:, None] + h[None, :], mask=valid[:, None], other=0.0)
    k2 = tl.load(k_ptr + row[:, None] + HALF + h[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    ksc = 1.0
    vsc = 1.0
    if QUANT:
        srow = (blk.to(tl.int64) * block_size + tok % block_size) * n_kv_heads + kvh  # 8-bit scales' index
        ksc = tl.load(ks_ptr + srow, mask=valid, other=0.0)
        vsc = tl.load(vs_ptr + srow, mask=valid, other=0.0)
    return k1, k2, v, ksc, vsc, valid


@triton.jit
def _rope_tile_step(q1, q2, k1, k2, v, ksc, vsc, valid, m_i, l_i, acc, scale_log2, dt: tl.constexpr,
                    QUANT: tl.constexpr, ASM: tl.constexpr):
    """The online softmax's step over one loaded tile (`_rope_tile_load`) for rotated q halves q1, q2."""
    if QUANT:
        k1 = kv_rows.widen(k1, dt, ASM)
        k2 = kv_rows.widen(k2, dt, ASM)
    s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    if QUANT:
        s = s * ksc[None, :]
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = 1.0
    if QUANT:  # as in `_decode_kernel`
        vt = tl.max(vsc, 0)
        p = p * (vsc / tl.where(vt > 0, vt, 1.0))[None, :]
        v = kv_rows.widen(v, dt, ASM)
    acc = acc * alpha[:, None] + vt * tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_VARYING)
def _decode_rope_kernel(qkv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr,
                        out_ptr, part_ptr, ml_ptr, cnt_ptr, stride_qt, stride_cs, stride_kb, stride_ks, stride_kh,
                        stride_bt, stride_ot, stride_oh, scale_log2, block_size: tl.constexpr, group, num_splits,
                        n_q_heads, n_kv_heads, window, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr = False, PDL: tl.constexpr = False,
                        COMBINE: tl.constexpr = False, BLOCK_S: tl.constexpr = 32, QUANT: tl.constexpr = False,
                        ASM: tl.constexpr = False, PREFETCH: tl.constexpr = 0, ROW_BYTES: tl.constexpr = 0,
                        EARLY: tl.constexpr = False):
    """`_decode_kernel` with the new token's rotary and KV append folded in: q and k of the token are
    rotated here (rounded per term as transformers does), the split that owns the last position
    writes k and v to the cache and attends to them from registers, the others read the cache.
    COMBINE (with SPLIT): the last split of a (sequence, KV head) to finish, counted in cnt_ptr (zero before
    and after), combines the splits' partials as `_combine_kernel` does, in place of that kernel's launch.
    QUANT: 8-bit caches, as in `_decode_kernel`; the new token's k and v are quantized as they are written and
    attended to as stored (dequantized to the model dtype, as the reference reads them).
    PREFETCH > 0 or EARLY: before the PDL wait the kernel reads the step's inputs (lengths, block tables, positions:
    copied in before the step's first kernel) and the rotary table, and PREFETCH asks L2 for the K and V rows
    (ROW_BYTES each) of this program's first PREFETCH tiles of cached positions, so that their HBM trip overlaps the
    qkv GEMV (a prefetch only warms L2, where every later read is coherent, so it cannot make a load stale); EARLY
    loads the first tile into registers there (`early_tile` says why that is safe). Neither: it waits first."""
    pdl.release(PDL)
    AHEAD: tl.constexpr = EARLY or PREFETCH > 0
    if not AHEAD:  # nothing read before the wait: the order every GPU run before session 47 measured
        pdl.wait(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx, lo, per_split, start = _split_span(lens_ptr, seq, split, num_splits, window, BLOCK_N, HAS_WINDOW)
    end = tl.minimum(start + per_split, ctx - 1)  # cached positions; the new one (ctx - 1) comes from qkv
    owner = split == (ctx - 1 - lo) // per_split
    h = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + seq)
    c = tl.load(cos_sin_ptr + pos * stride_cs + h)
    sn = tl.load(cos_sin_ptr + pos * stride_cs + HALF + h)
    if PREFETCH > 0:
        PF_N: tl.constexpr = PREFETCH * BLOCK_N
        ptok = start + tl.arange(0, PF_N)
        pblk = tl.load(bt_ptr + seq * stride_bt + ptok // block_size, mask=ptok < end, other=0)
        prow = pblk.to(tl.int64) * stride_kb + (ptok % block_size) * stride_ks + kvh * stride_kh
        pdl.prefetch_l2(k_ptr + prow, ROW_BYTES)  # past `end`: rows of block 0, which no sequence is handed
        pdl.prefetch_l2(v_ptr + prow, ROW_BYTES)
    if EARLY:
        k1_0, k2_0, v_0, ksc_0, vsc_0, valid_0 = _rope_tile_load(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq, kvh, start, end, stride_bt, stride_kb, stride_ks, stride_kh,
            n_kv_heads, block_size, HEAD_DIM, BLOCK_N, QUANT)
    if AHEAD:
        pdl.wait(PDL)

    g = tl.arange(0, BLOCK_G)
    gmask = g < group
    heads = kvh * group + g
    row_q = qkv_ptr + seq * stride_qt
    q1 = tl.load(row_q + heads[:, None] * HEAD_DIM + h[None, :], mask=gmask[:, None], other=0.0)
    q2 = tl.load(row_q + heads[:, None] * HEAD_DIM + HALF + h[None, :], mask=gmask[:, None], other=0.0)
    dt = q1.dtype
    c1 = c.to(dt).to(tl.float32)
    s1 = sn.to(dt).to(tl.float32)
    cf = c1[None, :]
    sf = s1[None, :]
    a1 = q1.to(tl.float32)
    a2 = q2.to(tl.float32)
    q1 = ((a1 * cf).to(dt).to(tl.float32) - (a2 * sf).to(dt).to(tl.float32)).to(dt)
    q2 = ((a2 * cf).to(dt).to(tl.float32) + (a1 * sf).to(dt).to(tl.float32)).to(dt)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    first = start
    if EARLY and start < end:  # the tile loaded before the wait (a program past the context has none)
        m_i, l_i, acc = _rope_tile_step(q1, q2, k1_0, k2_0, v_0, ksc_0, vsc_0, valid_0, m_i, l_i, acc, scale_log2,
                                        dt, QUANT, ASM)
        first = start + BLOCK_N
    for tile in range(first, end, BLOCK_N):
        k1, k2, v, ksc, vsc, valid = _rope_tile_load(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq, kvh, tile, end,
                                                     stride_bt, stride_kb, stride_ks, stride_kh, n_kv_heads,
                                                     block_size, HEAD_DIM, BLOCK_N, QUANT)
        m_i, l_i, acc = _rope_tile_step(q1, q2, k1, k2, v, ksc, vsc, valid, m_i, l_i, acc, scale_log2, dt, QUANT,
                                        ASM)
    d = tl.arange(0, HEAD_DIM)
    if owner:
        kb = row_q + (n_q_heads + kvh) * HEAD_DIM
        b1 = tl.load(kb + h).to(tl.float32)
        b2 = tl.load(kb + HALF + h).to(tl.float32)
        kn1 = ((b1 * c1).to(dt).to(tl.float32) - (b2 * s1).to(dt).to(tl.float32)).to(dt)
        kn2 = ((b2 * c1).to(dt).to(tl.float32) + (b1 * s1).to(dt).to(tl.float32)).to(dt)
        vn = tl.load(row_q + (n_q_heads + n_kv_heads + kvh) * HEAD_DIM + d)
        slot = tl.load(slot_ptr + seq)
        dst = (slot // block_size).to(tl.int64) * stride_kb + (slot % block_size) * stride_ks + kvh * stride_kh
        if QUANT:
            sk = kv_rows.row_scale(tl.maximum(tl.max(tl.abs(kn1.to(tl.float32)), 0),
                                              tl.max(tl.abs(kn2.to(tl.float32)), 0)), k_ptr.dtype.element_ty)
            sv = kv_rows.row_scale(tl.max(tl.abs(vn.to(tl.float32)), 0), v_ptr.dtype.element_ty)
            e1 = kv_rows.quantize(kn1, sk, k_ptr.dtype.element_ty)
            e2 = kv_rows.quantize(kn2, sk, k_ptr.dtype.element_ty)
            ev = kv_rows.quantize(vn, sv, v_ptr.dtype.element_ty)
            tl.store(k_ptr + dst + h, e1)
            tl.store(k_ptr + dst + HALF + h, e2)
            tl.store(v_ptr + dst + d, ev)
            tl.store(ks_ptr + slot.to(tl.int64) * n_kv_heads + kvh, sk)
            tl.store(vs_ptr + slot.to(tl.int64) * n_kv_heads + kvh, sv)
            kn1 = (e1.to(tl.float32) * sk).to(dt)
            kn2 = (e2.to(tl.float32) * sk).to(dt)
            vn = (ev.to(tl.float32) * sv).to(dt)
        else:
            tl.store(k_ptr + dst + h, kn1)
            tl.store(k_ptr + dst + HALF + h, kn2)
            tl.store(v_ptr + dst + d, vn)
        s_new = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :]
                       + q2.to(tl.float32) * kn2.to(tl.float32)[None, :], 1) * scale_log2
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.math.exp2(m_i - m_new)
        p_new = tl.math.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
        m_i = m_new
    if SPLIT:
        pidx = (seq * (tl.num_programs(1) * group) + heads) * num_splits + split
        tl.store(part_ptr + pidx[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + pidx * 2, m_i, mask=gmask)
        tl.store(ml_ptr + pidx * 2 + 1, l_i, mask=gmask)
        if COMBINE:
            # every thread's partial is written before the ticket is taken (release); the last split reads
            # the others' from L2 (.cg) after its acquire, then leaves the counter at zero for the next call
            tl.debug_barrier()
            cidx = seq * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(cnt_ptr + cidx, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                for gi in range(0, group):
                    head = kvh * group + gi
                    _combine_head(part_ptr, ml_ptr, out_ptr, seq, head, (seq * tl.num_programs(1) * group + head) *
                                  num_splits, num_splits, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM, BLOCK_S, ".cg")
                tl.atomic_xchg(cnt_ptr + cidx, 0)
    else:
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(dt), mask=gmask[:, None])


@triton.jit
def _combine_head(part_ptr, ml_ptr, out_ptr, seq, h, base, num_splits, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """out[seq, h] from the splits' partials at rows base .. base + num_splits: rescaled to the largest max."""
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    m = tl.load(ml_ptr + (base + s) * 2, mask=smask, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(ml_ptr + (base + s) * 2 + 1, mask=smask, other=0.0, cache_modifier=CACHE)
    m_all = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_all), 0.0)
    denom = tl.sum(l * w, 0)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    part = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & dmask[None, :],
                   other=0.0, cache_modifier=CACHE)
    o = tl.sum(part * w[:, None], 0) / denom
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, n_heads, num_splits,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl.release(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    _combine_head(part_ptr, ml_ptr, out_ptr, seq, h, (seq * n_heads + h) * num_splits, num_splits, stride_ot,
                  stride_oh, HEAD_DIM, D_PAD, BLOCK_S, "")


def combine_width(num_splits: int) -> int:
    """The combine's split lanes: one width for every count `choose_splits` gives (up to 32), so that a step's
    split count never selects a kernel variant that was not compiled at load."""
    return max(32, triton.next_power_of_2(num_splits))


def choose_splits(batch: int, n_kv_heads: int, max_context: int, num_sms: int, block_n: int = 64) -> int:
    """Split the context when batch x KV heads alone would leave the multiprocessors short of work: a
    small batch then reads its KV cache with many programs of a tile or two each (the split count is
    fixed per captured batch size; programs past the actual context return at once). As many splits as
    keep the programs within 4 per SM, rounded down: rounding up (3 splits for 8 sequences of 32 KV heads on
    132 SMs, not 2) made their attention 9-17 % slower and their decode step ~4 % (docs/benchmarks.md,
    session 21)."""
    programs = batch * n_kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = (4 * num_sms) // programs
    return max(1, min(want, triton.cdiv(max_context, block_n), 32))


def split_workspace(batch: int, n_heads: int, head_dim: int, num_splits: int, device) -> tuple:
    """What a decode call with num_splits > 1 writes for the combine: each split's un-normalized output
    [B * H * S, d] and its (max, sum) [B * H * S, 2], float32, and the arrival counters of the combine folded
    into `paged_decode_rope` ([B * H] int32, zero between calls). Pass it as `workspace` to reuse it."""
    rows = batch * n_heads * num_splits
    return (torch.empty((rows, head_dim), dtype=torch.float32, device=device),
            torch.empty((rows, 2), dtype=torch.float32, device=device),
            torch.zeros(batch * n_heads, dtype=torch.int32, device=device))


def _partials(out: torch.Tensor, num_splits: int, workspace) -> tuple:
    """(part, ml, counters or None) for the decode kernels: the split workspace (a (part, ml) pair has no
    counters: its combine runs as a kernel of its own), or `out` (unused) without splits."""
    if num_splits <= 1:
        return out, out, None
    B, H, D = out.shape
    ws = workspace if workspace is not None else split_workspace(B, H, D, num_splits, out.device)
    return ws[0], ws[1], (ws[2] if len(ws) > 2 else None)


def _combine(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    B, H, D = out.shape
    run_triton(_combine_kernel, (B, H), part, ml, out, out.stride(0), out.stride(1), H, num_splits, HEAD_DIM=D,
               D_PAD=triton.next_power_of_2(D), BLOCK_S=combine_width(num_splits), num_warps=4,
               **pdl.launch_kwargs(out.device))


def combine_in_attention() -> bool:
    """`VLMCTL_ATTN_COMBINE` (default 1): `paged_decode_rope`'s last split combines the splits' partials; 0
    launches the combine kernel after it, as before session 19 (for A/B measurements)."""
    v = os.environ.get("VLMCTL_ATTN_COMBINE", "1").strip()
    if v not in ("0", "1"):
        raise OptionError(f"VLMCTL_ATTN_COMBINE={v!r}: expected 0 or 1")
    return v == "1"


def _decode_launch_kwargs(device) -> dict:
    """PDL launch arguments of the step's decode attention. `VLMCTL_ATTN_PDL=0` (a measurement, session 32):
    compiled with PDL, so that it still lets the o projection start early, but launched only once the qkv GEMV
    before it has completed, so that none of its programs waits on an SM while qkv's blocks still run."""
    kw = pdl.launch_kwargs(device)
    v = os.environ.get("VLMCTL_ATTN_PDL", "1").strip()
    if v not in ("0", "1"):
        raise OptionError(f"VLMCTL_ATTN_PDL={v!r}: expected 1 (the default) or 0")
    return {"PDL": True} if v == "0" and kw.get("launch_pdl") else kw


def _tile(head_dim: int, quant: bool, widened: bool = False) -> tuple[int, int, int]:
    """(context positions a loop iteration reads, warps, software-pipeline stages) of the decode kernels. An 8-bit
    pool reads twice the positions of a 16-bit one, so that an iteration keeps the same bytes in flight (on an H100
    at batch 64 an fp8 pool read 64 positions an iteration ran its attention at ~1.1 TB/s, the 16-bit one at ~2.9).
    Tiles widened where they are loaded (`_widen_in_registers`) take one stage: with two, each tile sat in shared
    memory twice, 8-bit as copied and 16-bit as widened (75 KB a program against 41 for a 128-position tile on
    sm_90, Triton 3.6), and on an H100 at batch 64 the step took 15.9 (int8) and 15.5 ms (fp8) against 14.7 and
    14.5 with one; tiles cast after the trip keep two (fp8 with one: 17.9 against 15.3; docs/benchmarks.md,
    session 43). `VLMCTL_ATTN_KV8_TILE`, `VLMCTL_ATTN_KV8_WARPS` and `VLMCTL_ATTN_KV8_STAGES` override the 8-bit
    pool's (measurements)."""
    from .settings import env_int

    if not quant:
        return (64 if head_dim <= 128 else 32), 4, 2
    tile = env_int("VLMCTL_ATTN_KV8_TILE", 128 if head_dim <= 128 else 64, minimum=16)
    if tile & (tile - 1):
        raise OptionError(f"VLMCTL_ATTN_KV8_TILE={tile}: expected a power of two (16 or more)")
    return (tile, env_int("VLMCTL_ATTN_KV8_WARPS", 4, minimum=1),
            env_int("VLMCTL_ATTN_KV8_STAGES", 1 if widened else 2, minimum=1))


def prefetch_tiles(device) -> int:
    """Tiles of cached positions a decode-attention program asks L2 for before its PDL wait
    (`VLMCTL_ATTN_PREFETCH`, default 0; PDL launches only, where the qkv GEMV before it is still running)."""
    from .settings import env_int

    tiles = env_int("VLMCTL_ATTN_PREFETCH", 0, minimum=0)
    if tiles & (tiles - 1):
        raise OptionError(f"VLMCTL_ATTN_PREFETCH={tiles}: expected 0 or a power of two")
    return tiles if pdl.enabled(device) else 0


def early_tile(device) -> bool:
    """Whether a decode-attention program loads its first tile of cached K/V into registers before its PDL wait
    (`VLMCTL_ATTN_EARLY_TILE`, default 0; PDL launches only). Those positions were written in earlier steps, and
    a step's first kernels wait for the last one's (copies and torch's kernels are launched without PDL)."""
    v = os.environ.get("VLMCTL_ATTN_EARLY_TILE", "0").strip() or "0"
    if v not in ("0", "1"):
        raise OptionError(f"VLMCTL_ATTN_EARLY_TILE={v!r}: expected 0 or 1")
    return v == "1" and pdl.enabled(device)


def _widen_in_registers(k_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the decode kernels widen an 8-bit pool's tiles to fp16 by `kv_rows.widen`'s PTX where they are
    loaded (then through shared memory as 16-bit values, by ldmatrix, in one pipeline stage: `_tile`) rather than
    by a cast after that trip. Compiled kernels with fp16 models only. On an H100 at batch 64 a decode step took
    14.7 ms (int8) and 14.5 (fp8) widened, against 17.8 and 15.3 cast (docs/benchmarks.md, session 43);
    `VLMCTL_ATTN_KV8_WIDEN=0` casts instead (measurements)."""
    v = os.environ.get("VLMCTL_ATTN_KV8_WIDEN", "").strip()
    if v not in ("", "0", "1"):
        raise OptionError(f"VLMCTL_ATTN_KV8_WIDEN={v!r}: expected 0 or 1 (unset: 1)")
    if k_cache.dtype not in (torch.int8, torch.float8_e4m3fn) or dtype != torch.float16:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return v != "0"


def _scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """The scale pointers of an 8-bit cache (the kernels index them as [blocks, bs, Hkv], contiguous), or the
    cache itself twice as unused stand-ins."""
    if k_scale is None:
        return k_cache, k_cache
    if not (k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.shape == k_cache.shape[:3]):
        raise ValueError(f"8-bit KV scales must be contiguous [blocks, bs, Hkv] = {tuple(k_cache.shape[:3])}")
    return k_scale, v_scale


def fused_rope_supported(head_dim: int, dtype) -> bool:
    return head_dim in (32, 64, 128, 256) and dtype in (torch.float16, torch.bfloat16)


def paged_decode_rope(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, n_q: int, n_kv: int, num_splits: int = 1,
                      workspace: tuple | None = None, window: int | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of qkv rows [B, (n_q + 2 n_kv) * d] (not yet rotated) with the rotary of the new
    token and its KV append done in the same kernel. context_lens count the new token; `window`:
    attend only the last `window` positions; `k_scale`/`v_scale` ([blocks, bs, n_kv] float32, contiguous):
    the caches are 8-bit (`vlmctl.runtime.kv_quant`)."""
    B = qkv.shape[0]
    D = k_cache.shape[3]
    group = n_q // n_kv
    out = torch.empty((B, n_q, D), dtype=qkv.dtype, device=qkv.device)
    split = num_splits > 1
    part, ml, cnt = _partials(out, num_splits, workspace)
    fold = split and cnt is not None and combine_in_attention()
    widen = _widen_in_registers(k_cache, qkv.dtype)
    block_n, warps, stages = _tile(D, k_scale is not None, widen)
    run_triton(
        _decode_rope_kernel, (B, n_kv, num_splits),
        qkv, cos_sin, positions, slots, k_cache, v_cache, *_scales(k_cache, k_scale, v_scale), block_tables,
        context_lens, out, part, ml,
        cnt if fold else ml, qkv.stride(0), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * 1.4426950408889634, k_cache.shape[1], group,
        num_splits, n_q, n_kv, window or 0, HEAD_DIM=D, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, SPLIT=split, HAS_WINDOW=window is not None,
        COMBINE=fold, BLOCK_S=combine_width(num_splits), QUANT=k_scale is not None,
        ASM=widen, PREFETCH=prefetch_tiles(qkv.device), ROW_BYTES=D * k_cache.element_size(),
        EARLY=early_tile(qkv.device),
        num_warps=warps, num_stages=stages,
        **_decode_launch_kwargs(qkv.device))
    if split and not fold:
        _combine(part, ml, out, num_splits)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int = 1, out: torch.Tensor | None = None,
                 workspace: tuple | None = None, window: int | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, d] (row stride free), caches [blocks, block_size, Hkv, d], block_tables [B, max_blocks]
    int32, context_lens [B] int32 (tokens to attend, the current one included) -> out [B, Hq, d].
    `window`: attend only the last `window` of them; `k_scale`/`v_scale`: an 8-bit cache's scales."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device) if out is None else out
    BLOCK_G = max(16, triton.next_power_of_2(group))
    widen = _widen_in_registers(k_cache, q.dtype)
    BLOCK_N, warps, stages = _tile(D, k_scale is not None, widen)
    split = num_splits > 1
    part, ml, _ = _partials(out, num_splits, workspace)
    run_triton(
        _decode_kernel, (B, Hkv, num_splits),
        q, k_cache, v_cache, *_scales(k_cache, k_scale, v_scale), block_tables, context_lens, out, part, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * 1.4426950408889634, k_cache.shape[1], group, num_splits,
        window or 0, HEAD_DIM=D, D_PAD=triton.next_power_of_2(D), BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, SPLIT=split,
        IEEE=q.dtype == torch.float32, HAS_WINDOW=window is not None, QUANT=k_scale is not None,
        ASM=widen, num_warps=warps,
        num_stages=stages, **pdl.launch_kwargs(q.device))
    if split:
        _combine(part, ml, out, num_splits)
    return out
