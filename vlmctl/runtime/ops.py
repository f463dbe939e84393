"""The decoder step's operations, each with a plain-torch reference and a dispatch to the Triton
kernel in `vlmctl.runtime.kernels` when the tensors live on a CUDA device.

The torch references are the CPU path (CI, `make demo`) and the oracle the kernel tests compare
against. They follow transformers' modules operation by operation (including where values are
rounded to the model dtype), so the CPU runtime stays token-exact against the reference model.

Variants of the decoder spec and where they run on CUDA:
  norm "rms_one_plus" (Gemma's (1 + w), float32 throughout)   add+RMSNorm kernel (ONE_PLUS)
  q/k norm per head                                           its own in-place kernel, before rotary
  activation "gelu_tanh"                                      the act·mul kernel (ACT)
  sliding window in decode                                    both decode kernels (a window start)
  prompt rows read from the paged pool (all rows of a captured    the paged prompt kernel (captured steps:
    step; continuations of an eager one where asked)             VLMCTL_STEP_GRAPH_ROWS; eager: VLMCTL_CHUNK_ATTENTION_ROWS)
  sliding window / bidirectional image rows in prefill        torch SDPA with an explicit mask
  cross-attention, decode rows                                the paged decode kernel over the cross pool
  cross-attention, prompt chunks                              torch SDPA with a per-row key-range mask
Set `VLMCTL_KERNELS=torch` to force the references on a GPU (debugging, A/B measurements).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from . import kv_quant


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    if os.environ.get("VLMCTL_KERNELS", "").lower() == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


# ---- RMSNorm (with the residual add fused in) ----------------------------------------------------
def rms_norm_reference(x, weight, eps, residual=None, one_plus=False):
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:  # Gemma: (1 + w) in float32, one rounding at the end
        return (x32 * (1.0 + weight.float())).to(dtype)
    return weight * x32.to(dtype)  # Llama: the normalized row is rounded before the weight multiplies it


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             one_plus: bool = False) -> torch.Tensor:
    """RMSNorm(x) over the last axis of [T, H]; with `residual`: `residual += x` in place, then RMSNorm(residual).
    `one_plus`: the gain is (1 + weight) and the product is taken in float32 (Gemma's norm)."""
    if _use_kernels(x) and x.dim() == 2:
        from .kernels.fused import add_rms_norm

        return add_rms_norm(x, weight, eps, residual, one_plus=one_plus)
    return rms_norm_reference(x, weight, eps, residual, one_plus)


# ---- per-head q/k norm (before rotary) -------------------------------------------------------------
def qk_norm_reference(qkv, q_weight, k_weight, n_q, n_kv, head_dim, eps, one_plus=False):
    T = qkv.shape[0]
    q = qkv[:, :n_q * head_dim].view(T, n_q, head_dim)
    k = qkv[:, n_q * head_dim:(n_q + n_kv) * head_dim].view(T, n_kv, head_dim)
    q.copy_(rms_norm_reference(q, q_weight, eps, None, one_plus))
    k.copy_(rms_norm_reference(k, k_weight, eps, None, one_plus))


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q: int, n_kv: int, head_dim: int,
            eps: float, one_plus: bool = False) -> None:
    """In place on qkv [T, (n_q + 2 n_kv) * d]: RMSNorm over each q head (q_weight [d]) and k head (k_weight)."""
    if _use_kernels(qkv):
        from .kernels.fused import qk_norm as kernel

        return kernel(qkv, q_weight, k_weight, n_q, n_kv, head_dim, eps, one_plus)
    return qk_norm_reference(qkv, q_weight, k_weight, n_q, n_kv, head_dim, eps, one_plus)


