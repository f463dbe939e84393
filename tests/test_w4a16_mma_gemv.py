"""The tensor-core GEMV for decode batches of 2-16 rows ("mma_gemv", `w4a16_mma_gemv` in
`runtime/kernels/w4a16_mma.cu`).

Selection takes it where the tuned table has an "mma_gemv" entry (on an H200: a 7B decoder's linears at
batches 2-16), unless `VLMCTL_W4A16_MMA_GEMV=0`. Without a GPU: its configs' validity rules, its table
entries and their round trip, the selection order (and that it is never picked where it cannot run), and
(where NVRTC is installed) that every instance the table names compiles for sm_90; with a C++ compiler, its
C++ on the CPU (tests/cuda_host.py) against the reference and dequantizing exactly. `gpu`-marked tests run
it against the dequantized fp32 reference (odd N, K up to 11008, groups 32-256, batch rows past a block,
bias, fp16 and bf16), check it dequantizes exactly (one-hot rows pick single weights out), that repeats
and a CUDA-graph replay are bit-identical, and that the switch selects it. tests/test_pdl.py checks a
chain of RMSNorm -> mma_gemv launches with programmatic dependent launch against plain launches.
"""

from __future__ import annotations

import json

import pytest
import torch

from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

import cuda_host
from w4a16_gpu_helpers import capture, check_exact_dequantization, on_host, random_packed, reference

HAS_CUDA = torch.cuda.is_available()
TOL16 = 2 * 2.0 ** -11
TOL_BF16 = 2 * 2.0 ** -8


def _cfg(rows, warps, stages):
    return W.Config("mma_gemv", block_n=16, block_m=rows, num_warps=warps, num_stages=stages)


def test_mma_gemv_config_rules():
    assert _cfg(8, 8, 3).valid_for(4096, 4096, 128)
    assert _cfg(16, 2, 1).valid_for(4100, 11008, 32)  # N not a multiple of 16, groups of 32
    assert _cfg(8, 4, 4).valid_for(136, 512, 256)
    assert not _cfg(8, 8, 3).valid_for(4096, 4160, 64)  # K not a multiple of 128
    assert not _cfg(8, 8, 3).valid_for(4096, 4096, 48)  # a lane's 32 k would straddle groups
    assert not _cfg(32, 8, 3).valid_for(4096, 4096, 128)  # 8 or 16 batch rows per block
    assert not _cfg(8, 8, 5).valid_for(4096, 4096, 128)  # 1-4 chunks in flight
    assert not _cfg(8, 3, 2).valid_for(4096, 4096, 128)
    assert not W.Config("mma_gemv", block_n=32, block_m=8, num_warps=8, num_stages=2).valid_for(4096, 4096, 128)
    assert not W.Config("mma_gemv", block_n=16, block_m=8, num_warps=8, num_stages=2,
                        split_k=2).valid_for(4096, 4096, 128)
    assert W.describe(_cfg(8, 8, 3)) == "mma_gemv bm8 w8 s3"
    assert W.mma_gemv_kernel_name(_cfg(16, 4, 2), 64) == "w4a16_mma_gemv<4, 2, 2, 64, 0>"
    assert W.mma_gemv_kernel_name(_cfg(8, 8, 3), 128, torch.bfloat16) == "w4a16_mma_gemv<8, 1, 3, 128, 1>"


def _tuned_entries():
    return [e for e in json.loads(W.TUNED_TABLE.read_text())["entries"] if e["config"]["kernel"] == "mma_gemv"]


def test_tuned_table_mma_gemv_entries():
    """The shipped table's mma_gemv entries are valid, sit in their own variant table, and cover the 7B
    decoder's linears at buckets 2-8 in fp16 (what session 12's H200 sweep measured as faster)."""
    entries = _tuned_entries()
    assert entries and all(e.get("variant") == "mma_gemv" for e in entries)
    for e in entries:
        assert W.Config(**e["config"]).valid_for(e["n"], e["k"], e["group_size"]), e
    covered = {(e["bucket"], e["n"], e["k"]) for e in entries if e["dtype"] == "float16"}
    for b in (2, 4, 8):
        for nk in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):
            assert (b, *nk) in covered


