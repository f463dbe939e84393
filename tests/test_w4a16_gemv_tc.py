"""The batch-1 GEMV on the tensor cores ("gemv_tc", `w4a16_gemv_tc` in `runtime/kernels/w4a16_mma.cu`), which
selection takes where the tuned table names it ("variant": "tc") or `VLMCTL_W4A16_GEMV_TC` forces it.

Its arithmetic differs from every other W4A16 kernel's: codes enter mma.sync as magic + code / 128, and the magic
and the zero point are taken out of each 128-k chunk's fp32 sum afterwards, through sums of x that a second mma
against constant A registers makes. So the tests check it against the fp32 reference, not against another
kernel. Without a GPU: its config rules, names, switch and selection; every instance compiles for sm_90 (where
NVRTC is installed); and with a C++ compiler its C++ on the CPU (tests/cuda_host.py, mma.sync emulated) against
the reference (odd N, a last run cut short, groups of 128 and 256, bias, M = 1 and 3, x read only after the PDL
wait), dequantizing exactly (one-hot rows), with fp16's largest activations; its act·mul epilogue on the CPU is
tested beside the CUDA GEMV's (tests/test_w4a16_gemv_cuda.py). `gpu` tests
run the same checks at the 7B shapes on the GPU, and a CUDA-graph replay bit for bit.
"""

from __future__ import annotations

import json

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


def _cfg(tiles, warps, stages):
    return W.Config("gemv_tc", block_n=16 * tiles, num_warps=warps, num_stages=stages)


def test_gemv_tc_config_rules_and_names():
    assert _cfg(2, 4, 2).valid_for(4096, 11008, 128)
    assert _cfg(1, 8, 4).valid_for(48, 384, 128)
    assert not _cfg(1, 8, 4).valid_for(45, 384, 128)  # N not a multiple of a block's rows
    assert not _cfg(4, 4, 1).valid_for(4128, 4096, 128)
    assert _cfg(4, 4, 1).valid_for(4096, 4096, 256)
    assert not _cfg(2, 4, 2).valid_for(4096, 4096, 64)  # a 128-k chunk would hold two groups
    assert not _cfg(2, 4, 2).valid_for(4096, 4160, 64)
    assert not _cfg(2, 4, 2).valid_for(4096, 4224, 256)  # K not a multiple of the group
    assert not _cfg(4, 4, 2).valid_for(4096, 4096, 128)  # 8 chunk-tiles a run: spills
    assert not _cfg(3, 4, 1).valid_for(4096, 4096, 128)
    assert not _cfg(2, 3, 1).valid_for(4096, 4096, 128)
    assert not W.Config("gemv_tc", block_n=24, num_warps=4, num_stages=1).valid_for(4096, 4096, 128)
    assert not W.Config("gemv_tc", block_n=32, num_warps=4, num_stages=1, split_k=2).valid_for(4096, 4096, 128)
    assert W.describe(_cfg(2, 4, 2)) == "gemv_tc bn32 w4 s2"
    assert W.gemv_tc_kernel_name(_cfg(2, 4, 2), 128, 4096) == "w4a16_gemv_tc<2, 4, 2, 128, 4096>"
    assert W.gemv_tc_kernel_name(_cfg(4, 8, 1), 256, 11008, act="gelu_tanh") == "w4a16_gemv_tc<4, 8, 1, 256, 11008, 1>"
    assert W._act_mul_tiles(_cfg(2, 4, 2)) and not W._act_mul_tiles(_cfg(1, 4, 2))
    assert W.heuristic_gemv_tc_config(4096, 4096, 128).valid_for(4096, 4096, 128)


