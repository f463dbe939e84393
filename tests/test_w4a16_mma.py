"""The CUDA W4A16 kernel ("mma", `runtime/kernels/w4a16_mma.cu`, compiled at run time by NVRTC).

Without a GPU: its configs' validity rules, its shared-memory sizing, that selection never picks it
where it cannot run, and (where NVRTC is installed, e.g. `pip install nvidia-cuda-nvrtc`) that every
template instance the tuned table names compiles for sm_90 without spilling. With a C++ compiler, its C++
runs on the CPU (tests/cuda_host.py) against the reference, split-K included. `gpu`-marked tests run
it against the dequantized fp32 reference (odd N, partial M tiles, both group sizes, bias, split-K),
check that split-K results are deterministic, that a CUDA-graph replay gives the same output, and
that `VLMCTL_W4A16_MMA=0` falls back to the Triton kernels.
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


def _mma(bm, bn, warps, stages, split, wm=1, bk=64):
    return W.Config("mma", block_n=bn, block_k=bk, block_m=bm, split_k=split, num_warps=warps, num_stages=stages,
                    warps_m=wm)


def test_mma_config_rules():
    assert _mma(64, 128, 4, 4, 2).valid_for(4096, 4096, 128)
    assert _mma(64, 64, 8, 4, 2, wm=2).valid_for(4096, 4096, 64)
    assert not _mma(64, 128, 4, 4, 1).valid_for(4096, 4096, 32)  # groups must hold whole 64-wide chunks
    assert not _mma(64, 128, 4, 4, 1).valid_for(4100, 4096, 128)  # N a multiple of 8 (half2 stores)
    assert not _mma(64, 256, 2, 4, 1).valid_for(4096, 4096, 128)  # 4 m-tiles x 16 n-tiles: would spill
    assert not _mma(48, 128, 4, 4, 1, wm=2).valid_for(4096, 4096, 128)  # 48 rows do not split over 2 warps
    assert _mma(16, 128, 4, 4, 2, bk=256).valid_for(4096, 4096, 128)  # a chunk of two groups
    assert _mma(16, 128, 4, 4, 2, bk=128).valid_for(4096, 4096, 64)
    assert not _mma(16, 128, 4, 4, 1, bk=256).valid_for(4096, 4224, 128)  # K must hold whole 256-wide chunks
    assert not _mma(16, 128, 4, 4, 1, bk=32).valid_for(4096, 4096, 128)
    assert W.mma_kernel_name(_mma(64, 64, 8, 3, 4, wm=2), 128) == "w4a16_mma<2, 2, 2, 4, 3, 128, 64, 0>"
    assert W.mma_kernel_name(_mma(16, 128, 4, 4, 1, bk=256), 64) == "w4a16_mma<1, 4, 1, 4, 4, 64, 256, 0>"
    assert "wm2" in W.describe(_mma(64, 64, 8, 3, 4, wm=2))


def test_mma_shared_memory_sizing():
    # x rows of 64 + 8 halfs and weight rows of 8 + 4 words per stage (the .cu's padding)
    ring = 4 * (64 * 72 * 2 + 128 * 12 * 4)
    assert W.mma_shared_bytes(_mma(64, 128, 4, 4, 1), 32) == ring + 128 * 32 * 3  # + a fp16 scale, a uint8 zero
    ring = 3 * (16 * 136 * 2 + 64 * 20 * 4)  # 128-wide chunks: 128 + 8 halfs, 16 + 4 words
    assert W.mma_shared_bytes(_mma(16, 64, 2, 3, 1, bk=128), 8) == ring + 64 * 8 * 3


def test_selection_falls_back_where_mma_cannot_run(monkeypatch):
    """On the CPU (no GPU name in the table) nothing selects it; with it switched off it is unavailable."""
    assert W.select_config(16, 12288, 4096, 128, torch.float16).kernel != "mma"
    monkeypatch.setenv("VLMCTL_W4A16_MMA", "0")
    assert not W.mma_available()


# decoder linears (N, K) of models whose shapes the tuned table does not hold: Qwen2-VL-7B, LLaVA-1.6-Mistral-7B,
# LLaVA-1.5-13B, SmolLM2-135M (qkv, o, gate_up, down)
OTHER_SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (6144, 4096), (28672, 4096),
                (4096, 14336), (15360, 5120), (5120, 5120), (27648, 5120), (5120, 13824), (960, 576),
                (576, 576), (3072, 576), (576, 1536)]


def test_mma_heuristic_reproduces_the_measured_choices():
    """For each LLaVA-1.5-7B linear, the untabled-shape rule (fp16) picks a block shape and split-K that
    the H200 sweep chose for that shape at one of the batches 2-16 (the shipped table is measured data,
    not this rule's output)."""
    data = json.loads(W.TUNED_TABLE.read_text())
    chosen = {}
    for e in data["entries"]:
        c = e["config"]
        if e["device"] == "NVIDIA H200" and e["dtype"] == "float16" and 2 <= e["bucket"] <= 16 and c["kernel"] == "mma":
            chosen.setdefault((e["n"], e["k"]), set()).add((c["block_n"], c["num_warps"], c["split_k"]))
    assert len(chosen) == 4
    for (n, k), seen in chosen.items():
        h = W.heuristic_mma_config(n, k, 128, 132)
        assert h.block_m == 16 and (h.block_n, h.num_warps, h.split_k) in seen, (n, k, h, seen)


@pytest.mark.parametrize("g", [64, 128])
def test_mma_heuristic_fits_other_models(g):
    for n, k in OTHER_SHAPES:
        if k % g:
            continue  # no quantization of this model uses that group size
        for sms in (132, 108, 78):
            c = W.heuristic_mma_config(n, k, g, sms)
            assert c.valid_for(n, k, g), (n, k, g, c)
            unit = max(c.block_k, g)
            max_groups = -(-(k // unit) // c.split_k) * (unit // g)
            assert W.mma_shared_bytes(c, max_groups) <= W.MMA_MAX_SHARED
            for m in (2, 5, 16):
                assert W.heuristic_config(m, n, k, g, sms, mma=True) == c
            b = W.heuristic_mma_config(n, k, g, sms, torch.bfloat16)
            assert b.valid_for(n, k, g) and (b.block_n, b.num_warps) == (64, 4)
            for m in (1, 17, 64):
                assert W.heuristic_config(m, n, k, g, sms, mma=True).kernel != "mma"
    # where the CUDA kernel cannot take the shape (a group of 32, N not a multiple of 8), Triton does
    assert W.heuristic_config(8, 4096, 4096, 32, mma=True).kernel == "dot"
    assert W.heuristic_config(8, 4100, 4096, 128, mma=True).kernel == "dot"


def _tuned_mma_names():
    data = json.loads(W.TUNED_TABLE.read_text())
    names = set()
    for e in data["entries"]:
        if e["config"]["kernel"] == "mma":
            c = W.Config(**e["config"])
            assert c.valid_for(e["n"], e["k"], e["group_size"]), e
            names.add(W.mma_kernel_name(c, e["group_size"], e["dtype"]))
    return sorted(names)


def test_tuned_table_mma_entries_are_valid():
    assert _tuned_mma_names(), "the shipped table has no mma entries"


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_tuned_instances_compile_for_sm90_without_spills():
    names = _tuned_mma_names()
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), names, "sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(names)
    assert all(v.startswith("_Z9w4a16_mma") for v in lowered.values())


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_bf16_instances_compile_for_sm90():
    cfgs = [_mma(16, 128, 8, 4, 4, bk=128), _mma(32, 64, 4, 4, 8), _mma(64, 64, 8, 3, 2, wm=2, bk=256)]
    names = [W.mma_kernel_name(c, 128, torch.bfloat16) for c in cfgs]
    assert all(n.endswith(", 1>") for n in names)
    cubin, lowered = cuda_rtc.compile_cubin(W.mma_source(), names, "sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(names)


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_compile_error_carries_the_log():
    with pytest.raises(cuda_rtc.RtcError, match="could not compile"):
        cuda_rtc.compile_cubin("__global__ void k() { undefined_thing(); }", ["k"], "sm_90")


TOL_BF16 = 2 * 2.0 ** -8  # bf16 keeps 8 significant bits

# ------------------------------------------------------------------------------------------ on the host

HOST = cuda_host.unavailable()


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k,g,cfg", [(200, 192, 64, _mma(16, 64, 4, 4, 1)), (72, 512, 128, _mma(32, 64, 4, 3, 3)),
                                       (40, 256, 64, _mma(64, 64, 8, 6, 2, wm=2)),
                                       (24, 512, 128, _mma(32, 64, 4, 3, 2, bk=256))], ids=str)
def test_on_the_host_against_reference(dtype, n, k, g, cfg, monkeypatch):
    """The kernel's C++ on the CPU (tests/cuda_host.py: its cp.async ring, ldmatrix and mma.sync emulated) through
    its launcher: partial M tiles, odd N, groups 64 and 128, bias, split-K with the last block reducing; within
    the reference's tolerance, and the same bits when the splits' blocks finish in another order."""
    tol = TOL16 if dtype == torch.float16 else TOL_BF16
    p = random_packed(n, k, g, seed=n + k, device="cpu")
    gen = torch.Generator().manual_seed(1)
    for m in (1, 17, 40):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            ys = on_host(W._launch_mma, x, p, g, cfg, bias, n, monkeypatch)
            ref = reference(x, p, g, bias)
            err = float((ys[0].float() - ref).norm() / ref.norm())
            assert err <= tol, f"M={m}: relative error {err:.2e}"
            assert torch.equal(ys[0], ys[1]), "split-K results must not depend on the blocks' order"


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernels cannot run on the host: {HOST}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_on_the_host_dequantizes_exactly(dtype, monkeypatch):
    """As the GPU test below: rows of the identity return dequantize(W).to(dtype) bit for bit."""
    check_exact_dequantization(W._launch_mma, _mma(32, 64, 4, 4, 3, bk=128), dtype, 32, monkeypatch)


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (4096, 11008, 128), (200, 192, 64), (72, 128, 128),
                                   (12288, 4096, 64)])
