"""Attention of a prompt chunk that continues a cached context, read in place from the paged KV cache (Triton).

A chunk of n new tokens after `length - n` cached ones (a prompt's later chunk, or the next turn of a chat whose
prefix was found in the cache) attends causally over all `length` positions; its own K and V are already in the
pool (`ops.rope_and_cache` wrote them). Without this kernel each layer gathered the context into a contiguous copy
(K and V, dequantized from an 8-bit pool) and ran SDPA over it with a lower-right causal mask: three to five
launches, the context written and read once more, and the host work of each. Here one launch a layer: a program
takes BLOCK_M query rows of one query head, walks the context through the block table in BLOCK_N-position tiles
with an online softmax in float32 (as the decode kernel, `paged_attention`), and stops at its last row's position.
8-bit pools: K's scales multiply the scores and V's the probabilities, the 8-bit values widened exactly to the model
dtype. Reference: `vlmctl.runtime.ops.prefill_attention` over `ops.gather_kv`'s context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_rows
from .paged_attention import _scales, _widen_in_registers, online_softmax_tile
from .compile_ahead import run as run_triton

# The context length and the chunk's length change with every call: left unspecialized, they cannot make Triton
# compile a new variant in the middle of serving (the engine's warm-up compiles this kernel at load).
_VARYING = ["length", "n"]


@triton.jit(do_not_specialize=_VARYING)
def _chunk_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, out_ptr, stride_qt, stride_qh, stride_kb, stride_ks,
                  stride_kh, stride_ot, stride_oh, length, n, scale_log2, group, n_kv_heads,
                  block_size: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr = False, ASM: tl.constexpr = False):
    head = tl.program_id(1)
    kvh = head // group
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the chunk
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    rows = t < n
    first = length - n  # the chunk's first position
    pos = first + tl.minimum(t, n - 1)  # rows past the chunk repeat its last (never stored): no row sees nothing
    q = tl.load(q_ptr + t[:, None] * stride_qt + head * stride_qh + d[None, :], mask=rows[:, None] & dmask[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    c = tl.arange(0, BLOCK_N)
    end = tl.minimum(first + (tl.program_id(0) + 1) * BLOCK_M, length)  # past this block's last row: masked for all
    for tile in range(0, end, BLOCK_N):
        tok = tile + c
        valid = tok < end
        blk = tl.load(bt_ptr + tok // block_size, mask=valid, other=0).to(tl.int64)
        row = blk * stride_kb + (tok % block_size) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        srow = (blk * block_size + tok % block_size) * n_kv_heads + kvh  # the 8-bit scales' index
        if QUANT:
            k = kv_rows.widen(k, q.dtype, ASM)
        if IEEE:  # float32 caches: no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if QUANT:
            s = s * tl.load(ks_ptr + srow, mask=valid, other=0.0)[None, :]
        seen = valid[None, :] & (tok[None, :] <= pos[:, None])  # causal
        m_i, l_i, acc = online_softmax_tile(s, seen, m_i, l_i, acc, v_ptr, vs_ptr, row, srow, valid, d, dmask,
                                            scale_log2, q.dtype, IEEE, QUANT, ASM)
    o = acc / l_i[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] & dmask[None, :])


def tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and context positions a program holds at once. One pair per head size, so the
    engine's warm-up chunk compiles the only variant a model runs."""
    return (32, 64) if head_dim <= 128 else (32, 32)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    length: int, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a chunk's queries q [n, Hq, d] (any row stride, unit stride in d) over the first `length`
    positions of one sequence in the paged pools [blocks, bs, Hkv, d] (8-bit with `k_scale`/`v_scale` [blocks, bs,
    Hkv]); query i sits at position length - n + i. Returns [n, Hq, d] in q's dtype, written into `out` (any row
    stride) where given."""
    n, Hq, d = q.shape
    _, bs, Hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty((n, Hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit stride in d")
    if n == 0:
        return out
    block_m, block_n = tiles(d)
    ks, vs = _scales(k_cache, k_scale, v_scale)
    run_triton(_chunk_kernel, (triton.cdiv(n, block_m), Hq), q, k_cache, v_cache, ks, vs, block_table, out,
               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               out.stride(0), out.stride(1), length, n, scale * 1.4426950408889634, Hq // Hkv, Hkv,
               block_size=bs, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_M=block_m, BLOCK_N=block_n,
               IEEE=q.dtype == torch.float32, QUANT=k_scale is not None, ASM=_widen_in_registers(k_cache, q.dtype),
               num_warps=4, num_stages=2)
    return out