def test_gemv_tc_switch(monkeypatch):
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC", raising=False)
    assert W.gemv_tc_mode() == "auto" and W.gemv_tc_config(4096, 4096, 128) is None  # the table decides
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "off")
    assert W.gemv_tc_mode() == "off" and W.gemv_tc_config(4096, 4096, 128) is None
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "1")
    assert W.gemv_tc_config(4096, 4096, 128) == W.heuristic_gemv_tc_config(4096, 4096, 128)
    assert W.gemv_tc_config(4096, 4096, 64) is None  # groups of 64: the shape does not fit
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "1:8:4")
    assert W.gemv_tc_config(4096, 4096, 128) == _cfg(1, 8, 4)
    assert W.gemv_tc_config(22016, 4096, 128, act_mul=True) is None  # 2 tiles x 4 chunks: too many registers
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "1:8:2")
    assert W.gemv_tc_config(22016, 4096, 128, act_mul=True) == _cfg(2, 8, 2)  # gate tiles and up tiles
    assert W.gemv_tc_config(4104, 4096, 128) is None  # N not a multiple of 16
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "4:4:1")
    assert W.gemv_tc_config(4160, 4096, 128) == _cfg(4, 4, 1)
    assert W.gemv_tc_config(4128, 4096, 128) is None  # N not a multiple of 64
    for bad in ("2", "yes", "2:4", "3:4:1", "4:4:2", "2:5:1", "a:b:c"):
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", bad)
        with pytest.raises(OptionError, match="VLMCTL_W4A16_GEMV_TC"):
            W.gemv_tc_mode()


def test_selection_takes_gemv_tc_only_where_switched_on_and_it_can_run(monkeypatch):
    n, k, g = 4096, 4096, 128
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC", raising=False)
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)
    assert W.select_config(1, n, k, g, torch.float16).kernel != "gemv_tc"
    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "2:4:2")
    assert W.select_config(1, n, k, g, torch.float16) == _cfg(2, 4, 2)
    assert W.select_config(1, n, k, g, torch.float16, act_mul=True) == _cfg(2, 4, 2)
    assert W.select_config(1, n, k, g, torch.bfloat16).kernel != "gemv_tc"  # fp16 only
    assert W.select_config(2, n, k, g, torch.float16).kernel != "gemv_tc"  # batch 1 only
    assert W.select_config(1, n, k, 64, torch.float16).kernel != "gemv_tc"  # groups of 64
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: False)  # e.g. the CPU, or no NVRTC
    assert W.select_config(1, n, k, g, torch.float16).kernel != "gemv_tc"


def test_table_entries_pick_gemv_tc_unless_switched_off(monkeypatch, tmp_path):
    """A "tc" entry of the tuned table (what `benchmarks/w4a16_gemv_tc_gpu.py --table-out` writes) wins over the
    CUDA GEMV's at fp16 batch 1 by default; with VLMCTL_W4A16_GEMV_TC=0 it is ignored; a gate_up entry with an odd
    number of tiles is not used for the act·mul call (it could not fuse); the table keeps its variant through a
    save and a load."""
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)
    monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC", raising=False)
    W._load_tuned_table()
    tables = (W._TUNED, *W._VARIANT_TABLES.values())
    saved = [dict(t) for t in tables]
    n, k, g = 4128, 4096, 128  # a shape the shipped table does not hold
    try:
        W.set_config(1, n, k, g, torch.float16, _cfg(1, 8, 2))
        assert W.select_config(1, n, k, g, torch.float16) == _cfg(1, 8, 2)
        assert W.select_config(1, n, k, g, torch.float16, act_mul=True).kernel == "gemv_cuda"  # 1 tile: no pairs
        assert W.select_config(2, n, k, g, torch.float16).kernel != "gemv_tc"
        monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "0")
        assert W.select_config(1, n, k, g, torch.float16).kernel == "gemv_cuda"
        monkeypatch.delenv("VLMCTL_W4A16_GEMV_TC")
        W.save_tuned(tmp_path / "t.json")
        for t in tables:
            t.clear()
        W.load_tuned(tmp_path / "t.json")
        assert W._TUNED_TC[(W._device_name(None), 1, n, k, g, "float16")] == _cfg(1, 8, 2)
    finally:
        for t, s in zip(tables, saved):
            t.clear()
            t.update(s)


