"""The batch-1 step's RMSNorms folded into its CUDA GEMVs (`runtime/kernels/norm_fold.py`): `w4a16_gemv_norm`
(qkv and gate_up normalize the residual row themselves) and `w4a16_gemv<..., ADD = 1>` (o and down add their output
into the residual stream).

On the CPU (tests/cuda_host.py, the kernels' own C++; x or the residual holds NaN until the PDL wait): the
normalized row is the norm kernel's bit for bit where the sum of squares rounds alike (an identity weight makes the
GEMV return it), the folded GEMV equals the plain GEMV on the reference norm's output, the add epilogue rounds as
the norm kernel's residual add. With NVRTC: every instance compiles for sm_90. On a GPU (`gpu`): a decoder's folded
steps against its norm kernels (tests/test_gpu_runtime.py).
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.formats.w4a16 import pack
from vlmctl.runtime import ops
from vlmctl.runtime.kernels import cuda_rtc, norm_fold
from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import random_packed

HOST = cuda_host.unavailable()
host_only = pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
EPS = 1e-5


def _cfg(rows, warps, stages):
    return W.Config("gemv_cuda", block_n=rows, num_warps=warps, num_stages=stages)


def _identity(k, g):
    """The packed [k, k] identity: code 1 on the diagonal, 0 elsewhere, zero point 0, scale 1."""
    return pack(torch.eye(k, dtype=torch.int32), torch.zeros(k, k // g, dtype=torch.int32),
                torch.ones(k, k // g, dtype=torch.float16), g)


def _rows(m, k, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * scale).half()


def _host(monkeypatch, guard: int, seed: int):
    rtc = cuda_host.HostRTC(guard=guard, seed=seed)
    monkeypatch.setattr(cuda_rtc, "load_kernel", rtc.load_kernel)
    return rtc


def _fp16_ulps(got, want):
    """|got - want| in units of want's fp16 spacing."""
    ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp_min(2.0 ** -14)
    return (got.float() - want.float()).abs() / ulp


@host_only
@pytest.mark.parametrize("k,g,cfg", [(256, 64, _cfg(16, 4, 2)), (96, 32, _cfg(8, 2, 1)), (512, 128, _cfg(32, 8, 4))],
                         ids=str)
@pytest.mark.parametrize("one_plus", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["unit", "large"])
def test_on_the_host_the_folded_norm_rounds_as_the_norm_kernel(k, g, cfg, one_plus, scale, monkeypatch):
    """Through an identity weight the folded GEMV returns its normalized row: against `ops.rms_norm_reference`
    (torch's rounding: x * rsqrt(mean(x^2) + eps) to fp16, times the weight to fp16; Gemma's (1 + w) product
    rounded once), equal in nearly every element and never more than one fp16 step off (the sum of squares is
    added in another order, which can move rsqrt by an fp32 ulp). Two rows, activations of large magnitude. The
    GEMV's arithmetic that dequantizes each weight first (`VLMCTL_W4A16_GEMV_SCALE_PER_RUN=0`) multiplies by 1
    exactly; the default's (code - zero) / 128 products lose bits of small x to fp16 subnormals."""
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_SCALE_PER_RUN", "0")
    rtc = _host(monkeypatch, guard=0, seed=k)
    x = _rows(2, k, seed=k, scale=scale)
    w = (torch.rand(k, generator=torch.Generator().manual_seed(1)) * 2 - 0.5).half()
    want = ops.rms_norm_reference(x.clone(), w, EPS, one_plus=one_plus)
    got = norm_fold.norm_linear(x, _identity(k, g), g, cfg, w, EPS, one_plus)
    assert (got == want).float().mean() >= 0.99
    assert float(_fp16_ulps(got, want).max()) <= 1.0
    rows = cfg.block_n // cfg.num_warps
    assert rtc.launched == [f"w4a16_gemv_norm<{rows}, {cfg.num_warps}, {cfg.num_stages}, {g}, -1, {int(one_plus)}>"]


@host_only
@pytest.mark.parametrize("n,k,g,cfg", [(45, 96, 32, _cfg(16, 8, 1)), (64, 2048, 128, _cfg(32, 4, 1)),
                                       (33, 1024, 64, _cfg(16, 4, 2))], ids=str)
