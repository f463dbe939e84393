"""The runtime's Triton kernels against their torch references (vlmctl.runtime.ops).

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on
small shapes; on a CUDA host the same comparisons run on the device. Inputs are fresh random
data each time; outputs are poisoned before the call so unwritten elements show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmctl.runtime import ops

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import triton.language as tl  # noqa: E402

from vlmctl.runtime.kernels import kv_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("one_plus", [False, True])
def test_add_rms_norm(dtype, with_residual, one_plus):
    from vlmctl.runtime.kernels.fused import add_rms_norm

    g = torch.Generator().manual_seed(1)
    T, H = 5, 96  # H not a power of two: masked columns
    x = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    res = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    want = ops.rms_norm_reference(x.clone(), w, 1e-6, res_ref, one_plus)
    out = torch.full_like(x, float("nan"))
    got = add_rms_norm(x, w, 1e-6, res, out=out, one_plus=one_plus)
    assert not got.isnan().any()
    assert rel_err(got, want) < tol(dtype)
    if with_residual:
        assert torch.equal(res, res_ref)  # the residual sum is rounded to the dtype in both


def test_one_plus_norm_is_gemmas():
    """The (1 + w) reference is transformers' Gemma3RMSNorm, bit for bit, in fp32 and fp16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float16):
        norm = Gemma3RMSNorm(48, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48, generator=g))
        norm = norm.to(dtype)
        x = (torch.randn(6, 48, generator=g) * 4).to(dtype)
        assert torch.equal(ops.rms_norm_reference(x, norm.weight, 1e-6, None, True), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize("d", [16, 24])
def test_qk_norm(dtype, one_plus, d):
    from vlmctl.runtime.kernels.fused import qk_norm

    g = torch.Generator().manual_seed(12)
    T, n_q, n_kv = 5, 4, 2
    qkv = (torch.randn(T, (n_q + 2 * n_kv) * d, generator=g) * 3).to(DEV, dtype)
    qw = torch.randn(d, generator=g).to(DEV, dtype)
    kw = torch.randn(d, generator=g).to(DEV, dtype)
    ref = qkv.clone()
    ops.qk_norm_reference(ref, qw, kw, n_q, n_kv, d, 1e-6, one_plus)
    qk_norm(qkv, qw, kw, n_q, n_kv, d, 1e-6, one_plus)
    assert rel_err(qkv[:, :(n_q + n_kv) * d], ref[:, :(n_q + n_kv) * d]) < tol(dtype)
    assert torch.equal(qkv[:, (n_q + n_kv) * d:], ref[:, (n_q + n_kv) * d:])  # v untouched
    # the reference, written out: each head on its own, q's weight on q heads and k's on k heads
    x = (torch.randn(3, (n_q + 2 * n_kv) * d, generator=g) * 2).double()
    got = x.clone()
    ops.qk_norm_reference(got, qw.double().cpu(), kw.double().cpu(), n_q, n_kv, d, 1e-6, one_plus)
    for h in range(n_q + n_kv):
        w = (qw if h < n_q else kw).double().cpu()
        xh = x[:, h * d:(h + 1) * d]
        want = xh / xh.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * ((1 + w) if one_plus else w)
        assert torch.allclose(got[:, h * d:(h + 1) * d], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (4, 2), (6, 1)])
def test_rope_and_cache(dtype, n_q, n_kv):
    from vlmctl.runtime.kernels.fused import rope_and_cache

    g = torch.Generator().manual_seed(2)
    T, d, bs, nblocks = 7, 32, 4, 6
    qkv = torch.randn(T, (n_q + 2 * n_kv) * d, generator=g).to(DEV, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    P = 40
    f = torch.arange(P).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(DEV)
    pos = torch.randint(0, P, (T,), generator=g).to(DEV)
    slots = torch.randperm(nblocks * bs, generator=g)[:T].to(DEV)
    slots[3] = -1  # a row whose K/V is not written
    kc = torch.full((nblocks, bs, n_kv, d), 7.0, dtype=dtype, device=DEV)
    vc = torch.full_like(kc, 7.0)
    kc_ref, vc_ref, qkv_ref = kc.clone(), vc.clone(), qkv.clone()
    ops.rope_and_cache_reference(qkv_ref, cos_sin, pos, n_q, n_kv, d, kc_ref, vc_ref, slots)
    rope_and_cache(qkv, cos_sin, pos, n_q, n_kv, d, kc, vc, slots)
    assert rel_err(qkv, qkv_ref) < tol(dtype)
    assert rel_err(kc, kc_ref) < tol(dtype) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    from vlmctl.runtime.kernels.fused import silu_mul

    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(3, 2 * 1100, generator=g) * 4).to(DEV, dtype)  # 1100: a partial last tile
    assert rel_err(silu_mul(gu), ops.silu_mul_reference(gu)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype):
    """GELU-tanh·up against torch's own tanh-approximated GELU (transformers' gelu_pytorch_tanh)."""
    from transformers.activations import ACT2FN

    from vlmctl.runtime.kernels.fused import act_mul

    g = torch.Generator().manual_seed(13)
    gu = (torch.randn(3, 2 * 1100, generator=g) * 4).to(DEV, dtype)
    gu[0, :8] = torch.tensor([-30.0, -6.0, -1e-3, 0.0, 1e-4, 3.0, 9.0, 30.0])  # tails and the origin
    gate, up = gu.chunk(2, -1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(ops.act_mul(gu.cpu(), "gelu_tanh"), want.cpu()) if DEV == "cpu" else True
    assert rel_err(act_mul(gu, "gelu_tanh"), want) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q,n_kv,d", [(4, 4, 16), (8, 2, 32), (7, 1, 24)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_paged_decode(dtype, n_q, n_kv, d, splits, window):
    from vlmctl.runtime.kernels.paged_attention import paged_decode

    g = torch.Generator().manual_seed(4)
    B, bs, nblocks, maxb = 3, 8, 24, 6
    lens = torch.tensor([1, 19, 45], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:maxb] for _ in range(B)]).to(torch.int32)
    kc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    # q rows strided as views of a fused qkv tensor are
    q = torch.randn(B, n_q + 2 * n_kv, d, generator=g).to(DEV, dtype)[:, :n_q]
    scale = d ** -0.5
    want = ops.paged_decode_reference(q.float(), kc.float(), vc.float(), tables.to(DEV), lens.to(DEV), scale,
                                      window)
    out = torch.full((B, n_q, d), float("nan"), dtype=dtype, device=DEV)
    got = paged_decode(q, kc, vc, tables.to(DEV), lens.to(DEV), scale, num_splits=splits, out=out, window=window)
    assert not got.isnan().any()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)
    if window is not None:  # the window matters: the full-context answer differs
        full = ops.paged_decode_reference(q.float(), kc.float(), vc.float(), tables.to(DEV), lens.to(DEV), scale)
        assert rel_err(full, want) > 0.05


