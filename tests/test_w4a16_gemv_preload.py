"""`VLMCTL_W4A16_GEMV_PRELOAD=2`: the batch-1 GEMVs (the CUDA GEMV `w4a16_gemv` and the tensor-core GEMV
`w4a16_gemv_tc`) load two batches (runs) of weights before their PDL wait instead of one (session 53; opt-in until a
GPU measures it, docs/benchmarks.md). Only the order of the loads changes, so the outputs must be the same bits as
the default's; x must still be read only after the wait (the host emulator holds it NaN until then). Without a GPU:
the switch, and both kernels' C++ on the CPU (tests/cuda_host.py) at shapes where a warp's share of K is one
batch, exactly two, and more with a last one cut short. A `gpu` test compares the two builds at the 7B shapes.
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import random_packed, reference

HOST = cuda_host.unavailable()
TOL16 = 2 * 2.0 ** -11


def _cuda(rows, warps, stages):
    return W.Config("gemv_cuda", block_n=rows * warps, num_warps=warps, num_stages=stages)


def _tc(tiles, warps, stages):
    return W.Config("gemv_tc", block_n=16 * tiles, num_warps=warps, num_stages=stages)


def test_preload_switch_builds_its_own_source_and_rejects_bad_values(monkeypatch):
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_SCALE_PER_RUN", raising=False)
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_PRELOAD", raising=False)
    plain = W.mma_source()
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", "1")
    assert W.mma_source() is plain and "W4A16_GEMV_PRELOAD" not in plain.split("\n", 1)[0]
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", "2")
    two = W.mma_source()
    assert two is W.mma_source() and two == "#define W4A16_GEMV_PRELOAD 2\n" + plain
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_SCALE_PER_RUN", "0")  # the switches combine
    assert W.mma_source().split("\n")[:2] == ["#define W4A16_GEMV_PRELOAD 2", "#define W4A16_GEMV_SCALE_PER_RUN 0"]
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_SCALE_PER_RUN")
    for bad in ("0", "3", "two"):
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", bad)
        with pytest.raises(OptionError, match="VLMCTL_W4A16_GEMV_PRELOAD"):
            W.mma_source()


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_preload_two_compiles_to_other_code(monkeypatch):
    """The define reaches both kernels: their PTX differs from the default's (more loads before the wait)."""
    names = [W.gemv_cuda_kernel_name(_cuda(4, 2, 2), 128), W.gemv_tc_kernel_name(_tc(2, 16, 1), 128, 4096)]
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_PRELOAD", raising=False)
    ptx = {}
    for preload in ("1", "2"):
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", preload)
        ptx[preload] = {nm: cuda_rtc.compile_ptx(W.mma_source(), [nm], "sm_90")[0] for nm in names}
    for nm in names:
        before = {p: ptx[p][nm].split("griddepcontrol.wait")[0].count("ld.global") for p in ptx}
        assert before["2"] > before["1"] > 0, (nm, before)


def _host_run(launch_args, preload, seed, monkeypatch):
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", preload)
    monkeypatch.setattr(cuda_rtc, "load_kernel", cuda_host.HostRTC(guard=0, seed=seed).load_kernel)
    x, p, g, cfg, bias, n_out, act = launch_args
    y = torch.empty(x.shape[0], n_out, dtype=torch.float16)
    W._launch_gemv_cuda(x, p, g, cfg, bias, y, act=act)
    return y


# (n, k, g, config, act): a warp's share of K one batch / run, exactly two, and more with the last cut short
HOST_CASES = [
    (16, 1024, 128, _cuda(4, 2, 1), None),    # 32 lane-chunks: one batch of one chunk
    (16, 2048, 128, _cuda(4, 2, 1), None),    # two batches
    (24, 4160, 64, _cuda(8, 2, 2), None),     # 130 lane-chunks: three batches, the last cut short
    (32, 512, 128, _tc(2, 2, 1), None),       # 4 chunks, 2 warps: two runs a warp
    (32, 256, 128, _tc(2, 2, 1), None),       # one run a warp
    (48, 1408, 128, _tc(1, 2, 2), None),      # 11 chunks in runs of 2: the last run cut short
    (64, 1152, 128, _tc(2, 2, 1), "silu"),    # the act·mul epilogue
]


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("n,k,g,cfg,act", HOST_CASES,
                         ids=[f"{n}x{k}-g{g}-{W.describe(c)}-{a}" for n, k, g, c, a in HOST_CASES])
def test_on_the_host_preload_two_gives_the_same_bits(n, k, g, cfg, act, monkeypatch):
    gen = torch.Generator().manual_seed(n + k)
    p = random_packed(n, k, g, seed=n * k, device="cpu")
    n_out = n // 2 if act else n
    for m in (1, 2):
        x = torch.randn(m, k, generator=gen).half()
        bias = torch.randn(n, generator=gen).half()
        args = (x, p, g, cfg, bias, n_out, act)
        one = _host_run(args, "1", 0, monkeypatch)
        two = [_host_run(args, "2", seed, monkeypatch) for seed in (0, 1)]
        assert torch.equal(one, two[0]) and torch.equal(one, two[1]), m
        if act is None:
            ref = reference(x, p, g, bias)
            assert float((two[0].float() - ref).norm() / ref.norm()) <= TOL16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (4096, 11008), (22016, 4096)])
def test_gpu_preload_two_gives_the_same_bits(n, k, monkeypatch):
    """At the 7B shapes, for the configs the tables name and others: the same bits either way."""
    g = 128
    p = random_packed(n, k, g, seed=n + k)
    x = torch.randn(1, k, device="cuda").half()
    cfgs = [_cuda(4, 2, 2), _cuda(4, 4, 1), _tc(2, 4, 1), _tc(2, 8, 1), _tc(2, 16, 1)]
    for cfg in cfgs:
        if not cfg.valid_for(n, k, g):
            continue
        out = {}
        for preload in ("1", "2"):
            monkeypatch.setenv("VLMCTL_W4A16_GEMV_PRELOAD", preload)
            out[preload] = W.launch(x, p, g, cfg)
        assert torch.equal(out["1"], out["2"]), W.describe(cfg)
