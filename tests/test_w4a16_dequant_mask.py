"""dequant2's nibble mask from constant memory (session 56, opt-in): the batched W4A16 kernels (mma, mma_gemv, wgmma,
the fused steps) AND each word with 0x000F000F before the magic; as an immediate (the default), ptxas rebuilds that
mask in a register before most LOP3s. `VLMCTL_W4A16_DEQUANT_MASK=constant` reads it from constant memory, as the
batch-1 GEMVs do, until a GPU measures it. The value is the same, so the outputs must be the same bits either way.

Without a GPU: the switch and its errors; that it reaches every source built on `w4a16_mma.cu` (the wgmma source and
the fused steps' once kept the first build for the whole process); where NVRTC is installed, that the default build
does not read the mask from constant memory in mma_gemv, mma and wgmma and the switch's does; with a C++ compiler,
both builds of mma_gemv and mma on the CPU (tests/cuda_host.py) against each other and the fp32 reference. A `gpu`
test compares the two builds at the 7B shapes.
"""

from __future__ import annotations

import re

import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.runtime.kernels import cuda_rtc, flow_step, fused_step
from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import on_host, random_packed, reference

HOST = cuda_host.unavailable()
TOL16 = 2 * 2.0 ** -11
SWITCH = "VLMCTL_W4A16_DEQUANT_MASK"


@pytest.fixture
def plain_env(monkeypatch):
    for name in (SWITCH, "VLMCTL_W4A16_GEMV_PRELOAD", "VLMCTL_W4A16_GEMV_SCALE_PER_RUN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_switch_builds_its_own_source_and_rejects_bad_values(plain_env):
    plain = W.mma_source()
    assert "W4A16_DEQUANT_MASK_CONSTANT" not in plain.split("\n", 1)[0]
    plain_env.setenv(SWITCH, "immediate")
    assert W.mma_source() is plain
    plain_env.setenv(SWITCH, "Constant")
    const = W.mma_source()
    assert const is W.mma_source() and const == "#define W4A16_DEQUANT_MASK_CONSTANT\n" + plain
    plain_env.setenv("VLMCTL_W4A16_GEMV_PRELOAD", "2")  # the switches combine
    assert W.mma_source().split("\n")[:2] == ["#define W4A16_DEQUANT_MASK_CONSTANT", "#define W4A16_GEMV_PRELOAD 2"]
    plain_env.delenv("VLMCTL_W4A16_GEMV_PRELOAD")
    for bad in ("0", "const", "imm"):
        plain_env.setenv(SWITCH, bad)
        with pytest.raises(OptionError, match=SWITCH):
            W.mma_source()


def test_sources_built_on_the_mma_source_follow_the_switch(plain_env):
    """Each of them extends the mma source as built now, whichever was built first in the process."""
    builds = {}
    for value in ("immediate", "constant", "immediate"):
        plain_env.setenv(SWITCH, value)
        mma = W.mma_source()
        got = (W.wgmma_source(), W.wgmma_source("#define X 1\n"), fused_step.source(), flow_step.source())
        assert got[0].startswith(mma) and got[1] == "#define X 1\n" + got[0]
        assert got[2].startswith(mma) and got[3].startswith(got[2])
        assert got[0] is W.wgmma_source() and got[2] is fused_step.source()  # one object per build
        if value in builds:
            assert all(a is b for a, b in zip(got, builds[value]))
        builds[value] = got
    assert builds["constant"][0] != builds["immediate"][0]


def _instances():
    return [
        W.mma_gemv_kernel_name(W.Config("mma_gemv", block_n=16, block_m=8, num_warps=8, num_stages=1), 128),
        W.mma_gemv_kernel_name(W.Config("mma_gemv", block_n=16, block_m=8, num_warps=8, num_stages=3), 128,
                               torch.bfloat16),
        W.mma_kernel_name(W.Config("mma", block_n=64, block_k=64, block_m=16, num_warps=4, num_stages=4), 128),
    ]


def _const_loads(ptx: str, lowered_name: str) -> int:
    """`ld.const` instructions in one kernel's PTX body."""
    start = ptx.index(f".entry {lowered_name}(")
    end = ptx.find(".entry ", start + 1)
    return len(re.findall(r"\bld\.const\.", ptx[start:end if end > 0 else None]))


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_switch_reads_the_mask_from_constant_memory_and_the_default_does_not(plain_env):
    names = _instances()
    wg = W.wgmma_kernel_name(W.heuristic_wgmma_config(32), 128)
    loads = {}
    for value in ("immediate", "constant"):
        plain_env.setenv(SWITCH, value)
        ptx, lowered = cuda_rtc.compile_ptx(W.mma_source(), names, "sm_90")
        wptx, wlow = cuda_rtc.compile_ptx(W.wgmma_source(W.wgmma_build_defines(True)), [wg], "sm_90a")
        loads[value] = [_const_loads(ptx, lowered[n]) for n in names] + [_const_loads(wptx, wlow[wg])]
    assert all(n > 0 for n in loads["constant"]), loads
    assert loads["immediate"] == [0] * len(loads["constant"]), loads


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("kernel", ["mma_gemv", "mma"])
def test_on_the_host_both_builds_give_the_same_bits(kernel, plain_env):
    n, k, g = 72, 512, 128
    if kernel == "mma_gemv":
        cfg, launch = W.Config("mma_gemv", block_n=16, block_m=8, num_warps=2, num_stages=2), W._launch_mma_gemv
    else:
        cfg = W.Config("mma", block_n=32, block_k=64, block_m=16, num_warps=2, num_stages=2)
        launch = W._launch_mma
    assert cfg.valid_for(n, k, g)
    gen = torch.Generator().manual_seed(5)
    p = random_packed(n, k, g, seed=11, device="cpu")
    x = torch.randn(9, k, generator=gen).half()
    bias = torch.randn(n, generator=gen).half()
    ys = {}
    for value in ("constant", "immediate"):
        plain_env.setenv(SWITCH, value)
        ys[value] = on_host(launch, x, p, g, cfg, bias, n, plain_env, seeds=(0,))[0]
    assert torch.equal(ys["constant"], ys["immediate"])
    ref = reference(x, p, g, bias)
    assert float((ys["constant"].float() - ref).norm() / ref.norm()) <= TOL16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [8, 32, 64])
def test_gpu_both_builds_give_the_same_bits(n, k, m, plain_env):
    """The kernels selection runs at these rows (mma_gemv, mma or wgmma, by the card's table or rules)."""
    g = 128
    p = random_packed(n, k, g, seed=n + k)
    x = torch.randn(m, k, device="cuda").half()
    out = {}
    for value in ("constant", "immediate"):
        plain_env.setenv(SWITCH, value)
        out[value] = W.w4a16_linear(x, p, g)
    torch.cuda.synchronize()
    assert torch.equal(out["constant"], out["immediate"])