def test_paged_decode_window_reference_is_explicit():
    """The reference's window keeps exactly the last `window` positions (the token itself included)."""
    g = torch.Generator().manual_seed(14)
    bs, d = 4, 8
    kc = torch.randn(6, bs, 1, d, generator=g, dtype=torch.float64)
    vc = torch.randn(6, bs, 1, d, generator=g, dtype=torch.float64)
    table = torch.tensor([[3, 1, 5, 2]], dtype=torch.int32)
    q = torch.randn(1, 2, d, generator=g, dtype=torch.float64)
    ctx, w = 13, 6
    k = kc[table[0].long()].flatten(0, 1)[:ctx, 0]
    v = vc[table[0].long()].flatten(0, 1)[:ctx, 0]
    kk, vv = k[ctx - w:], v[ctx - w:]
    want = torch.softmax(q[0] @ kk.T * 0.3, -1) @ vv
    got = ops.paged_decode_reference(q, kc, vc, table, torch.tensor([ctx]), 0.3, w)
    assert torch.allclose(got[0], want)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("splits", [1, 2, 4])  # 2: a split of two tiles (the first one loaded early)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("early", [False, True])
def test_paged_decode_with_rope_and_append(dtype, n_q, n_kv, splits, window, early, monkeypatch):
    """The fused decode kernel == rotary + KV append + attention as separate reference operations. early: each
    program's first tile loaded before the PDL wait and attended to apart from the loop (VLMCTL_ATTN_EARLY_TILE;
    programs past a short context have no tile)."""
    from vlmctl.runtime.kernels import paged_attention
    from vlmctl.runtime.kernels.paged_attention import paged_decode_rope, split_workspace

    monkeypatch.setattr(paged_attention, "early_tile", lambda device: early)

    g = torch.Generator().manual_seed(5)
    B, bs, maxb, d = 4, 8, 26, 32
    nblocks = B * maxb + 1
    lens = torch.tensor([1, 20, 45, 200], dtype=torch.int32)  # context incl. the new token; 200: several tiles
    # each sequence owns its blocks, as in the engine's pool: a block another sequence reads while this call
    # appends to it would race on a GPU (the reference appends every token before attending)
    tables = (torch.randperm(nblocks - 1, generator=g)[:B * maxb].view(B, maxb) + 1).to(torch.int32)
    slots = torch.tensor([int(tables[b, (int(lens[b]) - 1) // bs]) * bs + (int(lens[b]) - 1) % bs for b in range(B)])
    kc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    qkv = torch.randn(B, (n_q + 2 * n_kv) * d, generator=g).to(DEV, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(256).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(DEV)
    pos = (lens.long() - 1 + 3).to(DEV)  # rotary positions need not equal cache indices (M-RoPE deltas)
    kc_ref, vc_ref, qkv_ref = kc.clone(), vc.clone(), qkv.clone()
    ops.rope_and_cache_reference(qkv_ref, cos_sin, pos, n_q, n_kv, d, kc_ref, vc_ref, slots.to(DEV))
    want = ops.paged_decode_reference(qkv_ref[:, :n_q * d].view(B, n_q, d).float(), kc_ref.float(), vc_ref.float(),
                                      tables.to(DEV), lens.to(DEV), d ** -0.5, window)
    # split workspaces: with the combine folded into the kernel (arrival counters; reused, as a captured step
    # reuses it across layers, so the counters must be back at zero), and a (part, ml) pair, whose combine
    # runs as a kernel of its own
    ws = split_workspace(B, n_q, d, splits, DEV) if splits > 1 else None
    pair = ws[:2] if ws is not None else None
    kc0, vc0, kc1, vc1 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = paged_decode_rope(qkv, cos_sin, pos, slots.to(DEV), kc, vc, tables.to(DEV), lens.to(DEV), d ** -0.5, n_q,
                            n_kv, num_splits=splits, workspace=ws, window=window)
    assert rel_err(got, want) < 3e-3
    if ws is not None:
        assert torch.count_nonzero(ws[2]) == 0
        again = paged_decode_rope(qkv, cos_sin, pos, slots.to(DEV), kc0, vc0, tables.to(DEV), lens.to(DEV),
                                  d ** -0.5, n_q, n_kv, num_splits=splits, workspace=ws, window=window)
        assert torch.equal(again, got)
        separate = paged_decode_rope(qkv, cos_sin, pos, slots.to(DEV), kc1, vc1, tables.to(DEV), lens.to(DEV),
                                     d ** -0.5, n_q, n_kv, num_splits=splits, workspace=pair, window=window)
        assert torch.equal(separate, got)
    # V is copied, so it is exact; K's rotary on CUDA contracts into FMAs where torch rounds each
    # product, so the appended K may differ from the reference by one rounding step (exact under
    # the interpreter); nothing outside the appended slots may change
    assert torch.equal(vc, vc_ref)
    appended = torch.zeros(nblocks * bs, dtype=torch.bool)
    appended[slots] = True
    appended = appended.view(nblocks, bs).to(DEV)
    assert torch.equal(kc[~appended], kc_ref[~appended])
    # each rotated element is x cos - y sin: the products' roundings (≤ eps/2 · |x|, |y|) plus the result's
    k_in = qkv[:, n_q * d:(n_q + n_kv) * d].float().abs().max()
    tol = torch.finfo(dtype).eps * (kc_ref[appended].float().abs() + k_in)
    assert ((kc[appended].float() - kc_ref[appended].float()).abs() <= tol).all()


def _naive_prefill(q, k, v, scale, allowed):
    """Attention written out per query row over the allowed keys (float64)."""
    n, Hq, d = q.shape
    rep = Hq // k.shape[1]
    out = torch.empty(n, Hq, d, dtype=torch.float64)
    for i in range(n):
        keys = allowed(i)
        for h in range(Hq):
            kk, vv = k[keys, h // rep].double(), v[keys, h // rep].double()
            out[i, h] = torch.softmax(q[i, h].double() @ kk.T * scale, -1) @ vv
    return out


@pytest.mark.parametrize("start", [0, 9])
@pytest.mark.parametrize("window", [None, 4, 30])
@pytest.mark.parametrize("with_blocks", [False, True])
def test_prefill_attention_window_and_image_blocks(start, window, with_blocks):
    """prefill_attention's mask against the rule written out: query at position p sees key j when
    (j <= p or j is in p's image block) and (no window or j > p - window)."""
    g = torch.Generator().manual_seed(15)
    n, Hq, Hkv, d = 12, 4, 2, 8
    L = start + n
    q = torch.randn(n, Hq, d, generator=g)
    k = torch.randn(L, Hkv, d, generator=g)
    v = torch.randn(L, Hkv, d, generator=g)
    blocks = torch.tensor([-1, 0, 0, 0, 0, 0, -1, -1, 1, 1, 1, -1]) if with_blocks else None

    def allowed(i):
        p = start + i
        keys = []
        for j in range(L):
            ok = j <= p or (blocks is not None and j >= start and blocks[i] >= 0 and blocks[j - start] == blocks[i])
            if window is not None:
                ok = ok and j > p - window
            if ok:
                keys.append(j)
        return keys

    got = ops.prefill_attention(q, k, v, 0.4, window=window, blocks=blocks)
    want = _naive_prefill(q, k, v, 0.4, allowed)
    assert torch.allclose(got.double(), want, atol=1e-5)
    if (window is None or window >= L) and not with_blocks:
        return
    plain = ops.prefill_attention(q, k, v, 0.4)
    assert not torch.allclose(plain, got, atol=1e-3)  # the window / blocks change the answer


def test_decode_attention_split_rule():
    """The split counts measured best on an H200 (132 SMs; docs/benchmarks.md, session 21) for 32 KV heads:
    at most 4 programs per SM, rounded down; none from 2 programs per SM on; capped by the context's tiles
    and by 32."""
    from vlmctl.runtime.kernels.paged_attention import choose_splits

    assert [choose_splits(b, 32, 2560, 132) for b in (1, 2, 4, 8, 16, 64)] == [16, 8, 4, 2, 1, 1]
    assert choose_splits(1, 4, 2560, 132) == 32  # GQA with 4 KV heads: the cap
    assert choose_splits(1, 32, 100, 132) == 2  # a 100-token context has two 64-token tiles


# ---- the 8-bit KV cache (vlmctl.runtime.kv_quant): float8 e4m3 and int8 ------------------------------------
STORAGES = [torch.float8_e4m3fn, torch.int8]
def test_fp8_kv_rows_by_hand():
    """One row worked out by hand: scale = 4 / 448; 1, -2 and 4 land on e4m3 values; 0.3 / scale = 33.6 lies
    between the e4m3 neighbours 32 and 36 and rounds to 32. A row of zeros gets scale 1."""
    from vlmctl.runtime import kv_quant

    q, s = kv_quant.quantize(torch.tensor([[1.0, -2.0, 0.3, 4.0], [0.0, 0.0, 0.0, 0.0]]))
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float(), torch.tensor([[112.0, -224.0, 32.0, 448.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(s, torch.tensor([4.0 / 448.0, 1.0]))
    back = kv_quant.dequantize(q, s, torch.float32)
    assert torch.allclose(back[0], torch.tensor([1.0, -2.0, 32 * 4 / 448, 4.0]))
    # a large magnitude is kept, not clipped (a per-tensor scale of 1 would saturate at 448)
    big = torch.tensor([[900.0, -3000.0, 5.0, 0.5]])
    assert torch.allclose(kv_quant.dequantize(*kv_quant.quantize(big), torch.float32), big, rtol=2 ** -4,
                          atol=3000 * 2 ** -9)


def test_int8_kv_rows_by_hand():
    """scale = 4 / 127: 1 / scale = 31.75 -> 32, -2 -> -63.5 -> -64 (a tie: to even), 0.3 -> 9.525 -> 10, 4 -> 127."""
    from vlmctl.runtime import kv_quant

    q, s = kv_quant.quantize(torch.tensor([[1.0, -2.0, 0.3, 4.0]]), torch.int8)
    assert q.dtype == torch.int8 and q.tolist() == [[32, -64, 10, 127]]
    assert torch.allclose(s, torch.tensor([4.0 / 127.0]))


@triton.jit
def _widen_all(x_ptr, y_ptr, ASM: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(y_ptr + i, kv_rows.widen(tl.load(x_ptr + i), tl.float16, ASM))


@pytest.mark.skipif(DEV != "cuda", reason="kv_rows.widen's PTX runs only in compiled kernels (a GPU)")
@pytest.mark.parametrize("storage", STORAGES)
def test_widen_every_8bit_value_exactly(storage):
    """`kv_rows.widen` (the decode kernels' 8-bit -> fp16 conversion) on all 256 bit patterns equals torch's
    cast, with its PTX and without it (NaN patterns of e4m3 give NaN)."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(storage).to(DEV)
    want = x.to(torch.float16)
    for asm in (True, False):
        y = torch.full((256,), 7.0, dtype=torch.float16, device=DEV)
        _widen_all[(1,)](x, y, ASM=asm, num_warps=1)
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y[~want.isnan()], want[~want.isnan()]), asm


def test_widen_switch(monkeypatch):
    """Which 8-bit pools the compiled decode kernels widen where they load them: int8 and fp8 by default, neither
    with VLMCTL_ATTN_KV8_WIDEN=0; never bf16 models, 16-bit pools or the interpreter; a bad value is an
    OptionError (one line, exit code 2 from the CLI)."""
    from vlmctl.errors import OptionError
    from vlmctl.runtime.kernels.paged_attention import _widen_in_registers as widen

    i8, f8, f16 = (torch.zeros(1, dtype=t) for t in (torch.int8, torch.float8_e4m3fn, torch.float16))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("VLMCTL_ATTN_KV8_WIDEN", raising=False)
    assert widen(i8, torch.float16) and widen(f8, torch.float16)
    assert not widen(i8, torch.bfloat16) and not widen(f8, torch.bfloat16) and not widen(f16, torch.float16)
    monkeypatch.setenv("VLMCTL_ATTN_KV8_WIDEN", "1")
    assert widen(i8, torch.float16) and widen(f8, torch.float16) and not widen(f8, torch.bfloat16)
    monkeypatch.setenv("VLMCTL_ATTN_KV8_WIDEN", "0")
    assert not widen(i8, torch.float16) and not widen(f8, torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VLMCTL_ATTN_KV8_WIDEN", "1")
    assert not widen(i8, torch.float16)
    monkeypatch.setenv("VLMCTL_ATTN_KV8_WIDEN", "yes")
    with pytest.raises(OptionError, match="VLMCTL_ATTN_KV8_WIDEN"):
        widen(i8, torch.float16)


def test_decode_tile_settings(monkeypatch):
    """The decode kernels' (positions an iteration, warps, pipeline stages): 64 x 4 x 2 for 16-bit pools of
    128-wide heads, 128 x 4 for 8-bit ones, in one stage where the tiles are widened as loaded and two where they
    are cast after shared memory; VLMCTL_ATTN_KV8_TILE / _WARPS / _STAGES override the 8-bit pool's; a value
    that cannot be used is an OptionError naming it."""
    from vlmctl.errors import OptionError
    from vlmctl.runtime.kernels.paged_attention import _tile

    for var in ("VLMCTL_ATTN_KV8_TILE", "VLMCTL_ATTN_KV8_WARPS", "VLMCTL_ATTN_KV8_STAGES"):
        monkeypatch.delenv(var, raising=False)
    assert _tile(128, False) == (64, 4, 2) and _tile(256, False) == (32, 4, 2)
    assert _tile(128, True) == (128, 4, 2) and _tile(256, True) == (64, 4, 2)
    assert _tile(128, True, widened=True) == (128, 4, 1) and _tile(128, False, widened=True) == (64, 4, 2)
    monkeypatch.setenv("VLMCTL_ATTN_KV8_TILE", "64")
    monkeypatch.setenv("VLMCTL_ATTN_KV8_WARPS", "8")
    monkeypatch.setenv("VLMCTL_ATTN_KV8_STAGES", "3")
    assert _tile(128, True) == (64, 8, 3) and _tile(128, True, widened=True) == (64, 8, 3)
    assert _tile(128, False) == (64, 4, 2)
    for var, bad in (("VLMCTL_ATTN_KV8_TILE", "96"), ("VLMCTL_ATTN_KV8_STAGES", "0"), ("VLMCTL_ATTN_KV8_WARPS", "x")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(OptionError, match=var):
            _tile(128, True)
        monkeypatch.delenv(var)


def _pool8(nblocks, bs, n_kv, d, g, storage):
    """An 8-bit pool filled with quantized random rows (magnitudes varying by row), and its scales."""
    from vlmctl.runtime import kv_quant

    x = torch.randn(nblocks, bs, n_kv, d, generator=g) * torch.exp(torch.randn(nblocks, bs, n_kv, 1, generator=g))
    q, s = kv_quant.quantize(x, storage)
    return q.to(DEV), s.to(DEV)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv,d,length", [(2, 32, 37), (3, 80, 64), (1, 16, 1)])
def test_gather_dequantized(dtype, n_kv, d, length, storage):
    """A context's K and V gathered from 8-bit pools in one kernel equal the torch reference bit for bit (the same
    float32 product and rounding), for head sizes that are not powers of two and lengths that end mid-block."""
    from vlmctl.runtime.kernels.kv_rows import gather_dequantized

    g = torch.Generator().manual_seed(23)
    bs, nblocks = 8, 16
    kc, ks = _pool8(nblocks, bs, n_kv, d, g, storage)
    vc, vs = _pool8(nblocks, bs, n_kv, d, g, storage)
    nb = -(-length // bs)
    table = torch.randperm(nblocks, generator=g)[:nb + 2].to(DEV)  # longer than the context, as a sequence's is
    want_k = ops.gather_context(kc, table, length, ks, dtype)
    want_v = ops.gather_context(vc, table, length, vs, dtype)
    assert want_k.shape == (length, n_kv, d) and want_k.dtype == dtype
    k, v = gather_dequantized(kc, vc, ks, vs, table, length, dtype)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # the rows come from the blocks the table names, in its order: a different table gives different rows
    k2, _ = gather_dequantized(kc, vc, ks, vs, table.roll(1), length, dtype)
    assert not torch.equal(k2, want_k)


def _kv_pools(nblocks, bs, n_kv, d, g, dtype, storage):
    """(K pool, V pool, K scales, V scales): random 16-bit pools (scales None), or 8-bit ones with their scales."""
    if storage is None:
        return (torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype),
                torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype), None, None)
    kc, ks = _pool8(nblocks, bs, n_kv, d, g, storage)
    vc, vs = _pool8(nblocks, bs, n_kv, d, g, storage)
    return kc, vc, ks, vs


def _chunk_reference(q, kc, vc, table, length, scale, ks=None, vs=None, window=None):
    """What the decoder ran before the chunk kernel: the context gathered (dequantized from an 8-bit pool to q's
    dtype), then SDPA with a lower-right causal mask (and, with `window`, only keys less than `window` positions
    back), all in float32 from those values."""
    k = ops.gather_context(kc, table.long(), length, ks, q.dtype).float()
    v = ops.gather_context(vc, table.long(), length, vs, q.dtype).float()
    n, Hq, _ = q.shape
    k, v = k.repeat_interleave(Hq // k.shape[1], 1), v.repeat_interleave(Hq // v.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    key = torch.arange(length, device=q.device)[None, :]
    query = (length - n + torch.arange(n, device=q.device))[:, None]
    seen = (key <= query) & (key > query - window if window else True)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("storage", [None] + STORAGES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q,n_kv,d", [(4, 4, 32), (6, 2, 80)])
@pytest.mark.parametrize("start,n", [(5, 1), (16, 7), (40, 33), (3, 70)])
@pytest.mark.parametrize("splits", ["1", "3"])
def test_chunk_attention(dtype, n_q, n_kv, d, start, n, storage, splits, monkeypatch):
    """A chunk's attention read in place from the paged pool (one kernel) equals the gathered context's attention,
    for chunks shorter and longer than a program's rows, contexts ending mid-block and tile, grouped heads, a head
    size that is not a power of two, q a strided view of a fused qkv, and 16- and 8-bit pools; unsplit
    (VLMCTL_PROMPT_SPLITS=1) and with each tile's context divided among up to 3 programs of 16 positions or more."""
    from vlmctl.runtime.kernels import paged_prefill
    from vlmctl.runtime.kernels.paged_prefill import chunk_attention

    monkeypatch.setenv("VLMCTL_PROMPT_SPLITS", splits)
    monkeypatch.setattr(paged_prefill, "SPLIT_POSITIONS", 16)

    if storage is not None and dtype == torch.float32:
        pytest.skip("8-bit pools hold 16-bit models' caches")
    g = torch.Generator().manual_seed(31)
    bs, nblocks = 8, 24
    length = start + n
    kc, vc, ks, vs = _kv_pools(nblocks, bs, n_kv, d, g, dtype, storage)
    table = torch.randperm(nblocks, generator=g)[:-(-length // bs) + 1].to(DEV)  # a block more than the context
    q = (torch.randn(n, n_q + 2 * n_kv, d, generator=g) * 2).to(DEV, dtype)[:, :n_q]  # a view of a fused qkv
    scale = d ** -0.5
    want = _chunk_reference(q, kc, vc, table, length, scale, ks, vs)
    got = chunk_attention(q, kc, vc, table, length, scale, ks, vs)
    assert got.shape == (n, n_q, d) and got.dtype == dtype and not got.isnan().any()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else tol(dtype))
    # the decoder's path before the kernel (SDPA in the model dtype) is as close to the float32 answer
    k, v = ops.gather_kv(kc, vc, table, length, ks, vs, dtype)
    assert rel_err(ops.prefill_attention(q, k, v, scale), want) < (1e-5 if dtype == torch.float32 else tol(dtype))
    # causal: a chunk that starts one position later (its rows see one key more) answers differently
    assert rel_err(chunk_attention(q, kc, vc, table, length + 1, scale, ks, vs), want) > 1e-3


def test_prompt_attention_dispatch(monkeypatch):
    """`ops.prompt_attention` without the kernel (CPU tensors): per tile, the gathered context and SDPA, written
    into `out` where given; a bad VLMCTL_CHUNK_ATTENTION_ROWS is one OptionError."""
    from vlmctl.errors import OptionError
    from vlmctl.runtime.kernels.paged_prefill import tile_table

    g = torch.Generator().manual_seed(32)
    kc, vc = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    table, q = torch.tensor([4, 0, 3, 5]), torch.randn(5, 4, 16, generator=g)
    want = _chunk_reference(q, kc, vc, table, 14, 0.25)
    tiles_t = torch.from_numpy(tile_table([(0, 0, 3, 9), (0, 3, 2, 12)], 32))  # one chunk as two tiles
    out = torch.zeros(5, 4, 16)
    got = ops.prompt_attention(q, kc, vc, table[None].int(), tiles_t, 0.25, out=out)
    assert got is out and rel_err(got, want) < 1e-5
    monkeypatch.setenv("VLMCTL_CHUNK_ATTENTION_ROWS", "many")
    with pytest.raises(OptionError, match="VLMCTL_CHUNK_ATTENTION_ROWS"):
        ops.chunk_attention_rows()


@pytest.mark.parametrize("storage", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 9])
def test_prompt_attention_tiles(dtype, storage, window):
    """One launch for the rows of several sequences, as a captured step sends them: decode rows (one each), a
    prompt from position 0, a continuation longer than a tile; the table longer than the tiles it holds (unused
    tiles touch nothing), rows in no tile left as they were, each sequence's rows equal to its own chunk's attention
    (with a sliding window too)."""
    from vlmctl.runtime.kernels.paged_prefill import prompt_attention, tile_table, tiles

    if storage is not None and dtype == torch.float32:
        pytest.skip("8-bit pools hold 16-bit models' caches")
    g = torch.Generator().manual_seed(33)
    n_q, n_kv, d, bs, nblocks = 4, 2, 32, 8, 52
    kc, vc, ks, vs = _kv_pools(nblocks, bs, n_kv, d, g, dtype, storage)
    # (first position, rows): two decode rows, a prompt from 0, a continuation of two tiles and a bit, and one whose
    # later rows' windows start past the first 64-position key tile the program walks (they saw no key there: NaN
    # before session 47)
    seqs = [(21, 1), (5, 1), (0, 12), (30, 37), (71, 20)]
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(len(seqs) + 1, 12, dtype=torch.int32)  # a table row more than the sequences
    for i in range(len(seqs)):
        tables[i] = perm[12 * i // 2:12 * i // 2 + 12] if i < 2 else perm[12 + 12 * (i - 2):24 + 12 * (i - 2)]
    tables = tables.to(DEV)
    T = sum(n for _, n in seqs) + 3  # three rows in no tile
    q = (torch.randn(T, n_q + 2 * n_kv, d, generator=g) * 2).to(DEV, dtype)[:, :n_q]
    chunks, row = [], 0
    for i, (pos0, n) in enumerate(seqs):
        chunks.append((i, row, n, pos0))
        row += n
    block_m = tiles(d)[0]
    table = tile_table(chunks, block_m, size=len(seqs) + T // block_m + 2)
    assert (table[:, 2] > 0).sum() == 2 + 1 + 2 + 1 and table[-1].tolist() == [0, 0, 0, 0, 0]
    out = torch.full((T, n_q, d), 7.0, dtype=dtype, device=DEV)
    scale = d ** -0.5
    got = prompt_attention(q, kc, vc, tables, torch.from_numpy(table).to(DEV), scale, window, ks, vs, out)
    assert got is out and not got.isnan().any()
    for i, row0, n, pos0 in chunks:
        want = _chunk_reference(q[row0:row0 + n], kc, vc, tables[i], pos0 + n, scale, ks, vs, window)
        assert rel_err(got[row0:row0 + n], want) < (1e-5 if dtype == torch.float32 else tol(dtype)), (i, pos0, n)
    assert bool((got[row:] == 7.0).all())  # no tile: untouched
    # each tile's context divided among 1-4 programs (4 the launch's most), partials combined by the second kernel:
    # the same answer within the float32 sums' order
    split_table = table.copy()
    used = split_table[:, 2] > 0
    split_table[used, 4] = (np.arange(used.sum()) % 4) + 1
    split = prompt_attention(q, kc, vc, tables, torch.from_numpy(split_table).to(DEV), scale, window, ks, vs,
                             torch.full_like(out, 7.0), splits=4)
    assert not split.isnan().any() and bool((split[row:] == 7.0).all())
    assert rel_err(split[:row], got[:row]) < (1e-5 if dtype == torch.float32 else tol(dtype))
    # programs for splits 1-3 launched for the table's first rows only (the used tiles, which hold them; a captured
    # step launches them for the rows `split_tiles` allows): the same programs, so the same bits
    first = prompt_attention(q, kc, vc, tables, torch.from_numpy(split_table).to(DEV), scale, window, ks, vs,
                             torch.full_like(out, 7.0), splits=4, split_rows=int(used.sum()))
    assert torch.equal(first, split)
    # the torch reference the CPU runs agrees
    ref = ops.prompt_attention_reference(q, kc, vc, tables, torch.from_numpy(table), scale, window, ks, vs,
                                         torch.full_like(out, 7.0))
    assert rel_err(ref[:row], got[:row]) < (1e-5 if dtype == torch.float32 else tol(dtype))
    if window:  # the window masks something here: without it the answer differs
        full = prompt_attention(q, kc, vc, tables, torch.from_numpy(table).to(DEV), scale, None, ks, vs)
        assert rel_err(full[:row], got[:row]) > 1e-2


def test_tile_table():
    from vlmctl.runtime.kernels.paged_prefill import max_tiles, tile_table

    t = tile_table([(0, 0, 1, 40), (1, 1, 70, 0), (2, 71, 32, 5)], 32, size=8)
    assert t.tolist() == [[0, 0, 1, 40, 1], [1, 1, 32, 0, 1], [1, 33, 32, 32, 1], [1, 65, 6, 64, 1],
                          [2, 71, 32, 5, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert max_tiles(103, 3, 32) == 7 and len(tile_table([(0, 0, 1, 40), (1, 1, 70, 0), (2, 71, 32, 5)], 32)) == 5
    with pytest.raises(ValueError, match="tiles exceed"):
        tile_table([(0, 0, 70, 0)], 32, size=2)
    # 16 rows after 1,888 cached positions and a decode row after 600, 32 heads on 132 SMs: 2 tiles x 32 heads are
    # 64 programs, so each tile's context is split, into ~4 programs a SM at most, 256 positions or more each
    t = tile_table([(0, 0, 16, 1888), (1, 16, 1, 600)], 32, max_splits=16, heads=32, sms=132)
    assert t[:, 4].tolist() == [8, 3]  # ceil(1904 / 256), ceil(601 / 256); 4 x 132 / 64 would allow 9
    assert tile_table([(0, 0, 16, 1888)], 32, max_splits=4, heads=32, sms=132)[:, 4].tolist() == [4]


def test_split_counts_and_max_splits(monkeypatch):
    """Splitting is for few programs: none once the tiles give each SM two; the cap of `VLMCTL_PROMPT_SPLITS` and
    of the partials' bytes (SPLIT_WORKSPACE_BYTES)."""
    from vlmctl.errors import OptionError
    from vlmctl.runtime.kernels import paged_prefill as pp

    assert pp.split_counts([4000] * 9, 32, 16, 132).tolist() == [1] * 9  # 288 programs: enough
    assert pp.split_tiles(32, 132) == 8 and pp.split_counts([4000] * 8, 32, 16, 132).tolist() == [3] * 8
    assert pp.split_counts([4000] * 4, 32, 16, 132).tolist() == [5] * 4  # 128 programs: ceil(528 / 128)
    assert pp.split_counts([100, 300, 5000], 8, 16, 132).tolist() == [1, 2, 16]
    assert pp.split_counts([5000], 8, 1, 132).tolist() == [1]
    monkeypatch.setenv("VLMCTL_PROMPT_SPLITS", "16")
    assert pp.max_splits(16, 32, 128) == 16
    assert pp.max_splits(384, 32, 128) == pp.SPLIT_WORKSPACE_BYTES // (384 * 32 * 128 * 4) == 2
    monkeypatch.setenv("VLMCTL_PROMPT_SPLITS", "1")
    assert pp.max_splits(16, 32, 128) == 1
    monkeypatch.setenv("VLMCTL_PROMPT_SPLITS", "0")
    with pytest.raises(OptionError, match="VLMCTL_PROMPT_SPLITS"):
        pp.max_splits(16, 32, 128)
    monkeypatch.delenv("VLMCTL_PROMPT_SPLITS")
    assert pp.max_splits(16, 32, 128) == pp.DEFAULT_SPLITS


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (6, 1)])
def test_rope_and_cache_8bit(dtype, n_q, n_kv, storage):
    from vlmctl.runtime import kv_quant
    from vlmctl.runtime.kernels.fused import rope_and_cache

    g = torch.Generator().manual_seed(21)
    T, d, bs, nblocks = 7, 32, 4, 6
    qkv = (torch.randn(T, (n_q + 2 * n_kv) * d, generator=g) * 30).to(DEV, dtype)  # keys beyond e4m3's 448 / 30
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(40).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(DEV)
    pos = torch.randint(0, 40, (T,), generator=g).to(DEV)
    slots = torch.randperm(nblocks * bs, generator=g)[:T].to(DEV)
    slots[3] = -1
    kc = torch.full((nblocks, bs, n_kv, d), 7.0, device=DEV).to(storage)
    vc, ks, vs = kc.clone(), torch.full((nblocks, bs, n_kv), 5.0, device=DEV), torch.full((nblocks, bs, n_kv), 5.0,
                                                                                          device=DEV)
    refs = [t.clone() for t in (qkv, kc, vc, ks, vs)]
    v_in = qkv[:, (n_q + n_kv) * d:].clone()
    ops.rope_and_cache_reference(refs[0], cos_sin, pos, n_q, n_kv, d, refs[1], refs[2], slots, refs[3], refs[4])
    rope_and_cache(qkv, cos_sin, pos, n_q, n_kv, d, kc, vc, slots, ks, vs)
    assert rel_err(qkv[:, :n_q * d], refs[0][:, :n_q * d]) < tol(dtype)
    # K's rows in qkv are now as stored (below): one rounding of the rotary apart on CUDA can move a value by a
    # step of the 8-bit grid, so they are compared as the pool's K is
    assert rel_err(qkv[:, n_q * d:], refs[0][:, n_q * d:]) <= (0 if DEV == "cpu" else 0.02)
    # V's rows are copied, so their quantization is exact; K's rotary may differ by a rounding on CUDA (see
    # test_paged_decode_with_rope_and_append), so its stored values are compared dequantized
    assert torch.equal(vc.view(torch.uint8), refs[2].view(torch.uint8)) and torch.equal(vs, refs[4])
    assert rel_err(kv_quant.dequantize(kc, ks, torch.float32), kv_quant.dequantize(refs[1], refs[3], torch.float32)) \
        <= (0 if DEV == "cpu" else 0.02)
    written = (ks != 5.0)
    assert int(written.sum()) == (T - 1) * n_kv  # the -1 slot wrote nothing
    assert (vs[written] > 0).all() and torch.equal(vs != 5.0, written)
    # qkv's k and v rows of the written slots are now what the pool holds (what a fresh prompt attends to); the
    # unwritten row keeps its rotated, unrounded values
    keep = slots >= 0
    k_rows = qkv[:, n_q * d:(n_q + n_kv) * d].view(T, n_kv, d)
    v_rows = qkv[:, (n_q + n_kv) * d:].view(T, n_kv, d)
    at = slots[keep].long()
    stored_k = kv_quant.dequantize(kc.view(-1, n_kv, d)[at], ks.view(-1, n_kv)[at], dtype)
    stored_v = kv_quant.dequantize(vc.view(-1, n_kv, d)[at], vs.view(-1, n_kv)[at], dtype)
    assert torch.equal(k_rows[keep], stored_k) and torch.equal(v_rows[keep], stored_v)
    assert torch.equal(refs[0][:, (n_q + n_kv) * d:], qkv[:, (n_q + n_kv) * d:])  # the reference does the same
    v_in = v_in.view(T, n_kv, d)
    assert torch.equal(v_rows[3], v_in[3]) and not torch.equal(v_rows[keep], v_in[keep])


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q,n_kv,d", [(4, 4, 16), (8, 2, 32)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_8bit(dtype, n_q, n_kv, d, splits, window, storage):
    from vlmctl.runtime.kernels.paged_attention import paged_decode

    g = torch.Generator().manual_seed(22)
    B, bs, nblocks, maxb = 3, 8, 24, 6
    lens = torch.tensor([1, 19, 45], dtype=torch.int32).to(DEV)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:maxb] for _ in range(B)]).to(torch.int32).to(DEV)
    kc, ks = _pool8(nblocks, bs, n_kv, d, g, storage)
    vc, vs = _pool8(nblocks, bs, n_kv, d, g, storage)
    q = torch.randn(B, n_q + 2 * n_kv, d, generator=g).to(DEV, dtype)[:, :n_q]
    want = ops.paged_decode_reference(q.float(), kc, vc, tables, lens, d ** -0.5, window, ks, vs)
    got = paged_decode(q, kc, vc, tables, lens, d ** -0.5, num_splits=splits, window=window, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)
    # the scales matter: read as if they were all 1 the answer is another one
    ones = torch.ones_like(ks)
    assert rel_err(ops.paged_decode_reference(q.float(), kc, vc, tables, lens, d ** -0.5, window, ones, ones),
                   want) > 0.05


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("early", [False, True])
def test_paged_decode_with_rope_and_append_8bit(n_q, n_kv, splits, storage, early, monkeypatch):
    """The fused decode kernel on an 8-bit pool == rotary + quantized append + attention over the stored rows
    (early: the first tile, its scales with it, loaded before the PDL wait)."""
    from vlmctl.runtime import kv_quant
    from vlmctl.runtime.kernels import paged_attention
    from vlmctl.runtime.kernels.paged_attention import paged_decode_rope, split_workspace

    monkeypatch.setattr(paged_attention, "early_tile", lambda device: early)

    dtype = torch.float16
    g = torch.Generator().manual_seed(23)
    B, bs, maxb, d = 4, 8, 26, 32
    nblocks = B * maxb + 1
    lens = torch.tensor([1, 20, 45, 200], dtype=torch.int32)
    tables = (torch.randperm(nblocks - 1, generator=g)[:B * maxb].view(B, maxb) + 1).to(torch.int32)
    slots = torch.tensor([int(tables[b, (int(lens[b]) - 1) // bs]) * bs + (int(lens[b]) - 1) % bs for b in range(B)])
    kc, ks = _pool8(nblocks, bs, n_kv, d, g, storage)
    vc, vs = _pool8(nblocks, bs, n_kv, d, g, storage)
    qkv = (torch.randn(B, (n_q + 2 * n_kv) * d, generator=g) * 3).to(DEV, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(256).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(DEV)
    pos = (lens.long() - 1).to(DEV)
    refs = [t.clone() for t in (qkv, kc, vc, ks, vs)]
    qkv0, kc0, vc0, ks0, vs0 = [t.clone() for t in (qkv, kc, vc, ks, vs)]
    tables, lens, slots = tables.to(DEV), lens.to(DEV), slots.to(DEV)
    ops.rope_and_cache_reference(refs[0], cos_sin, pos, n_q, n_kv, d, refs[1], refs[2], slots, refs[3], refs[4])
    want = ops.paged_decode_reference(refs[0][:, :n_q * d].view(B, n_q, d), refs[1], refs[2], tables, lens,
                                      d ** -0.5, None, refs[3], refs[4])
    ws = split_workspace(B, n_q, d, splits, DEV) if splits > 1 else None
    got = paged_decode_rope(qkv, cos_sin, pos, slots, kc, vc, tables, lens, d ** -0.5, n_q, n_kv,
                            num_splits=splits, workspace=ws, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < 3e-3
    assert torch.equal(vc.view(torch.uint8), refs[2].view(torch.uint8)) and torch.equal(vs, refs[4])
    assert rel_err(kv_quant.dequantize(kc, ks, torch.float32), kv_quant.dequantize(refs[1], refs[3], torch.float32)) \
        <= (0 if DEV == "cpu" else 0.02)
    # the new token is attended to as stored: through an fp16 pool holding the same older rows (the new token
    # not quantized) the answer is another one
    plain_qkv, k16, v16 = qkv0, kv_quant.dequantize(kc0, ks0, dtype), kv_quant.dequantize(vc0, vs0, dtype)
    ops.rope_and_cache_reference(plain_qkv, cos_sin, pos, n_q, n_kv, d, k16, v16, slots)
    plain = ops.paged_decode_reference(plain_qkv[:, :n_q * d].view(B, n_q, d), k16, v16, tables, lens, d ** -0.5)
    assert rel_err(plain, want) > 1e-4