def test_table_round_trip_keeps_the_variant(tmp_path):
    W._load_tuned_table()  # now, so that set_config's own first load does not refill the cleared tables
    tables = (W._TUNED, *W._VARIANT_TABLES.values())  # every table save_tuned writes
    saved = [dict(t) for t in tables]
    try:
        for t in tables:
            t.clear()
        mma = W.Config("mma", block_n=128, block_k=64, block_m=16, split_k=4, num_warps=8, num_stages=4)
        W.set_config(8, 4096, 4096, 128, torch.float16, mma)
        W.set_config(8, 4096, 4096, 128, torch.float16, _cfg(8, 8, 3))  # same key, its own table
        W.save_tuned(tmp_path / "t.json")
        for t in tables:
            t.clear()
        assert W.load_tuned(tmp_path / "t.json") == 2
        assert list(W._TUNED.values()) == [mma] and list(W._TUNED_MMA_GEMV.values()) == [_cfg(8, 8, 3)]
    finally:
        for t, s in zip(tables, saved):
            t.clear()
            t.update(s)


def test_selection_order_and_switch(monkeypatch):
    """Where it may run (the probe answers yes here): its entry wins over the main table's for the same key,
    and untabled shapes take its rule at 2-8 rows (and one bf16 row); with VLMCTL_W4A16_MMA_GEMV=0 neither;
    on the CPU (the real probe) never; at fp16 batch 1 the CUDA GEMV's entry still comes first."""
    n, k, g = 4104, 4096, 128  # a shape the shipped table does not hold
    mma = W.Config("mma", block_n=128, block_k=64, block_m=16, split_k=4, num_warps=8, num_stages=4)
    cu = W.Config("gemv_cuda", block_n=16, num_warps=4, num_stages=2)
    tables = (W._TUNED, W._TUNED_CUDA, W._TUNED_MMA_GEMV)
    saved = [dict(t) for t in tables]
    try:
        for m in (1, 8):
            W.set_config(m, n, k, g, torch.float16, mma)
            W.set_config(m, n, k, g, torch.float16, _cfg(8, 8, 3))
        W.set_config(1, n, k, g, torch.float16, cu)
        assert W.select_config(8, n, k, g, torch.float16).kernel == "mma"  # the CPU: cannot run
        monkeypatch.setattr(W, "_mma_gemv_ok", lambda dtype, device: W.mma_gemv_enabled())
        monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)
        monkeypatch.delenv("VLMCTL_W4A16_MMA_GEMV", raising=False)
        assert W.select_config(8, n, k, g, torch.float16) == _cfg(8, 8, 3)
        assert W.select_config(5, n, k, g, torch.float16) == _cfg(8, 8, 3)  # same bucket
        assert W.select_config(1, n, k, g, torch.float16) == cu
        assert W.select_config(16, n, k, g, torch.float16).kernel != "mma_gemv"  # no entry for bucket 16
        # untabled: the rule at 2-8 rows (fp16, bf16) and at one bf16 row; not at 16 rows, not for a K the
        # kernel cannot take
        rule = W.heuristic_mma_gemv_config(n, k, g)
        for m, dt in ((2, torch.float16), (4, torch.bfloat16), (1, torch.bfloat16)):
            assert W.select_config(m, n, 4224, g, dt) == W.heuristic_mma_gemv_config(n, 4224, g)
        assert W.select_config(16, n, 4224, g, torch.float16).kernel != "mma_gemv"
        assert W.select_config(4, n, 4160, 64, torch.float16).kernel != "mma_gemv"  # K % 128 != 0
        assert (rule.num_stages, W.heuristic_mma_gemv_config(12288, k, g).num_stages) == (3, 1)
        monkeypatch.setenv("VLMCTL_W4A16_MMA_GEMV", "0")
        assert W.select_config(8, n, k, g, torch.float16) == mma
        assert W.select_config(2, n, 4224, g, torch.float16).kernel != "mma_gemv"
    finally:
        for t, s in zip(tables, saved):
            t.clear()
            t.update(s)


def test_mma_gemv_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("VLMCTL_W4A16_MMA_GEMV", raising=False)
    assert W.mma_gemv_enabled()
    for v, on in (("1", True), ("", True), ("0", False), ("off", False), ("false", False)):
        monkeypatch.setenv("VLMCTL_W4A16_MMA_GEMV", v)
        assert W.mma_gemv_enabled() is on


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_tuned_and_bf16_instances_compile_for_sm90():
    names = {W.mma_gemv_kernel_name(W.Config(**e["config"]), e["group_size"], e["dtype"]) for e in _tuned_entries()}
    names |= {W.mma_gemv_kernel_name(_cfg(rows, 8, 3), g, torch.bfloat16) for rows in (8, 16) for g in (32, 256)}
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), sorted(names), "sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == names
    assert all(v.startswith("_Z14w4a16_mma_gemv") for v in lowered.values())


# ------------------------------------------------------------------------------------------ on the host

