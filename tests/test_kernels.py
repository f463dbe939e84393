"""The runtime's Triton kernels against their torch references (vlmctl.runtime.ops).

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on
small shapes; on a CUDA host the same comparisons run on the device. Inputs are fresh random
data each time; outputs are poisoned before the call so unwritten elements show.
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.runtime import ops

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    from vlmctl.runtime.kernels.fused import add_rms_norm

    g = torch.Generator().manual_seed(1)
    T, H = 5, 96  # H not a power of two: masked columns
    x = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    res = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    want = ops.rms_norm_reference(x.clone(), w, 1e-6, res_ref)
    out = torch.full_like(x, float("nan"))
    got = add_rms_norm(x, w, 1e-6, res, out=out)
    assert not got.isnan().any()
    assert rel_err(got, want) < tol(dtype)
    if with_residual:
        assert torch.equal(res, res_ref)  # the residual sum is rounded to the dtype in both


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q,n_kv,d", [(4, 4, 16), (8, 2, 32), (7, 1, 24)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode(dtype, n_q, n_kv, d, splits):
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
    want = ops.paged_decode_reference(q.float(), kc.float(), vc.float(), tables.to(DEV), lens.to(DEV), scale)
    out = torch.full((B, n_q, d), float("nan"), dtype=dtype, device=DEV)
    got = paged_decode(q, kc, vc, tables.to(DEV), lens.to(DEV), scale, num_splits=splits, out=out)
    assert not got.isnan().any()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_with_rope_and_append(dtype, n_q, n_kv, splits):
    """The fused decode kernel == rotary + KV append + attention as separate reference operations."""
    from vlmctl.runtime.kernels.paged_attention import paged_decode_rope

    g = torch.Generator().manual_seed(5)
    B, bs, nblocks, maxb, d = 3, 8, 24, 6, 32
    lens = torch.tensor([1, 20, 45], dtype=torch.int32)  # context incl. the new token
    tables = torch.stack([torch.randperm(nblocks - 1, generator=g)[:maxb] + 1 for _ in range(B)]).to(torch.int32)
    slots = torch.tensor([int(tables[b, (int(lens[b]) - 1) // bs]) * bs + (int(lens[b]) - 1) % bs for b in range(B)])
    kc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(DEV, dtype)
    qkv = torch.randn(B, (n_q + 2 * n_kv) * d, generator=g).to(DEV, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(64).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(DEV)
    pos = (lens.long() - 1 + 3).to(DEV)  # rotary positions need not equal cache indices (M-RoPE deltas)
    kc_ref, vc_ref, qkv_ref = kc.clone(), vc.clone(), qkv.clone()
    ops.rope_and_cache_reference(qkv_ref, cos_sin, pos, n_q, n_kv, d, kc_ref, vc_ref, slots.to(DEV))
    want = ops.paged_decode_reference(qkv_ref[:, :n_q * d].view(B, n_q, d).float(), kc_ref.float(), vc_ref.float(),
                                      tables.to(DEV), lens.to(DEV), d ** -0.5)
    got = paged_decode_rope(qkv, cos_sin, pos, slots.to(DEV), kc, vc, tables.to(DEV), lens.to(DEV), d ** -0.5, n_q,
                            n_kv, num_splits=splits)
    assert rel_err(got, want) < 3e-3
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # the appended K/V, rounded as the reference rounds