@pytest.mark.parametrize("act", [None, "silu", "gelu_tanh"])
def test_on_the_host_folded_gemv_equals_the_plain_gemv_on_the_normed_row(n, k, g, cfg, act, monkeypatch):
    """qkv / gate_up folded: the plain CUDA GEMV (and its act·mul epilogue) on the reference norm's output gives the
    same bits (but for the rare element whose normalized input moved by a rounding), bias or not, odd N."""
    if act is not None:
        n += n % 2
    _host(monkeypatch, guard=0, seed=n)
    p = random_packed(n, k, g, seed=n * k, device="cpu")
    x = _rows(1, k, seed=n + k, scale=4.0)
    w = (torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5).half()
    normed = ops.rms_norm_reference(x.clone(), w, EPS)
    for bias in (None, torch.randn(n, generator=torch.Generator().manual_seed(3)).half()):
        n_out = n // 2 if act else n
        plain = torch.empty(1, n_out, dtype=torch.float16)
        W._launch_gemv_cuda(normed, p, g, cfg, bias, plain, act=act)
        got = norm_fold.norm_linear(x, p, g, cfg, w, EPS, bias=bias, act=act)
        assert got.shape == (1, n_out)
        assert (got == plain).float().mean() >= 0.9
        assert float((got.float() - plain.float()).abs().max()) <= 0.05 * float(plain.float().abs().max())
    assert torch.equal(x, _rows(1, k, seed=n + k, scale=4.0)), "the residual row is left as it was"


@host_only
@pytest.mark.parametrize("n,k,g,cfg", [(45, 96, 32, _cfg(8, 8, 1)), (128, 1024, 128, _cfg(16, 4, 2)),
                                       (17, 1024, 64, _cfg(4, 2, 4))], ids=str)
def test_on_the_host_add_epilogue_rounds_as_the_residual_add(n, k, g, cfg, monkeypatch):
    """o / down folded: residual += the GEMV's fp16 output, the sum rounded to fp16 (as the norm kernel's residual
    add), bit for bit against the plain GEMV's output added in torch; M = 1 and 3, bias or not; x is read only
    after the PDL wait."""
    _host(monkeypatch, guard=0, seed=k)
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    for m in (1, 3):
        x = _rows(m, k, seed=m * k)
        for bias in (None, torch.randn(n, generator=torch.Generator().manual_seed(m)).half()):
            plain = torch.empty(m, n, dtype=torch.float16)
            W._launch_gemv_cuda(x, p, g, cfg, bias, plain)
            residual = _rows(m, n, seed=n, scale=8.0)
            want = (residual.float() + plain.float()).half()
            out = norm_fold.add_linear(x, p, g, cfg, residual, bias)
            assert out is residual and torch.equal(residual, want), (m, bias is not None)


def test_fold_config_and_the_switch(monkeypatch):
    """No CUDA GEMV on the CPU, so no fold; the switch (off by default) takes 0/1/2 and says what else it expected; the folded
    kernel's shared memory (row and weight) bounds K."""
    p = random_packed(64, 256, 64, seed=1, device="cpu")
    assert norm_fold.fold_config(p, 64, torch.device("cpu")) is None
    monkeypatch.delenv("VLMCTL_NORM_FOLD", raising=False)
    assert not norm_fold.enabled() and norm_fold.mode() == "0"
    monkeypatch.setenv("VLMCTL_NORM_FOLD", "1")
    assert norm_fold.enabled() and norm_fold.mode() == "1"
    monkeypatch.setenv("VLMCTL_NORM_FOLD", "2")
    assert norm_fold.mode() == "2" and norm_fold.enabled()
    monkeypatch.setenv("VLMCTL_NORM_FOLD", "3")
    with pytest.raises(OptionError, match="VLMCTL_NORM_FOLD"):
        norm_fold.enabled()
    assert norm_fold.shared_bytes(4096, _cfg(16, 4, 2)) == 4 * 4096 + 16


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_the_folded_kernels_compile_for_sm90():
    cfgs = [W.heuristic_gemv_cuda_config(4096, 4096, 128), W.heuristic_gemv_cuda_act_mul_config(), _cfg(16, 4, 2)]
    names = sorted({norm_fold.norm_kernel_name(c, g, act, one_plus) for c in cfgs for g in (64, 128)
                    for act in (None, "silu", "gelu_tanh") for one_plus in (False, True)}
                   | {norm_fold.add_kernel_name(c, g) for c in cfgs for g in (64, 128)}
                   | {norm_fold.add_prepare_kernel_name(c, 128, one_plus) for c in cfgs for one_plus in (False, True)}
                   | {norm_fold.scaled_kernel_name(c, 128, act) for c in cfgs for act in (None, "silu")})
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), names, "sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(names)


