"""gemv_tc for 2-8 rows of x (`w4a16_gemv_tc8` in `runtime/kernels/w4a16_mma.cu`; config "gemv_tc" with block_m 8):
the batch-1 tensor-core GEMV's arithmetic with B's eight columns eight rows of x, so that each column has its own
sums of x for the magic and the zero point. Opt-in (`VLMCTL_W4A16_GEMV_TC_BATCH`) until a GPU measures it against
mma_gemv, which selection runs at those rows.

The oracle is the fp32 reference of the dequantized weights (tests/w4a16_gpu_helpers.reference), and for one-hot rows
dequantize(W) itself. Without a GPU: its config rules, names, switch and selection; every instance compiles for sm_90
(where NVRTC is installed); with a C++ compiler its C++ on the CPU (tests/cuda_host.py, mma.sync emulated): odd
N, a last run cut short, groups of 128 and 256, bias, rows 2, 3, 8 and 11 (two blocks of rows, the second part
empty), x read only after the PDL wait, another order of blocks and warps giving the same bits. `gpu` tests run
the 7B shapes and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import capture, check_exact_dequantization, on_host, random_packed, reference

HAS_CUDA = torch.cuda.is_available()
TOL16 = 2 * 2.0 ** -11
HOST = cuda_host.unavailable()


def _cfg8(tiles, warps, stages):
    return W.Config("gemv_tc", block_n=16 * tiles, block_m=8, num_warps=warps, num_stages=stages)


def test_config_rules_and_names():
    assert _cfg8(2, 8, 1).valid_for(4096, 4096, 128)
    assert not W.Config("gemv_tc", block_n=32, block_m=16, num_warps=8, num_stages=1).valid_for(4096, 4096, 128)
    assert not _cfg8(2, 8, 1).valid_for(4096, 4096, 64)  # a 128-k chunk would hold two groups
    assert not _cfg8(4, 4, 2).valid_for(4096, 4096, 128)
    assert W.describe(_cfg8(2, 8, 1)) == "gemv_tc bm8 bn32 w8 s1"
    assert W.gemv_tc_kernel_name(_cfg8(2, 8, 1), 128, 4096) == "w4a16_gemv_tc8<2, 8, 1, 128, 4096>"
    with pytest.raises(ValueError, match="act·mul"):
        W.gemv_tc_kernel_name(_cfg8(2, 8, 1), 128, 4096, act="silu")


def test_switch(monkeypatch):
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC_BATCH", raising=False)
    assert W.gemv_tc_batch_mode() == "auto" and W.gemv_tc_batch_config(4096, 4096, 128) is None
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "0")
    assert W.gemv_tc_batch_config(4096, 4096, 128) is None
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "1")
    assert W.gemv_tc_batch_config(4096, 4096, 128) == _cfg8(2, 8, 1)
    assert W.gemv_tc_batch_config(4096, 4096, 64) is None
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "1:16:2")
    assert W.gemv_tc_batch_config(4096, 11008, 128) == _cfg8(1, 16, 2)
    assert W.gemv_tc_batch_config(4104, 4096, 128) is None  # N not a multiple of 16
    for bad in ("2", "3:4:1", "4:4:2", "x"):
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", bad)
        with pytest.raises(OptionError, match="VLMCTL_W4A16_GEMV_TC_BATCH"):
            W.gemv_tc_batch_mode()


def test_selection(monkeypatch, tmp_path):
    """Off by default (no entry is shipped); forced, fp16 rows 2-8 without act·mul only; a table entry of bucket 2-8
    with block_m 8 is taken, one for the batch-1 kernel is not; batch 1 is untouched by the switch."""
    n, k, g = 4096, 4096, 128
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)
    monkeypatch.setattr(W, "_mma_gemv_ok", lambda dtype, device: True)
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC", raising=False)
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC_BATCH", raising=False)
    for m in (2, 5, 8):
        assert W.select_config(m, n, k, g, torch.float16).kernel == "mma_gemv"
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "2:8:1")
    for m in (2, 5, 8):
        assert W.select_config(m, n, k, g, torch.float16) == _cfg8(2, 8, 1)
    assert W.select_config(1, n, k, g, torch.float16).block_m != 8
    assert W.select_config(9, n, k, g, torch.float16).kernel != "gemv_tc"  # bucket 16
    assert W.select_config(4, n, k, g, torch.bfloat16).kernel != "gemv_tc"
    assert W.select_config(4, n, k, g, torch.float16, act_mul=True).kernel != "gemv_tc"
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: False)  # the CPU, or no NVRTC
    assert W.select_config(4, n, k, g, torch.float16).kernel != "gemv_tc"
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)

    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC_BATCH")
    W._load_tuned_table()
    tables = (W._TUNED, *W._VARIANT_TABLES.values())
    saved = [dict(t) for t in tables]
    n = 4128  # a shape the shipped table does not hold
    try:
        W.set_config(8, n, k, g, torch.float16, _cfg8(1, 8, 2))
        assert W.select_config(8, n, k, g, torch.float16) == _cfg8(1, 8, 2)
        assert W.select_config(5, n, k, g, torch.float16) == _cfg8(1, 8, 2)  # bucket 8
        assert W.select_config(4, n, k, g, torch.float16).kernel == "mma_gemv"  # bucket 4: no entry
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "0")
        assert W.select_config(8, n, k, g, torch.float16).kernel == "mma_gemv"
        monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC_BATCH")
        W.set_config(4, n, k, g, torch.float16, W.Config("gemv_tc", block_n=16, num_warps=8, num_stages=2))
        assert W.select_config(4, n, k, g, torch.float16).kernel == "mma_gemv"  # the batch-1 kernel's config
        W.set_config(1, n, k, g, torch.float16, _cfg8(1, 8, 2))
        assert W.select_config(1, n, k, g, torch.float16).block_m != 8
        W.save_tuned(tmp_path / "t.json")
        for t in tables:
            t.clear()
        W.load_tuned(tmp_path / "t.json")
        assert W._TUNED_TC[(W._device_name(None), 8, n, k, g, "float16")] == _cfg8(1, 8, 2)
    finally:
        for t, s in zip(tables, saved):
            t.clear()
            t.update(s)


@pytest.mark.skipif(not cuda_rtc.available(), reason="needs NVRTC (the nvidia-cuda-nvrtc wheel)")
def test_instances_compile_for_sm90():
    names = [W.gemv_tc_kernel_name(_cfg8(t, w, s), g, k) for t, w, s in ((1, 4, 2), (2, 8, 1), (4, 16, 1))
             for g, k in ((128, 4096), (256, 11008 - 256))]
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), names, "sm_90")
    assert cubin and set(lowered) == set(names)


# ------------------------------------------------------------------------------------------ on the host


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("n,k,g,cfg", [(48, 384, 128, _cfg8(1, 2, 1)), (64, 1152, 128, _cfg8(2, 2, 2)),
                                       (128, 512, 256, _cfg8(4, 1, 1)), (32, 640, 128, _cfg8(1, 4, 4))], ids=str)
def test_on_the_host_matches_reference(n, k, g, cfg, monkeypatch):
    gen = torch.Generator().manual_seed(n + k)
    p = random_packed(n, k, g, seed=n * k, device="cpu")
    for m in (2, 3, 8, 11):
        x = torch.randn(m, k, generator=gen).half()
        x[-1] *= 50  # rows of different magnitudes: each column has its own sums of x
        for bias in (None, torch.randn(n, generator=gen).half()):
            outs = on_host(W._launch_gemv_cuda, x, p, g, cfg, bias, n, monkeypatch, seeds=(n, n + 1))
            ref = reference(x, p, g, bias)
            for r in range(m):
                err = float((outs[0][r].float() - ref[r]).norm() / ref[r].norm())
                assert err <= TOL16, (m, r, bias is not None, err)
            assert torch.equal(outs[0], outs[1]), (m, bias is not None)


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
def test_on_the_host_dequantizes_exactly(monkeypatch):
    """Eight one-hot rows a call (the block's eight columns), and 8 + 8 in two blocks of rows: each output is
    dequantize(W).half() bit for bit."""
    check_exact_dequantization(W._launch_gemv_cuda, _cfg8(2, 2, 1), torch.float16, 8, monkeypatch, n=32)
    check_exact_dequantization(W._launch_gemv_cuda, _cfg8(1, 4, 1), torch.float16, 16, monkeypatch, n=32)


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
def test_on_the_host_largest_activations(monkeypatch):
    """Codes 15 at zero 0 and scale 2^-14 against x at +-65504: the products cancel to 0 in every column, while
    a second row of x at 1 keeps its own sums."""
    monkeypatch.setattr(cuda_rtc, "load_kernel", cuda_host.HostRTC(guard=0, seed=5).load_kernel)
    n, k = 32, 512
    p = random_packed(n, k, 128, seed=3, device="cpu")
    p["q4weight"][:] = -1
    p["q4zeros"][:] = 0
    p["q4scales"][:] = 2.0 ** -14
    x = torch.full((2, k), 65504.0, dtype=torch.float16)
    x[0, 1::2] = -65504.0
    x[1] = 1.0
    y = torch.empty(2, n, dtype=torch.float16)
    W._launch_gemv_cuda(x, p, 128, _cfg8(2, 2, 2), None, y)
    assert bool(torch.isfinite(y).all()) and float(y[0].abs().max()) == 0.0
    assert bool((y[1].float() == 15 * 2.0 ** -14 * k).all())  # exact: 15 k scale, a power of two times 15


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,g", [(12288, 4096, 128), (4096, 11008, 128), (22016, 4096, 128), (1024, 3584, 256)])
@pytest.mark.parametrize("cfg", [_cfg8(1, 8, 2), _cfg8(2, 8, 1), _cfg8(2, 16, 1), _cfg8(4, 4, 1)], ids=W.describe)
def test_gpu_matches_reference(n, k, g, cfg):
    p = random_packed(n, k, g, seed=n + k)
    gen = torch.Generator(device="cuda").manual_seed(k)
    for m in (2, 5, 8, 12):
        x = torch.randn(m, k, device="cuda", generator=gen).half()
        for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
            ref = reference(x, p, g, bias)
            y = W.launch(x, p, g, cfg, bias)
            assert float((y.float() - ref).norm() / ref.norm()) <= TOL16, (m, bias is not None)
            assert torch.equal(W.launch(x, p, g, cfg, bias), y)  # deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_graphed_and_through_selection(monkeypatch):
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC_BATCH", "2:8:1")
    p = random_packed(4096, 4096, 128, seed=9)
    x = torch.randn(8, 4096, device="cuda").half()
    assert W.select_config(8, 4096, 4096, 128, torch.float16, x.device) == _cfg8(2, 8, 1)
    eager = W.w4a16_linear(x, p, 128)
    ref = reference(x, p, 128, None)
    assert float((eager.float() - ref).norm() / ref.norm()) <= TOL16
    graph, out = capture(lambda: W.w4a16_linear(x, p, 128))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