HOST = cuda_host.unavailable()


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k,g,cfg", [(72, 256, 32, _cfg(8, 8, 3)), (136, 512, 256, _cfg(16, 4, 2)),
                                       (40, 384, 64, _cfg(8, 2, 4))], ids=str)
def test_on_the_host_against_reference(dtype, n, k, g, cfg, monkeypatch):
    """The kernel's C++ on the CPU (tests/cuda_host.py, its mma.sync and the packed layout emulated) through its
    launcher: within the reference's tolerance for batch rows past a block and odd N, with and without bias, and
    the same bits for another order of blocks and threads; x read only after the PDL wait."""
    tol = TOL16 if dtype == torch.float16 else TOL_BF16
    gen = torch.Generator().manual_seed(n * k + g)
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    for m in (1, 2, 9, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            ys = on_host(W._launch_mma_gemv, x, p, g, cfg, bias, n, monkeypatch)
            ref = reference(x, p, g, bias)
            err = float((ys[0].float() - ref).norm() / ref.norm())
            assert err <= tol, f"M={m} bias={bias is not None}: relative error {err:.2e}"
            assert torch.equal(ys[0], ys[1])


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_on_the_host_dequantizes_exactly(dtype, monkeypatch):
    """As the GPU test below: one-hot rows pick single weights out, dequantize(W).to(dtype) bit for bit."""
    check_exact_dequantization(W._launch_mma_gemv, _cfg(16, 4, 2), dtype, 16, monkeypatch, n=32)


# ------------------------------------------------------------------------------------------ GPU


GPU_CFGS = [_cfg(8, 8, 3), _cfg(8, 8, 1), _cfg(16, 4, 2), _cfg(8, 2, 4), _cfg(16, 8, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (4096, 11008, 128), (200, 384, 64), (72, 256, 32),
                                   (136, 512, 256), (4100, 4096, 64), (22016, 4096, 128)])
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=W.describe)
def test_gpu_mma_gemv_matches_reference(dtype, n, k, g, cfg):
    tol = TOL16 if dtype == torch.float16 else TOL_BF16
    gen = torch.Generator(device="cuda").manual_seed(n * k + g)
    p = random_packed(n, k, g, seed=n + k)
    for m in (1, 2, 5, 8, 9, 16, 17, 40):
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        for bias in (None, torch.randn(n, device="cuda", generator=gen).to(dtype)):
            y = W.launch(x, p, g, cfg, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            ref = reference(x, p, g, bias)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= tol, f"M={m} bias={bias is not None}: relative error {err:.2e}"
            assert torch.equal(y, W.launch(x, p, g, cfg, bias)), "the warps' sums are added in a fixed order"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [_cfg(8, 4, 2), _cfg(16, 8, 3)], ids=W.describe)
def test_gpu_mma_gemv_dequantizes_exactly(dtype, cfg):
    """Rows of the identity pick single weights out: with one 1.0 per row the kernel must return
    dequantize(W).to(dtype) bit for bit, whatever the permuted order it sums K in."""
    n, k, g = 256, 512, 128
    p = random_packed(n, k, g, seed=7)
    p["q4scales"] = p["q4scales"] * 700  # scales whose products need the final rounding to the dtype
    wd = W.dequantize(p, g, dtype)
    for k0 in range(0, k, 16):
        x = torch.zeros(16, k, device="cuda", dtype=dtype)
        x[torch.arange(16), k0 + torch.arange(16)] = 1
        y = W.launch(x, p, g, cfg)
        assert torch.equal(y, wd[:, k0:k0 + 16].T.contiguous()), f"columns {k0}..{k0 + 15}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mma_gemv_graph_and_selection(monkeypatch):
    """A CUDA-graph replay equals the eager result; the 7B qkv at batch 4 selects it from the table, and
    with VLMCTL_W4A16_MMA_GEMV=0 something else that matches the reference as well."""
    dev = torch.device("cuda")
    n, k, g = 12288, 4096, 128
    p = random_packed(n, k, g, seed=3)
    x = torch.randn(4, k, device="cuda").half()
    cfg = W.select_config(4, n, k, g, torch.float16, dev)
    assert cfg.kernel == "mma_gemv"
    ref = W.launch(x, p, g, cfg)
    y = torch.empty_like(ref)
    graph, _ = capture(lambda: W.launch(x, p, g, cfg, out=y))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    r = reference(x, p, g, None)
    monkeypatch.setenv("VLMCTL_W4A16_MMA_GEMV", "0")
    other = W.select_config(4, n, k, g, torch.float16, dev)
    assert other.kernel != "mma_gemv"
    y2 = W.w4a16_linear(x, p, g)
    for out in (ref, y2):
        assert float((out.float() - r).norm() / r.norm()) <= TOL16