@pytest.mark.parametrize("cfg", [_mma(16, 128, 4, 4, 1), _mma(32, 64, 4, 3, 3), _mma(64, 128, 8, 4, 4),
                                 _mma(64, 64, 8, 6, 2, wm=2), _mma(48, 32, 2, 3, 1), _mma(16, 128, 8, 4, 3, bk=128),
                                 _mma(32, 64, 4, 3, 2, bk=256), _mma(64, 128, 8, 3, 2, bk=128)], ids=W.describe)
def test_gpu_mma_matches_reference(n, k, g, cfg):
    if not cfg.valid_for(n, k, g):
        pytest.skip(f"{W.describe(cfg)} does not fit K={k}, G={g}")
    p = random_packed(n, k, g, seed=n + k)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 5, 16, 17, 40, 64, 100):
        x = torch.randn(m, k, generator=gen, device="cuda").half()
        for bias in (None, torch.randn(n, generator=gen, device="cuda").half()):
            y = W.launch(x, p, g, cfg, bias)
            ref = reference(x, p, g, bias)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOL16, f"M={m}: relative error {err:.2e}"
            assert torch.equal(y, W.launch(x, p, g, cfg, bias)), "split-K results must not depend on timing"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (4096, 11008, 128), (200, 192, 64)])
@pytest.mark.parametrize("cfg", [_mma(16, 128, 4, 4, 1), _mma(32, 64, 4, 3, 3, bk=128), _mma(64, 64, 8, 6, 2, wm=2),
                                 _mma(32, 64, 4, 3, 2, bk=256)], ids=W.describe)