def test_shipped_tc_entries():
    """The shipped table's gemv_tc entries (session 52, H100: the 7B decoder's qkv and gate_up, whose gate_up entry
    must pair gate tiles with up tiles to fuse its act·mul) are valid for their shapes and sit in their own table."""
    entries = [e for e in json.loads(W.TUNED_TABLE.read_text())["entries"] if e["config"]["kernel"] == "gemv_tc"]
    assert entries and all(e.get("variant") == "tc" and e["bucket"] == 1 and e["dtype"] == "float16" for e in entries)
    for e in entries:
        c = W.Config(**e["config"])
        assert c.valid_for(e["n"], e["k"], e["group_size"]) and W._act_mul_tiles(c), e
    assert {(e["device"], e["n"], e["k"]) for e in entries} == {("NVIDIA H100 80GB HBM3", 12288, 4096),
                                                                ("NVIDIA H100 80GB HBM3", 22016, 4096)}


@pytest.mark.skipif(not cuda_rtc.available(), reason="needs NVRTC (the nvidia-cuda-nvrtc wheel)")
def test_every_gemv_tc_instance_compiles_for_sm90():
    names = [W.gemv_tc_kernel_name(_cfg(t, w, s), g, k, act) for t, w, s in ((1, 4, 2), (2, 4, 2), (4, 8, 1))
             for g, k in ((128, 4096), (256, 11008 - 256)) for act in (None, "silu") if act is None or t % 2 == 0]
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), names, "sm_90")
    assert cubin and set(lowered) == set(names)


# ------------------------------------------------------------------------------------------ on the host


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("n,k,g,cfg", [(48, 384, 128, _cfg(1, 2, 1)), (64, 1152, 128, _cfg(2, 2, 2)),
                                       (128, 512, 256, _cfg(4, 1, 1)), (32, 640, 128, _cfg(1, 4, 4))], ids=str)
def test_on_the_host_gemv_tc_matches_reference(n, k, g, cfg, monkeypatch):
    """The kernel's C++ on the CPU through its launcher: within the fp16 tolerance of the fp32 reference, and the
    same bits for another order of its blocks and warps (the warps' sums meet in warp order)."""
    gen = torch.Generator().manual_seed(n + k)
    p = random_packed(n, k, g, seed=n * k, device="cpu")
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen).half()
        for bias in (None, torch.randn(n, generator=gen).half()):
            outs = on_host(W._launch_gemv_cuda, x, p, g, cfg, bias, n, monkeypatch, seeds=(n, n + 1))
            ref = reference(x, p, g, bias)
            assert float((outs[0].float() - ref).norm() / ref.norm()) <= TOL16, (m, bias is not None)
            assert torch.equal(outs[0], outs[1]), (m, bias is not None)


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
def test_on_the_host_gemv_tc_dequantizes_exactly(monkeypatch):
    """One-hot activation rows pick single weights out: (8 + code / 128) - 8 - zero / 128 is exact in fp32, so
    each output must be dequantize(W).half() bit for bit."""
    check_exact_dequantization(W._launch_gemv_cuda, _cfg(2, 2, 1), torch.float16, 64, monkeypatch, n=32)


def _large_activation_case(n, k):
    """Every code 15 at zero 0 and scale 2^-14, x at +-65504 alternately: the products are the largest fp16 x and
    codes allow and their sums cancel to 0, through fp32 sums of magic-sized values."""
    p = random_packed(n, k, 128, seed=3, device="cpu")
    p["q4weight"][:] = -1
    p["q4zeros"][:] = 0
    p["q4scales"][:] = 2.0 ** -14
    x = torch.full((1, k), 65504.0, dtype=torch.float16)
    x[0, 1::2] = -65504.0
    return p, x


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
def test_on_the_host_gemv_tc_largest_activations(monkeypatch):
    monkeypatch.setattr(cuda_rtc, "load_kernel", cuda_host.HostRTC(guard=0, seed=5).load_kernel)
    p, x = _large_activation_case(32, 512)
    y = torch.empty(1, 32, dtype=torch.float16)
    W._launch_gemv_cuda(x, p, 128, _cfg(2, 2, 2), None, y)
    assert bool(torch.isfinite(y).all()) and float(y.abs().max()) == 0.0