# ---- the other way (VLMCTL_NORM_FOLD=2): the GEMV before a norm prepares its input ----

@host_only
@pytest.mark.parametrize("n,k,g,cfg", [(45, 96, 32, _cfg(8, 8, 1)), (128, 1024, 128, _cfg(16, 4, 2))], ids=str)
@pytest.mark.parametrize("one_plus", [False, True], ids=["llama", "gemma"])
def test_on_the_host_add_prepare(n, k, g, cfg, one_plus, monkeypatch):
    """o / down with the next norm's input: the residual as `add_linear` leaves it, u = residual * w (Gemma: * (1 +
    w)) rounded to fp16, bit for bit, and one partial sum of squares a warp (its rows') that add up to the row's."""
    _host(monkeypatch, guard=0, seed=k)
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    w = (torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.5).half()
    count = norm_fold.partial_count(cfg, n)
    for m in (1, 2):
        x = _rows(m, k, seed=m * k)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).half()
        plain = torch.empty(m, n, dtype=torch.float16)
        W._launch_gemv_cuda(x, p, g, cfg, bias, plain)
        residual = _rows(m, n, seed=n, scale=8.0)
        want = (residual.float() + plain.float()).half()
        u = torch.empty(m, n, dtype=torch.float16)
        part = torch.full((m * count,), float("nan"))
        norm_fold.add_prepare(x, p, g, cfg, residual, w, u, part, one_plus, bias)
        assert torch.equal(residual, want)
        gain = (1.0 + w.float()) if one_plus else w.float()
        assert torch.equal(u, (want.float() * gain).half())
        rpw = cfg.block_n // cfg.num_warps
        sq = torch.nn.functional.pad(want.float().square(), (0, count * rpw - n)).view(m, count, rpw).sum(-1)
        torch.testing.assert_close(part.view(m, count), sq, rtol=1e-6, atol=0)


@host_only
@pytest.mark.parametrize("n,k,g,cfg", [(46, 96, 32, _cfg(16, 8, 1)), (64, 2048, 128, _cfg(32, 4, 1))], ids=str)
@pytest.mark.parametrize("act", [None, "silu"])
def test_on_the_host_scaled_gemv(n, k, g, cfg, act, monkeypatch):
    """qkv / gate_up after a prepared norm: the plain GEMV of u times rsqrt(sum of the partial sums / K + eps), within
    fp16 rounding of that product taken in torch (bias, act·mul); and the whole prepared path within fp16 noise of
    the norm kernel's reference path (torch's roundings at other places)."""
    _host(monkeypatch, guard=0, seed=n)
    p = random_packed(n, k, g, seed=n * k, device="cpu")
    r = _rows(1, k, seed=n + k, scale=6.0)
    w = (torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    u = (r.float() * w.float()).half()
    part = r.float().square().view(8, -1).sum(-1)  # any split of the sum: 8 partials
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).half()
    got = norm_fold.scaled_linear(u, p, g, cfg, part, 8, EPS, bias=bias, act=act)
    rstd = torch.rsqrt(r.float().square().mean() + EPS)
    lin = (u.float() @ W.dequantize(p, g, torch.float16).float().T) * rstd + bias.float()
    half = n // 2
    want = lin if act is None else torch.nn.functional.silu(lin[:, :half].half().float()) * lin[:, half:].half().float()
    assert float((got.float() - want).norm() / want.norm()) <= 2e-3
    normed = ops.rms_norm_reference(r.clone(), w, EPS)
    ref = torch.empty_like(got)
    W._launch_gemv_cuda(normed, p, g, cfg, bias, ref, act=act)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) <= 4e-3