def test_gpu_mma_bf16_matches_reference(n, k, g, cfg):
    if not cfg.valid_for(n, k, g):
        pytest.skip(f"{W.describe(cfg)} does not fit K={k}, G={g}")
    p = random_packed(n, k, g, seed=n + k)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for m in (1, 5, 17, 40, 64):
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        for bias in (None, torch.randn(n, generator=gen, device="cuda").bfloat16()):
            y = W.launch(x, p, g, cfg, bias)
            assert y.dtype == torch.bfloat16
            ref = reference(x, p, g, bias)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOL_BF16, f"M={m}: relative error {err:.2e}"
            assert torch.equal(y, W.launch(x, p, g, cfg, bias))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [_mma(16, 64, 4, 4, 1), _mma(32, 64, 4, 4, 3, bk=128)], ids=W.describe)
def test_gpu_mma_dequantizes_exactly(dtype, cfg):
    """Rows of the identity pick single weights out: each output is one dequantized weight times 1.0, so
    the kernel must return dequantize(W).to(dtype) bit for bit (its rounding, not just its tolerance)."""
    n, k, g = 256, 512, 128
    p = random_packed(n, k, g, seed=7)
    p["q4scales"] = p["q4scales"] * 700  # scales whose products need the final rounding to the dtype
    wd = W.dequantize(p, g, dtype)
    for k0 in range(0, k, 32):
        x = torch.zeros(32, k, device="cuda", dtype=dtype)
        x[torch.arange(32), k0 + torch.arange(32)] = 1
        y = W.launch(x, p, g, cfg)
        assert torch.equal(y, wd[:, k0:k0 + 32].T.contiguous()), f"columns {k0}..{k0 + 31}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_untabled_shapes_take_the_mma_heuristic(monkeypatch, dtype):
    """Shapes the tuned table does not hold run the mma kernel at 9-16 rows (Qwen2-VL-7B's qkv and down;
    2-8 rows take the tensor-core GEMV's rule, or the mma kernel with VLMCTL_W4A16_MMA_GEMV=0), matching
    the reference; with VLMCTL_W4A16_MMA_HEURISTIC=0 they stay on Triton."""
    tol = TOL16 if dtype == torch.float16 else TOL_BF16
    dev = torch.device("cuda")
    monkeypatch.setenv("VLMCTL_W4A16_MMA_GEMV", "0")
    for n, k in ((4608, 3584), (3584, 18944)):
        p = random_packed(n, k, 128, seed=n)
        for m in (2, 7, 16):
            assert W.select_config(m, n, k, 128, dtype, dev).kernel == "mma"
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = reference(x, p, 128, None)
            y = W.w4a16_linear(x, p, 128)
            assert float((y.float() - ref).norm() / ref.norm()) <= tol
        assert W.select_config(1, n, k, 128, dtype, dev).kernel != "mma"
    monkeypatch.setenv("VLMCTL_W4A16_MMA_HEURISTIC", "0")
    assert W.select_config(8, 4608, 3584, 128, dtype, dev).kernel == "dot"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mma_cuda_graph_and_switch(monkeypatch):
    p = random_packed(4096, 4096, 128, seed=3)
    x = torch.randn(64, 4096, device="cuda").half()
    cfg = _mma(64, 128, 8, 4, 4)
    ref = W.launch(x, p, 128, cfg)
    y = torch.empty_like(ref)
    graph, _ = capture(lambda: W.launch(x, p, 128, cfg, out=y))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    monkeypatch.setenv("VLMCTL_W4A16_MMA", "0")
    with pytest.raises(ValueError, match="mma kernel needs"):
        W.launch(x, p, 128, cfg)
    y2 = W.w4a16_linear(x[:8], p, 128)  # whatever the table says, it runs (Triton) with mma off
    r = reference(x[:8], p, 128, None)
    assert float((y2.float() - r).norm() / r.norm()) <= TOL16


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bk", [64, 256])
def test_gpu_mma_pdl_chain_waits_for_its_input(monkeypatch, bk):
    """Launched with programmatic dependent launch, a kernel may start before the one that writes its
    input ends: a chain of linears, each reading the last one's output, must still equal the chain run
    without PDL (eager and replayed as a CUDA graph)."""
    from vlmctl.runtime.kernels import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("this GPU (or Triton) has no programmatic dependent launch")
    ps = [random_packed(4096, 4096, 128, seed=10 + i) for i in range(6)]
    cfg = _mma(16, 128, 8, 4, 2, bk=bk)
    x = torch.randn(8, 4096, device="cuda").half() * 4

    def chain():
        h = x
        for p in ps:
            h = W.launch(h, p, 128, cfg) * 0.5  # the next kernel reads the product (a torch kernel in between)
            h = W.launch(h, p, 128, cfg)  # and directly another mma output
        return h

    monkeypatch.setenv("VLMCTL_W4A16_MMA_PDL", "0")
    ref = chain()
    monkeypatch.setenv("VLMCTL_W4A16_MMA_PDL", "1")
    assert W.mma_pdl(x.device)
    for _ in range(3):
        assert torch.equal(chain(), ref)
    graph, out = capture(chain)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_launch_structs_match_cuda_h():
    """cuLaunchKernelEx's structs as cuda.h lays them out on 64-bit Linux (an offset off here would make
    the driver read garbage or refuse the launch); the PDL attribute is id 6 with the flag in the union."""
    import ctypes

    assert ctypes.sizeof(cuda_rtc._LaunchAttribute) == 72  # id, 4 bytes of padding, 64-byte union
    cfg = cuda_rtc._LaunchConfig
    assert (cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset, ctypes.sizeof(cfg)) == (32, 40, 48, 56)
    a = cuda_rtc._pdl_attribute()
    raw = bytes(a)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little") and not any(raw[12:])