# ---- rotary embedding + paged KV-cache append ----------------------------------------------------
def rope_and_cache_reference(qkv, cos_sin, positions, n_q, n_kv, head_dim, k_cache=None, v_cache=None,
                             slot_mapping=None, k_scale=None, v_scale=None):
    T = qkv.shape[0]
    half = head_dim // 2
    dtype = qkv.dtype
    rot = qkv[:, : (n_q + n_kv) * head_dim].view(T, n_q + n_kv, head_dim)
    cs = cos_sin.index_select(0, positions).to(dtype)  # [T, d]: cos | sin, as transformers casts them
    cos = torch.cat((cs[:, :half], cs[:, :half]), -1)[:, None]
    sin = torch.cat((cs[:, half:], cs[:, half:]), -1)[:, None]
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = rot * cos + torch.cat((-x2, x1), -1) * sin
    rot.copy_(rotated)
    if k_cache is not None:
        k = rot[:, n_q:]
        v = qkv[:, (n_q + n_kv) * head_dim:].view(T, n_kv, head_dim)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()  # a captured step's buffers are int32
        if k_scale is not None:  # an 8-bit pool (kv_quant); qkv keeps the rows as stored
            k[keep] = kv_quant.write_rows(k_cache, k_scale, slots, k[keep])
            v[keep] = kv_quant.write_rows(v_cache, v_scale, slots, v[keep])
            return
        k_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, k[keep])
        v_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, v[keep])


