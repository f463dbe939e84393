"""The measurement kernel `w4a16_gemv_tma` (runtime/kernels/w4a16_gemv_tma.cu: the batch-1 CUDA GEMV with each
warp's weight rows brought into shared memory by one bulk copy). On the CPU (tests/cuda_host.py; a bulk copy lands
only when a thread waits on its mbarrier): bit-equal to the CUDA GEMV with the same rows a warp, whose arithmetic
and order of sums it shares, for rows past N, K not a multiple of 64 chunks, bias and several x rows; x read
only after the PDL wait. `gpu`: the same on the GPU at the 7B decoder's shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import on_host, random_packed, reference

HOST = cuda_host.unavailable()
TOL16 = 2 * 2.0 ** -11


def _tma(rpw, nw):
    return W.Config("gemv_tma", block_n=rpw * nw, num_warps=nw)


def _cuda(rpw, nw):
    return W.Config("gemv_cuda", block_n=rpw * nw, num_warps=nw, num_stages=1)


def test_shared_bytes():
    assert W.gemv_tma_shared_bytes(_tma(4, 4), 4096) == 1024 + 16 * 2048
    assert W.gemv_tma_shared_bytes(_tma(2, 16), 11008) == 4096 + 32 * 5504


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("n,k,g", [(77, 256, 32), (40, 384, 128), (36, 1088, 64)], ids=str)
@pytest.mark.parametrize("rpw,nw", [(4, 4), (2, 2), (8, 1)], ids=str)
def test_on_the_host_equals_the_cuda_gemv(n, k, g, rpw, nw, monkeypatch):
    gen = torch.Generator().manual_seed(n * k + g)
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen).half()
        for bias in (None, torch.randn(n, generator=gen).half()):
            ys = on_host(W._launch_gemv_tma, x, p, g, _tma(rpw, nw), bias, n, monkeypatch)
            (yc,) = on_host(W._launch_gemv_cuda, x, p, g, _cuda(rpw, nw), bias, n, monkeypatch, seeds=(0,))
            ref = reference(x, p, g, bias)
            err = float((ys[0].float() - ref).norm() / ref.norm())
            assert err <= TOL16, f"M={m}: relative error {err:.2e}"
            assert torch.equal(ys[0], yc), "the CUDA GEMV's arithmetic and order of sums"
            assert torch.equal(ys[0], ys[1])


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("n,k,g", [(80, 256, 32), (44, 384, 128)], ids=str)
@pytest.mark.parametrize("rpw,nw", [(4, 4), (2, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_on_the_host_act_mul_epilogue_equals_the_cuda_gemv(n, k, g, rpw, nw, act, monkeypatch):
    """A gate_up weight (gate rows, then up rows N / 2 below) with the act·mul epilogue: two bulk copies a warp;
    bit-equal to the CUDA GEMV's epilogue, also where the last warp's rows run past N / 2."""
    gen = torch.Generator().manual_seed(n * k + g)
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    x = torch.randn(1, k, generator=gen).half()
    bias = torch.randn(n, generator=gen).half()
    ys = on_host(functools.partial(W._launch_gemv_tma, act=act), x, p, g, _tma(rpw, nw), bias, n // 2, monkeypatch)
    (yc,) = on_host(functools.partial(W._launch_gemv_cuda, act=act), x, p, g, _cuda(rpw, nw), bias, n // 2,
                    monkeypatch, seeds=(0,))
    assert torch.equal(ys[0], yc) and torch.equal(ys[0], ys[1])


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
def test_switch_routes_the_cuda_gemv(monkeypatch):
    """VLMCTL_W4A16_GEMV_TMA=1: the CUDA GEMV's launches run the bulk-copy kernel (a host run shows which kernel
    was loaded), with equal results."""
    from vlmctl.runtime.kernels import cuda_rtc

    p = random_packed(40, 256, 32, seed=1, device="cpu")
    x = torch.randn(1, 256).half()
    (plain,) = on_host(W._launch_gemv_cuda, x, p, 32, _cuda(4, 2), None, 40, monkeypatch, seeds=(0,))
    loaded = []
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TMA", "1")
    host = cuda_host.HostRTC(guard=0, seed=0)

    def load(source, name, device):
        loaded.append(name)
        return host.load_kernel(source, name, device)

    monkeypatch.setattr(cuda_rtc, "load_kernel", load)
    y = torch.empty(1, 40, dtype=torch.float16)
    W._launch_gemv_cuda(x, p, 32, _cuda(4, 2), None, y)
    assert loaded == ["w4a16_gemv_tma<4, 2, 32>"] and torch.equal(y, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (77, 256)], ids=str)
@pytest.mark.parametrize("rpw,nw", [(4, 4), (2, 8), (8, 2)], ids=str)
def test_gpu_equals_the_cuda_gemv(n, k, rpw, nw):
    g = 128 if k % 128 == 0 else 32
    p = random_packed(n, k, g, seed=n + k)
    x = torch.randn(1, k, device="cuda").half()
    y = torch.empty(1, n, device="cuda", dtype=torch.float16)
    yc = torch.empty_like(y)
    W._launch_gemv_tma(x, p, g, _tma(rpw, nw), None, y)
    W._launch_gemv_cuda(x, p, g, _cuda(rpw, nw), None, yc)
    ref = reference(x, p, g, None)
    assert float((y.float() - ref).norm() / ref.norm()) <= TOL16
    assert torch.equal(y, yc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rpw,nw", [(4, 4), (8, 2)], ids=str)
def test_gpu_act_mul_epilogue_equals_the_cuda_gemv(rpw, nw):
    n, k, g = 22016, 4096, 128
    p = random_packed(n, k, g, seed=5)
    x = torch.randn(1, k, device="cuda").half()
    y = torch.empty(1, n // 2, device="cuda", dtype=torch.float16)
    yc = torch.empty_like(y)
    W._launch_gemv_tma(x, p, g, _tma(rpw, nw), None, y, act="silu")
    W._launch_gemv_cuda(x, p, g, _cuda(rpw, nw), None, yc, act="silu")
    assert torch.equal(y, yc)
