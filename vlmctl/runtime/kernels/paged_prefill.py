"""Attention of prompt rows over their sequences' paged KV cache, read in place (Triton): the paged prompt kernel.

Rows of several sequences at once (prompt chunks, continuations after cached positions, decode rows; their own K and
V already appended by `ops.rope_and_cache`) attend causally over everything their sequence has cached. Before this
kernel each continuation chunk gathered its context into a contiguous copy (dequantized from an 8-bit pool) and ran
SDPA over it with a lower-right causal mask: three to five launches per chunk and layer, the context written and
read once more, and the host work of each. Here one launch a layer for all rows. Which rows belong to which
sequence, and at which positions, comes from a tile table in device memory (`tile_table`): a program takes one tile
(up to BLOCK_M consecutive rows of one sequence) of one query head, walks the sequence's block table in
BLOCK_N-position tiles with an online softmax in float32 (as the decode kernel, `paged_attention`), from the first
key in its first row's window to its last row's position. Because nothing about the rows is a launch argument, a
step's attention can be captured in a CUDA graph and replayed for other rows (`runtime/step_graphs.py`). 8-bit
pools: K's scales multiply the scores and V's the probabilities, the 8-bit values widened exactly to the model
dtype. Reference: `vlmctl.runtime.ops.prompt_attention_reference` (`prefill_attention` over `ops.gather_kv`'s
context, a tile at a time).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import kv_rows
from .paged_attention import _scales, _widen_in_registers, online_softmax_tile
from .compile_ahead import run as run_triton

# A tile is up to BLOCK_M consecutive query rows of one sequence: int32 (sequence, first row in q, rows, position of
# the first row). A table may hold more tiles than a step needs (a captured step's is sized for its bucket); rows 0
# marks an unused one, whose programs load nothing and store nothing.
TILE_FIELDS = 4
NO_WINDOW = 1 << 30  # a window no context reaches: every earlier position is seen


# A step's block tables are as wide as its longest sequence's (eager) and a window is a model's: left unspecialized,
# neither makes Triton compile another variant in the middle of serving (divisible by 16 or not, or equal to 1).
_VARYING = ["stride_bt", "window"]


@triton.jit(do_not_specialize=_VARYING)
def _prompt_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, tiles_ptr, out_ptr, stride_qt, stride_qh, stride_kb,
                   stride_ks, stride_kh, stride_bt, stride_ot, stride_oh, window, scale_log2, group, n_kv_heads,
                   block_size: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr = False,
                   ASM: tl.constexpr = False):
    head = tl.program_id(1)
    kvh = head // group
    tile_ptr = tiles_ptr + tl.program_id(0) * 4
    seq = tl.load(tile_ptr).to(tl.int64)
    row0 = tl.load(tile_ptr + 1)
    m = tl.load(tile_ptr + 2)
    pos0 = tl.load(tile_ptr + 3)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    rows = i < m
    t = (row0 + i).to(tl.int64)
    pos = pos0 + tl.minimum(i, tl.maximum(m - 1, 0))  # rows past the tile repeat its last (never stored)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head * stride_qh + d[None, :], mask=rows[:, None] & dmask[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    c = tl.arange(0, BLOCK_N)
    table = bt_ptr + seq * stride_bt
    end = tl.where(m > 0, pos0 + m, 0)  # past the tile's last row; an unused tile walks nothing
    lo = (tl.maximum(pos0 - window + 1, 0) // BLOCK_N) * BLOCK_N  # the first row's first key in its window
    for tile in range(lo, end, BLOCK_N):
        tok = tile + c
        valid = tok < end
        blk = tl.load(table + tok // block_size, mask=valid, other=0).to(tl.int64)
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
        # causal, and within the window (transformers' sliding window: keys less than `window` positions back)
        seen = valid[None, :] & (tok[None, :] <= pos[:, None]) & (tok[None, :] > pos[:, None] - window)
        m_i, l_i, acc = online_softmax_tile(s, seen, m_i, l_i, acc, v_ptr, vs_ptr, row, srow, valid, d, dmask,
                                            scale_log2, q.dtype, IEEE, QUANT, ASM)
    o = acc / tl.where(rows, l_i, 1.0)[:, None]  # rows past the tile (all of an unused one's) saw nothing
    tl.store(out_ptr + t[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] & dmask[None, :])


def tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and context positions a program holds at once. One pair per head size, so the
    engine's warm-up compiles the only variant a model runs."""
    return (32, 64) if head_dim <= 128 else (32, 32)


def max_tiles(rows: int, sequences: int, block_m: int) -> int:
    """The most tiles `rows` query rows of up to `sequences` sequences can take: each sequence's last tile may be
    partial."""
    return -(-rows // block_m) + sequences


def tile_table(chunks, block_m: int, size: int | None = None) -> np.ndarray:
    """int32 [size or as many as needed, TILE_FIELDS]: the tiles of chunks given as (sequence, first row in q, rows,
    position of the first row); rows past the last tile are unused (all zero)."""
    out = []
    for seq, row0, n, pos0 in chunks:
        for o in range(0, n, block_m):
            out.append((seq, row0 + o, min(block_m, n - o), pos0 + o))
    size = len(out) if size is None else size
    if len(out) > size:
        raise ValueError(f"{len(out)} tiles exceed the table's {size}")
    table = np.zeros((size, TILE_FIELDS), np.int32)
    if out:
        table[:len(out)] = out
    return table


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     tiles_t: torch.Tensor, scale: float, window: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query rows q [T, Hq, d] (any row stride, unit stride in d) over their sequences' cached
    positions in the paged pools [blocks, bs, Hkv, d] (8-bit with `k_scale`/`v_scale` [blocks, bs, Hkv]), every
    row's own K and V already appended. `tiles_t` (int32 [tiles, TILE_FIELDS], `tile_table`) says which rows are
    whose and where they sit; `block_tables` int32 [sequences, max blocks]. With `window`, a row sees only keys less
    than `window` positions back. Rows in no tile are left as they are. Returns out [T, Hq, d] in q's dtype (any row
    stride), allocated where not given."""
    T, Hq, d = q.shape
    _, bs, Hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty((T, Hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit stride in d")
    if tiles_t.shape[0] == 0:
        return out
    block_m, block_n = tiles(d)
    ks, vs = _scales(k_cache, k_scale, v_scale)
    run_triton(_prompt_kernel, (tiles_t.shape[0], Hq), q, k_cache, v_cache, ks, vs, block_tables, tiles_t, out,
               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0), out.stride(0), out.stride(1), NO_WINDOW if window is None else window,
               scale * 1.4426950408889634, Hq // Hkv, Hkv, block_size=bs, HEAD_DIM=d,
               D_PAD=triton.next_power_of_2(d), BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
               QUANT=k_scale is not None, ASM=_widen_in_registers(k_cache, q.dtype), num_warps=4, num_stages=2)
    return out


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    length: int, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """`prompt_attention` of one chunk q [n, Hq, d] of one sequence (block table [blocks]) whose rows sit at
    positions length - n .. length - 1."""
    n = q.shape[0]
    table = tile_table([(0, 0, n, length - n)], tiles(q.shape[2])[0])
    return prompt_attention(q, k_cache, v_cache, block_table.to(torch.int32).view(1, -1),
                            torch.from_numpy(table).to(q.device), scale, window, k_scale, v_scale, out)