# ------------------------------------------------------------------------------------------ GPU

GPU_CFGS = [_cfg(1, 4, 2), _cfg(2, 4, 2), _cfg(2, 8, 1), _cfg(4, 4, 1), _cfg(1, 8, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,g", [(12288, 4096, 128), (4096, 11008, 128), (192, 4096, 128), (1024, 3584, 256),
                                   (22016, 4096, 128)])
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=W.describe)
def test_gpu_gemv_tc_matches_reference(n, k, g, cfg):
    p = random_packed(n, k, g, seed=n + k)
    gen = torch.Generator(device="cuda").manual_seed(k)
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", generator=gen).half()
        for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
            ref = reference(x, p, g, bias)
            y = W.launch(x, p, g, cfg, bias)
            assert float((y.float() - ref).norm() / ref.norm()) <= TOL16, (m, bias is not None)
            assert torch.equal(W.launch(x, p, g, cfg, bias), y)  # deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_gemv_tc_exact_large_and_graphed():
    """One-hot rows give dequantize(W).half() bit for bit; fp16's largest activations stay finite and cancel to 0;
    a CUDA-graph replay equals the eager call."""
    n, k, g = 256, 512, 128
    p = random_packed(n, k, g, seed=7)
    p["q4scales"] = p["q4scales"] * 700
    wd = W.dequantize(p, g, torch.float16)
    for k0 in range(0, k, 32):
        x = torch.zeros(32, k, device="cuda", dtype=torch.float16)
        x[torch.arange(32), k0 + torch.arange(32)] = 1
        assert torch.equal(W.launch(x, p, g, _cfg(2, 4, 2)), wd[:, k0:k0 + 32].T.contiguous())
    pl, xl = _large_activation_case(256, 4096)
    pl = {key: v.cuda() for key, v in pl.items()}
    yl = W.launch(xl.cuda(), pl, 128, _cfg(2, 4, 2))
    assert bool(torch.isfinite(yl).all()) and float(yl.abs().max()) == 0.0
    p = random_packed(4096, 4096, 128, seed=9)
    x = torch.randn(1, 4096, device="cuda").half()
    eager = W.launch(x, p, 128, _cfg(2, 4, 2))
    graph, out = capture(lambda: W.launch(x, p, 128, _cfg(2, 4, 2)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_gemv_tc_act_mul_and_the_switch(activation, monkeypatch):
    """With VLMCTL_W4A16_GEMV_TC set, `w4a16_act_mul` and `w4a16_linear` at batch 1 run gemv_tc: the epilogue
    against the act·mul kernel on the plain launch (within one fp16 rounding of the activation and the product)."""
    from vlmctl.runtime.kernels import fused

    monkeypatch.setenv("VLMCTL_W4A16_GEMV_TC", "2:4:2")
    n, k, g = 22016, 4096, 128
    p = random_packed(n, k, g, seed=11)
    x = torch.randn(1, k, device="cuda").half()
    assert W.select_config(1, n, k, g, torch.float16, x.device, act_mul=True) == _cfg(2, 4, 2)
    lin = W.w4a16_linear(x, p, g)
    ref = reference(x, p, g, None)
    assert float((lin.float() - ref).norm() / ref.norm()) <= TOL16
    want = fused.act_mul(lin, activation)
    got = W.w4a16_act_mul(x, p, g, activation)
    eps = torch.finfo(torch.float16).eps
    tol = 2 * eps * want.float().abs().clamp_min(2.0 ** -14) + lin[:, n // 2:].float().abs() * eps * 2
    assert bool(((got.float() - want.float()).abs() <= tol).all())
