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
# the first row, splits: the programs its context is divided among). A table may hold more tiles than a step needs
# (a captured step's is sized for its bucket); rows 0 marks an unused one, whose programs load nothing and store
# nothing.
TILE_FIELDS = 5
NO_WINDOW = 1 << 30  # a window no context reaches: every earlier position is seen
# A split walks at least this many context positions: fewer would spend more on writing and combining partials than
# the parallelism gains.
SPLIT_POSITIONS = 256
# The splits' partials take rows x heads x splits x head_dim float32 values; a launch's splits are capped to keep them
# within this (a few MB at the row counts where splitting pays: few rows over a long context).
SPLIT_WORKSPACE_BYTES = 16 << 20
# `VLMCTL_PROMPT_SPLITS` unset: up to 16 splits a tile. On an H100 one layer's attention of 16 rows after 1,888
# positions took 27 µs split 8 ways against 64 unsplit (and 47 for SDPA on a gathered context), a captured 16-row
# step 6.9 ms against 8.1 (docs/benchmarks.md, session 47)
DEFAULT_SPLITS = 16


# A step's block tables are as wide as its longest sequence's (eager) and a window is a model's: left unspecialized,
# neither makes Triton compile another variant in the middle of serving (divisible by 16 or not, or equal to 1).
_VARYING = ["stride_bt", "window", "n_tiles", "grid_splits"]