def rope_and_cache(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, n_q: int, n_kv: int,
                   head_dim: int, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                   slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """In place on qkv [T, (n_q + 2 n_kv) * d]: rotary on q and k at `positions` (rows of the float32
    cos|sin table [P, d]); then k and v appended to the paged caches at `slot_mapping`. With `k_scale` and
    `v_scale` ([blocks, bs, n_kv] float32) the caches are 8-bit (`kv_quant`): each row is quantized as written,
    and the written k and v rows of qkv become what the pool holds (dequantized), which a fresh prompt's
    attention then reads from qkv instead of gathering them back."""
    if _use_kernels(qkv):
        from .kernels.fused import rope_and_cache as kernel

        return kernel(qkv, cos_sin, positions, n_q, n_kv, head_dim, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return rope_and_cache_reference(qkv, cos_sin, positions, n_q, n_kv, head_dim, k_cache, v_cache, slot_mapping,
                                    k_scale, v_scale)


# ---- act(gate) * up -------------------------------------------------------------------------------
def silu_mul_reference(gate_up):
    g, u = gate_up.chunk(2, -1)
    return F.silu(g) * u


def gelu_tanh_mul_reference(gate_up):
    g, u = gate_up.chunk(2, -1)
    return F.gelu(g, approximate="tanh") * u


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return act_mul(gate_up, "silu")


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up; `activation`: "silu" | "gelu_tanh"."""
    if _use_kernels(gate_up) and gate_up.dim() == 2:
        from .kernels.fused import act_mul as kernel

        return kernel(gate_up, activation)
    if activation == "silu":
        return silu_mul_reference(gate_up)
    if activation == "gelu_tanh":
        return gelu_tanh_mul_reference(gate_up)
    raise ValueError(f"unknown activation {activation!r}")


# ---- attention over the paged cache --------------------------------------------------------------
def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `length` positions of one sequence from a paged cache [blocks, bs, H, d] -> [length, H, d];
    from an 8-bit cache with its `scales` [blocks, bs, H], dequantized to `dtype`."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    rows = cache.index_select(0, block_table[:nb]).flatten(0, 1)[:length]
    if scales is None:
        return rows
    return kv_quant.dequantize(rows, scales.index_select(0, block_table[:nb]).flatten(0, 1)[:length], dtype)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, length: int,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_context` of K and of V; from 8-bit pools on CUDA, both in one kernel."""
    if k_scale is not None and _use_kernels(k_cache):
        from .kernels.kv_rows import gather_dequantized

        return gather_dequantized(k_cache, v_cache, k_scale, v_scale, block_table, length, dtype)
    return (gather_context(k_cache, block_table, length, k_scale, dtype),
            gather_context(v_cache, block_table, length, v_scale, dtype))


# Off until the kernel has passed its tests and an A/B on a GPU (docs/benchmarks.md, sessions 44-45).
CHUNK_ATTENTION_ROWS = 0


def chunk_attention_rows() -> int:
    """The longest continuation chunk an eager forward sends to the paged prompt kernel
    (`VLMCTL_CHUNK_ATTENTION_ROWS`, default `CHUNK_ATTENTION_ROWS`; 0: none); longer chunks gather their context and
    run SDPA. A captured step (`TorchDecoder`'s step graphs) sends all its rows to the kernel."""
    from .kernels.settings import env_int

    return env_int("VLMCTL_CHUNK_ATTENTION_ROWS", CHUNK_ATTENTION_ROWS)


def prompt_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, tiles: torch.Tensor, scale: float,
                               window: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.paged_prefill.prompt_attention` in torch: per tile of the table (sequence, first row, rows, first
    position), its sequence's context gathered and `prefill_attention` over it."""
    if out is None:
        out = torch.empty_like(q)
    for seq, row0, m, pos0, _ in tiles.tolist():  # the splits field is how the kernel divides work
        if m:
            k, v = gather_kv(k_cache, v_cache, block_tables[seq].long(), pos0 + m, k_scale, v_scale, q.dtype)
            out[row0:row0 + m] = prefill_attention(q[row0:row0 + m], k, v, scale, window)
    return out


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     tiles: torch.Tensor, scale: float, window: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, splits: int = 1, workspace: tuple | None = None,
                     split_rows: int | None = None) -> torch.Tensor:
    """Causal attention of the query rows q [T, Hq, d] of several sequences over their paged contexts, each row's own
    K and V already in the pool; `tiles` (int32 [n, 5], `kernels.paged_prefill.tile_table`) says which rows belong
    to which sequence (a row of `block_tables` [S, max blocks]) at which positions. Rows in no tile are left as they
    are. On CUDA one Triton kernel reads the pool in place (`kernels.paged_prefill`; `splits`, `workspace`,
    `split_rows`: its split contexts); elsewhere the reference."""
    if _use_kernels(q):
        from .kernels.paged_prefill import prompt_attention as kernel

        return kernel(q, k_cache, v_cache, block_tables, tiles, scale, window, k_scale, v_scale, out, splits,
                      workspace, split_rows)
    return prompt_attention_reference(q, k_cache, v_cache, block_tables, tiles, scale, window, k_scale, v_scale, out)


def paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, k_scale=None,
                           v_scale=None):
    """q [B, Hq, d]; attends each row over its first context_lens[b] cached positions (with `window`,
    only the last `window` of them) -> [B, Hq, d]. With `k_scale`/`v_scale` the caches are 8-bit, dequantized
    to q's dtype."""
    B, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    L = int(context_lens.max())
    bs = k_cache.shape[1]
    nb = -(-L // bs)
    bt = block_tables[:, :nb].long()
    k = k_cache[bt].flatten(1, 2)[:, :L]  # [B, L, Hkv, d]
    v = v_cache[bt].flatten(1, 2)[:, :L]
    if k_scale is not None:
        k = kv_quant.dequantize(k, k_scale[bt].flatten(1, 2)[:, :L], q.dtype)
        v = kv_quant.dequantize(v, v_scale[bt].flatten(1, 2)[:, :L], q.dtype)
    idx = torch.arange(L, device=q.device)[None]
    lens = context_lens[:, None].to(q.device)
    mask = idx < lens
    if window is not None:
        mask &= idx >= lens - window
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=Hkv != Hq)
    return out[:, :, 0]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int = 1, out: torch.Tensor | None = None,
                 workspace=None, window: int | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over the paged cache, read in place on CUDA; `window`: attend only
    the last `window` positions (the token itself included); `k_scale`/`v_scale`: an 8-bit cache's scales."""
    if _use_kernels(q) and q.dtype != torch.float32 and q.shape[-1] >= 16:
        from .kernels.paged_attention import paged_decode as kernel

        return kernel(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out, workspace, window,
                      k_scale, v_scale)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, window, k_scale, v_scale)


def paged_decode_rope(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, n_q: int, n_kv: int, head_dim: int,
                      num_splits: int = 1, workspace=None, window: int | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows of qkv [B, (n_q + 2 n_kv) * d] straight from the QKV projection (after any q/k norm):
    rotary of the new token, its K/V appended at `slots`, attention over the cache (the last `window`
    positions with a window) -> [B, n_q, d]. On CUDA one kernel does all three; elsewhere (and for
    head sizes it does not take) the separate operations run."""
    if _use_kernels(qkv):
        from .kernels.paged_attention import fused_rope_supported, paged_decode_rope as kernel

        if fused_rope_supported(head_dim, qkv.dtype):
            return kernel(qkv, cos_sin, positions, slots, k_cache, v_cache, block_tables, context_lens, scale, n_q,
                          n_kv, num_splits, workspace, window, k_scale, v_scale)
    rope_and_cache(qkv, cos_sin, positions, n_q, n_kv, head_dim, k_cache, v_cache, slots, k_scale, v_scale)
    q = qkv[:, :n_q * head_dim].view(qkv.shape[0], n_q, head_dim)
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, None, workspace, window,
                        k_scale, v_scale)


def attention_backends(device: torch.device):
    """The SDPA backends for a forward's prompt and cross attention: on CUDA, flash, then memory-
    efficient, then math, leaving out cuDNN's. cuDNN's SDPA builds an execution plan for each new
    (query length, key length) pair, ~1 ms of host time apiece, and a serving engine meets new lengths
    in nearly every prefill: on an H200, a ~2,000-token prefill forward spent 90-760 ms of host time in
    `aten::_cudnn_attention_forward` the first time its lengths were seen and 3 ms after, for the same
    ~48 ms of GPU kernels (benchmarks/serving_gpu.py --kernel-profile; docs/benchmarks.md). Set
    process-wide for the duration of the `with` (torch keeps these flags globally), then restored."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def prefill_mask(n: int, L: int, window: int | None = None, blocks: torch.Tensor | None = None,
                 device=None) -> torch.Tensor:
    """bool [n, L]: which context positions query i (at position L - n + i) sees. Causal, or also the
    later rows of its own block (`blocks` [n]: block id per query row, -1 for none: the rows of one
    image see each other); then, with a window, only keys less than `window` positions back
    (transformers' AND(sliding window, OR(causal, block)))."""
    qpos = torch.arange(L - n, L, device=device)[:, None]
    kpos = torch.arange(L, device=device)[None]
    mask = kpos <= qpos
    if blocks is not None:
        kb = torch.full((L,), -1, dtype=blocks.dtype, device=device)
        kb[L - n:] = blocks
        mask |= (blocks[:, None] == kb[None]) & (blocks[:, None] >= 0)
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                      blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a query chunk [n, Hq, d] over its context [L, Hkv, d] (L >= n): query i sits
    at context position L - n + i (earlier positions come from the cache). Returns [n, Hq, d].
    `window`: a sliding-window layer's span; `blocks`: per query row, the id of the image whose rows
    see each other (-1 for other rows) - see `prefill_mask`."""
    n, Hq, _ = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    if window is not None and L - n - window + 1 > 0:
        first = L - n - window + 1  # no query of the chunk sees a key before this one
        k, v, L = k[first:], v[first:], L - first
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = Hkv != Hq
    if gqa and q.is_cuda:
        # the fused CUDA kernels take equal head counts; expand the (prefill-only) K/V
        kt = kt.repeat_interleave(Hq // Hkv, 1)
        vt = vt.repeat_interleave(Hq // Hkv, 1)
        gqa = False
    if window is not None or blocks is not None:
        mask = prefill_mask(n, L, window, blocks, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    elif L == n:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(n, L), scale=scale)
    else:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Cross-attention of query rows [n, Hq, d] over image K/V [L, Hkv, d]: row i attends keys
    [lo[i], hi[i]) (no causality, no rotary). Returns [n, Hq, d]."""
    n, Hq, _ = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    j = torch.arange(L, device=q.device)[None]
    mask = (j >= lo[:, None]) & (j < hi[:, None])
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = Hkv != Hq
    if gqa and q.is_cuda:  # as in prefill_attention: the fused CUDA kernels take equal head counts
        kt = kt.repeat_interleave(Hq // Hkv, 1)
        vt = vt.repeat_interleave(Hq // Hkv, 1)
        gqa = False
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
