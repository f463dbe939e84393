"""Fused small ops of the decoder step (Triton): residual add + RMSNorm (Llama's w or Gemma's 1 + w),
the per-head q/k norm, rotary + KV-cache append, act·mul (SiLU or GELU-tanh). Each replaces several
eager kernels; `vlmctl.runtime.ops` holds the torch references (the CPU path) and the tests compare
the two under `TRITON_INTERPRET=1`.

Rounding follows transformers' modules where it matters for closeness: the residual sum is
rounded to the model dtype before the norm; Llama's normalized row is rounded before the weight
multiplies it, Gemma's (1 + w) product is rounded once; rotary products are rounded per term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_rows, pdl
from .compile_ahead import run as run_triton


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_r, stride_o, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ONE_PLUS: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    pdl.release(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: read before the wait (`pdl`)
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    if ONE_PLUS:
        y = (xf * tl.math.rsqrt(var + eps) * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
        y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, one_plus: bool = False) -> torch.Tensor:
    """RMSNorm of rows of x [T, H]; with `residual`, first `residual += x` (in place) and normalize that.
    `one_plus`: gain (1 + weight), the product in float32 (Gemma)."""
    T, H = x.shape
    out = torch.empty_like(x) if out is None else out
    BLOCK = triton.next_power_of_2(H)
    run_triton(_add_rms_norm_kernel, (T,), x, residual if residual is not None else x, weight, out, H, x.stride(0),
               residual.stride(0) if residual is not None else 0, out.stride(0), eps,
               HAS_RES=residual is not None, BLOCK=BLOCK, ONE_PLUS=one_plus,
               num_warps=8 if BLOCK >= 4096 else 4, **pdl.launch_kwargs(x.device))
    return out


@triton.jit
def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, stride_t, n_q_heads, eps, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    ONE_PLUS: tl.constexpr, PDL: tl.constexpr = False):
    pdl.release(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads
    d = tl.arange(0, D_PAD)
    mask = d < HEAD_DIM
    base = qkv_ptr + t * stride_t + h * HEAD_DIM
    x = tl.load(base + d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HEAD_DIM
    is_q = h < n_q_heads
    w = tl.where(is_q, tl.load(qw_ptr + d, mask=mask, other=0.0), tl.load(kw_ptr + d, mask=mask, other=0.0))
    if ONE_PLUS:
        y = (xf * tl.math.rsqrt(var + eps) * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
        y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(base + d, y, mask=mask)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q_heads: int, n_kv_heads: int,
            head_dim: int, eps: float, one_plus: bool = False) -> None:
    """In place: RMSNorm over each q head (weight q_weight [d]) and k head (k_weight) of qkv [T, (nq + 2 nkv) * d]."""
    T = qkv.shape[0]
    if T == 0:
        return
    run_triton(_qk_norm_kernel, (T, n_q_heads + n_kv_heads), qkv, q_weight, k_weight, qkv.stride(0), n_q_heads, eps,
               HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), ONE_PLUS=one_plus,
               num_warps=1 if head_dim <= 128 else 2, **pdl.launch_kwargs(qkv.device))


# positions and slots are often views that start past a step's decode rows: unspecialized, an odd number of
# decode rows (an int64 view 8 bytes off a 16-byte boundary) compiles no second variant mid-serving
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _rope_cache_kernel(qkv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                       stride_t, stride_cs, stride_cb, stride_cs_slot, stride_ch, n_q_heads, n_kv_heads, block_size,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, WRITE_CACHE: tl.constexpr,
                       PDL: tl.constexpr = False, QUANT: tl.constexpr = False):
    """QUANT: 8-bit caches (float8 e4m3 or int8, `kv_rows`), each row written with its scale at
    slot * n_kv_heads + head, and qkv's k and v rows of a written slot replaced by what the pool now holds
    (dequantized to qkv's dtype), so that a prompt's attention can read them there instead of from the pool."""
    pdl.release(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..n_q+n_kv-1 rotate (q heads then k heads); n_q+n_kv.. copy v
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, HALF)
    base = qkv_ptr + t * stride_t + h * HEAD_DIM
    n_rot = n_q_heads + n_kv_heads
    slot = tl.load(slot_ptr + t) if WRITE_CACHE else 0
    blk = slot // block_size
    off = slot % block_size
    if h < n_rot:
        x1 = tl.load(base + offs)
        x2 = tl.load(base + HALF + offs)
        c = tl.load(cos_sin_ptr + pos * stride_cs + offs).to(x1.dtype).to(tl.float32)
        s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs).to(x1.dtype).to(tl.float32)
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        o1 = ((a1 * c).to(x1.dtype).to(tl.float32) - (a2 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        o2 = ((a2 * c).to(x1.dtype).to(tl.float32) + (a1 * s).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        tl.store(base + offs, o1)
        tl.store(base + HALF + offs, o2)
        if WRITE_CACHE:
            if h >= n_q_heads:
                if slot >= 0:
                    kh = h - n_q_heads
                    dst = k_cache_ptr + blk * stride_cb + off * stride_cs_slot + kh * stride_ch
                    if QUANT:
                        sc = kv_rows.row_scale(tl.maximum(tl.max(tl.abs(o1.to(tl.float32)), 0),
                                                          tl.max(tl.abs(o2.to(tl.float32)), 0)),
                                               k_cache_ptr.dtype.element_ty)
                        e1 = kv_rows.quantize(o1, sc, k_cache_ptr.dtype.element_ty)
                        e2 = kv_rows.quantize(o2, sc, k_cache_ptr.dtype.element_ty)
                        tl.store(k_scale_ptr + slot * n_kv_heads + kh, sc)
                        tl.store(dst + offs, e1)
                        tl.store(dst + HALF + offs, e2)
                        tl.store(base + offs, (e1.to(tl.float32) * sc).to(x1.dtype))
                        tl.store(base + HALF + offs, (e2.to(tl.float32) * sc).to(x1.dtype))
                    else:
                        tl.store(dst + offs, o1)
                        tl.store(dst + HALF + offs, o2)
    else:
        if WRITE_CACHE:
            if slot >= 0:
                vh = h - n_rot
                d = tl.arange(0, HEAD_DIM)
                v = tl.load(base + d)
                dst = v_cache_ptr + blk * stride_cb + off * stride_cs_slot + vh * stride_ch
                if QUANT:
                    sc = kv_rows.row_scale(tl.max(tl.abs(v.to(tl.float32)), 0), v_cache_ptr.dtype.element_ty)
                    ev = kv_rows.quantize(v, sc, v_cache_ptr.dtype.element_ty)
                    tl.store(v_scale_ptr + slot * n_kv_heads + vh, sc)
                    tl.store(dst + d, ev)
                    tl.store(base + d, (ev.to(tl.float32) * sc).to(v.dtype))
                else:
                    tl.store(dst + d, v)


def rope_and_cache(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, n_q_heads: int,
                   n_kv_heads: int, head_dim: int, k_cache: torch.Tensor | None = None,
                   v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """In place: rotary on the q and k heads of qkv [T, (nq + 2 nkv) * d] at `positions` (rows of the
    cos|sin table [P, d]); then k (rotated) and v written to the paged caches [blocks, block_size,
    nkv, d] at `slot_mapping` [T] (block * block_size + offset; negative: not written). With `k_scale` and
    `v_scale` ([blocks, block_size, nkv] float32, contiguous) the caches are 8-bit (`vlmctl.runtime.kv_quant`),
    and the k and v rows written are left in qkv as the pool holds them (dequantized)."""
    T = qkv.shape[0]
    write = k_cache is not None
    heads = n_q_heads + 2 * n_kv_heads if write else n_q_heads + n_kv_heads
    if T == 0:
        return
    kc = k_cache if write else qkv
    quant = write and k_scale is not None
    run_triton(
        _rope_cache_kernel, (T, heads),
        qkv, cos_sin, positions, slot_mapping if write else positions, kc, v_cache if write else qkv,
        k_scale if quant else qkv, v_scale if quant else qkv, qkv.stride(0), cos_sin.stride(0),
        kc.stride(0) if write else 0, kc.stride(1) if write else 0, kc.stride(2) if write else 0,
        n_q_heads, n_kv_heads, kc.shape[1] if write else 1,
        HEAD_DIM=head_dim, HALF=head_dim // 2, WRITE_CACHE=write, QUANT=quant, num_warps=1,
        **pdl.launch_kwargs(qkv.device))


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def act_f32(gf, ACT: tl.constexpr):
    """The activation of float32 gf (ACT: `ACTIVATIONS`), in float32; callers round it to the model dtype
    before multiplying by up, as torch's act(gate) * up does."""
    if ACT == 0:  # SiLU
        return gf / (1.0 + tl.exp(-gf))
    # GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh through exp
    inner = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
    inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)  # tanh is +-1 in float32 beyond; exp stays finite
    th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    return 0.5 * gf * (1.0 + th)


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr, ACT: tl.constexpr = 0,
                    PDL: tl.constexpr = False):
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    act = act_f32(g.to(tl.float32), ACT).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up, [T, I]; `activation` "silu" or "gelu_tanh"."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    run_triton(_act_mul_kernel, (T, triton.cdiv(inter, BLOCK)), gate_up, out, inter, gate_up.stride(0), out.stride(0),
               BLOCK=BLOCK, ACT=ACTIVATIONS[activation], num_warps=4, **pdl.launch_kwargs(gate_up.device))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    return act_mul(gate_up, "silu")