@triton.jit
def _tile_span(tile_ptr, window, BLOCK_N: tl.constexpr):
    """(first row in q, rows, position of the first row, splits, the first key position walked: the first row's
    window start rounded down to a key tile, past the last row) of one tile of the table."""
    row0 = tl.load(tile_ptr + 1)
    m = tl.load(tile_ptr + 2)
    pos0 = tl.load(tile_ptr + 3)
    splits = tl.load(tile_ptr + 4)
    end = tl.where(m > 0, pos0 + m, 0)  # past the tile's last row; an unused tile walks nothing
    lo = (tl.maximum(pos0 - window + 1, 0) // BLOCK_N) * BLOCK_N  # the first row's first key in its window
    return row0, m, pos0, splits, lo, end


@triton.jit(do_not_specialize=_VARYING)
def _prompt_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, tiles_ptr, out_ptr, part_ptr, ml_ptr, stride_qt,
                   stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh, window, scale_log2,
                   group, n_kv_heads, n_tiles, grid_splits, block_size: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   QUANT: tl.constexpr = False, ASM: tl.constexpr = False, SPLIT: tl.constexpr = False):
    """SPLIT: programs 0 .. n_tiles - 1 are split 0 of each of the table's tiles; the grid_splits - 1 programs after
    those, a tile each, are splits 1 .. grid_splits - 1 of the table's first tiles (as many as the launch allows a
    split: `prompt_attention`'s split_rows). A tile's fifth field says how many of its splits run (programs past
    them return), each a run of whole key tiles of [lo, end); a tile of one split stores its output, a tile of
    several its un-normalized partials and (max, sum) a row for `_combine_kernel`, at ((row * heads + head) *
    grid_splits + split)."""
    # Without splits a head's tiles, which read the same keys, are neighbours in the launch order; with them heads vary
    # fastest, so that every tile's split 0 is scheduled before the programs of further splits (and a captured table's
    # unused rows), many of which return at once: interleaved with those, a few tiles' programs could share SMs while
    # others held only empty ones (an H100 took 2-21 µs longer a layer, docs/benchmarks.md session 49).
    if SPLIT:
        head = tl.program_id(0)
        p = tl.program_id(1)
    else:
        head = tl.program_id(1)
        p = tl.program_id(0)
    kvh = head // group
    tile_idx = p
    split = 0
    if SPLIT:
        extra = tl.maximum(p - n_tiles, 0)
        tile_idx = tl.where(p < n_tiles, p, extra // tl.maximum(grid_splits - 1, 1))
        split = tl.where(p < n_tiles, 0, 1 + extra % tl.maximum(grid_splits - 1, 1))
    tile_ptr = tiles_ptr + tile_idx * 5
    seq = tl.load(tile_ptr).to(tl.int64)
    row0, m, pos0, splits, lo, end = _tile_span(tile_ptr, window, BLOCK_N)
    first = lo
    stop = end
    if SPLIT:
        if split >= tl.maximum(splits, 1):
            return
        per = tl.cdiv(tl.cdiv(end - lo, tl.maximum(splits, 1)), BLOCK_N) * BLOCK_N
        first = lo + split * per
        stop = tl.minimum(first + per, end)
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
    for tile in range(first, stop, BLOCK_N):
        tok = tile + c
        valid = tok < stop
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
    if SPLIT and splits > 1:
        # a row may see no key of its split (causal, or a window): max -inf, sum 0, acc 0, which the combine weighs 0
        pidx = (t * tl.num_programs(0) + head) * grid_splits + split
        tl.store(part_ptr + pidx[:, None] * HEAD_DIM + d[None, :], acc, mask=rows[:, None] & dmask[None, :])
        tl.store(ml_ptr + pidx * 2, m_i, mask=rows)
        tl.store(ml_ptr + pidx * 2 + 1, l_i, mask=rows)
    else:
        o = acc / tl.where(rows, l_i, 1.0)[:, None]  # rows past the tile (all of an unused one's) saw nothing
        tl.store(out_ptr + t[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rows[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=_VARYING)
def _combine_kernel(tiles_ptr, part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, window, grid_splits,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output rows of a tile of several splits from their partials (`_prompt_kernel` with SPLIT), rescaled to
    each row's largest max; tiles of one split (or none) were written by the prompt kernel."""
    head = tl.program_id(0)
    tile_ptr = tiles_ptr + tl.program_id(1) * 5
    row0, m, pos0, splits, lo, end = _tile_span(tile_ptr, window, BLOCK_N)
    if splits > 1:
        i = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        rows = i < m
        t = (row0 + i).to(tl.int64)
        base = (t * tl.num_programs(0) + head) * grid_splits
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for sp in range(0, splits):
            m_all = tl.maximum(m_all, tl.load(ml_ptr + (base + sp) * 2, mask=rows, other=float("-inf")))
        m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for sp in range(0, splits):
            w = tl.math.exp2(tl.load(ml_ptr + (base + sp) * 2, mask=rows, other=float("-inf")) - m_ref)
            denom += w * tl.load(ml_ptr + (base + sp) * 2 + 1, mask=rows, other=0.0)
            part = tl.load(part_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :],
                           mask=rows[:, None] & dmask[None, :], other=0.0)
            acc += part * w[:, None]
        o = acc / tl.where(rows, denom, 1.0)[:, None]
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


def tile_table(chunks, block_m: int, size: int | None = None, *, max_splits: int = 1, heads: int = 1,
               sms: int = 132) -> np.ndarray:
    """int32 [size or as many as needed, TILE_FIELDS]: the tiles of chunks given as (sequence, first row in q, rows,
    position of the first row), each with its splits (`split_counts`); rows past the last tile are unused (all
    zero)."""
    out = []
    for seq, row0, n, pos0 in chunks:
        for o in range(0, n, block_m):
            out.append((seq, row0 + o, min(block_m, n - o), pos0 + o, 1))
    size = len(out) if size is None else size
    if len(out) > size:
        raise ValueError(f"{len(out)} tiles exceed the table's {size}")
    table = np.zeros((size, TILE_FIELDS), np.int32)
    if out:
        table[:len(out)] = out
        table[:len(out), 4] = split_counts(table[:len(out), 2] + table[:len(out), 3], heads, max_splits, sms)
    return table


def split_counts(ends: np.ndarray, heads: int, max_splits: int, sms: int) -> np.ndarray:
    """How many programs walk each tile's context (tiles past positions `ends`, `heads` query heads a tile): one
    where the tiles alone give each SM two programs or more; else as many as give ~4 a SM, each at least
    SPLIT_POSITIONS positions, at most max_splits. Few rows over a long context (a chat's next turn after a
    prefix-cache hit) otherwise leave most SMs idle: 1 tile x 32 heads is 32 programs."""
    ends = np.asarray(ends, dtype=np.int64)
    if max_splits <= 1 or len(ends) > split_tiles(heads, sms):
        return np.ones(len(ends), np.int32)
    want = -(-4 * sms // (len(ends) * heads))
    by_length = -(-ends // SPLIT_POSITIONS)
    return np.clip(np.minimum(by_length, want), 1, max_splits).astype(np.int32)


def split_tiles(heads: int, sms: int) -> int:
    """The most tiles a step may have and still split any (`split_counts`: fewer than two programs a SM): so a
    table's tiles past this many rows hold one split each, and a launch needs split programs for its first rows
    only."""
    return (2 * sms - 1) // heads


def split_rows_of(table: np.ndarray) -> int:
    """`prompt_attention`'s split_rows for a table known on the host: all of its rows where one splits, else none."""
    return len(table) if (table[:, 4] > 1).any() else 0


def max_splits(rows: int, heads: int, head_dim: int) -> int:
    """The most splits a launch of `rows` query rows allows a tile (`VLMCTL_PROMPT_SPLITS` caps it; 1: none): its
    partials within SPLIT_WORKSPACE_BYTES."""
    from .settings import env_int

    cap = env_int("VLMCTL_PROMPT_SPLITS", DEFAULT_SPLITS, minimum=1)
    return max(1, min(cap, SPLIT_WORKSPACE_BYTES // max(1, rows * heads * head_dim * 4)))


def split_workspace(rows: int, heads: int, head_dim: int, splits: int, device) -> tuple:
    """(partials [rows * heads * splits, head_dim], (max, sum) [rows * heads * splits, 2]), float32, for a launch of
    `rows` query rows allowing `splits` a tile; pass it to `prompt_attention` to reuse it."""
    n = rows * heads * splits
    return (torch.empty((n, head_dim), dtype=torch.float32, device=device),
            torch.empty((n, 2), dtype=torch.float32, device=device))


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     tiles_t: torch.Tensor, scale: float, window: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, splits: int = 1, workspace: tuple | None = None,
                     split_rows: int | None = None) -> torch.Tensor:
    """Causal attention of query rows q [T, Hq, d] (any row stride, unit stride in d) over their sequences' cached
    positions in the paged pools [blocks, bs, Hkv, d] (8-bit with `k_scale`/`v_scale` [blocks, bs, Hkv]), every
    row's own K and V already appended. `tiles_t` (int32 [tiles, TILE_FIELDS], `tile_table`) says which rows are
    whose and where they sit, and among how many programs each tile's context is divided (at most `splits`, the
    `max_splits` the table was made with; `workspace`: a `split_workspace` for them, else one is allocated;
    `split_rows`: how many of the table's first rows may hold more than one split, default all of them, for whose
    further splits alone programs are launched: `split_rows_of` a host table); `block_tables` int32 [sequences, max
    blocks]. With `window`, a row sees only keys less than `window` positions back. Rows in no tile are left as
    they are. Returns out [T, Hq, d] in q's dtype (any row stride), allocated where not given."""
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
    split = splits > 1
    n_tiles = tiles_t.shape[0]
    split_rows = n_tiles if split_rows is None else min(split_rows, n_tiles)
    if split and workspace is None:  # float32 even where nothing splits: the variant compiled at load takes it
        workspace = split_workspace(T if split_rows else 1, Hq, d, splits, q.device)
    part, ml = workspace if split else (out, out)
    win = NO_WINDOW if window is None else window
    # split 0 of every tile, then the further splits of the first split_rows tiles: a large step, which never
    # splits, launches no program for splits it cannot have
    programs = n_tiles + (split_rows * (splits - 1) if split else 0)
    grid = (Hq, programs) if split else (programs, Hq)  # the launch orders of `_prompt_kernel`'s comment
    run_triton(_prompt_kernel, grid, q, k_cache, v_cache, ks, vs, block_tables, tiles_t, out, part, ml, q.stride(0),
               q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
               out.stride(0), out.stride(1), win, scale * 1.4426950408889634, Hq // Hkv, Hkv,
               n_tiles, splits, block_size=bs, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_M=block_m,
               BLOCK_N=block_n, IEEE=q.dtype == torch.float32, QUANT=k_scale is not None,
               ASM=_widen_in_registers(k_cache, q.dtype), SPLIT=split, num_warps=4, num_stages=2)
    if split and split_rows:
        run_triton(_combine_kernel, (Hq, split_rows), tiles_t, part, ml, out, out.stride(0), out.stride(1), win,
                   splits, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_M=block_m, BLOCK_N=block_n,
                   num_warps=4)
    return out


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    length: int, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """`prompt_attention` of one chunk q [n, Hq, d] of one sequence (block table [blocks]) whose rows sit at
    positions length - n .. length - 1."""
    n, heads, d = q.shape
    splits = max_splits(n, heads, d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
    table = tile_table([(0, 0, n, length - n)], tiles(d)[0], max_splits=splits, heads=heads, sms=sms)
    return prompt_attention(q, k_cache, v_cache, block_table.to(torch.int32).view(1, -1),
                            torch.from_numpy(table).to(q.device), scale, window, k_scale, v_scale, out, splits,
                            split_rows=split_rows_of(table))
