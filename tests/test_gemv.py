"""The dense Triton GEMV (vlmctl.runtime.kernels.gemv): y = x @ W^T (+ bias) for M <= 4, with split-K
reduced in-kernel and the optional SiLU·mul prologue read from a gate_up row.

Reference: float64 torch from the same fp16 inputs, computed here without the kernel (for the SiLU
prologue: silu(g) * u in float64, rounded to fp16 as the kernel rounds the activation it multiplies).
Bound, on the norm-wise relative error: 2**-10. The kernel accumulates fp16 products exactly in fp32
(~2**-24 * sqrt(K) of order-dependent error), so what remains is the final rounding of y to fp16 (at
most 2**-11 per element); with the prologue, silu in fp32 (exp's few ulp of fp32) and the rounding
of x to fp16 (2**-11 per element, random across K) add at most about as much again.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest) on small
shapes; `gpu`-marked tests run LLaVA-1.5-7B shapes and CUDA-graph capture on a GPU.
"""

from __future__ import annotations


import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.runtime.kernels import gemv as G

HAS_CUDA = torch.cuda.is_available()
TOL = 2.0 ** -10
LLAVA_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


@pytest.fixture
def dev(triton_device):
    return triton_device


def _ref(x, w, bias, silu):
    xd = x.double()
    if silu:
        g, u = xd.chunk(2, -1)
        xd = (g * torch.sigmoid(g) * u).to(x.dtype).double()
    y = xd @ w.double().T
    return y + bias.double() if bias is not None else y


def _check(y, x, w, bias, silu, tol=TOL):
    ref = _ref(x.cpu(), w.cpu(), None if bias is None else bias.cpu(), silu)
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(ref.shape)
    err = float((y.cpu().double() - ref).norm() / ref.norm())
    assert err <= tol, f"relative error {err:.2e} > {tol:.2e}"
    return err


CASES = [  # (N, K, config): odd N (partial row tiles), K not a multiple of the block, few K blocks, split-K
    (40, 96, G.Config(16, 64, 1, 4, True)),  # K tail (96 = 64 + 32), no split
    (37, 512, G.Config(8, 64, 3, 2, True)),  # uneven split-K, N prime
    (64, 200, G.Config(32, 64, 2, 4, False)),  # K tail with split-K, no prefetch
    (24, 256, G.Config(16, 32, 5, 1, True)),  # 8 K blocks over 5 slices: an empty last slice
    (8, 64, G.Config(16, 64, 1, 1, False)),  # one K block, block_n larger than N
]


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("n,k,cfg", CASES, ids=[G.describe(c[2]) + f"-{c[0]}x{c[1]}" for c in CASES])
def test_kernel_matches_float64(dev, n, k, cfg, silu):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).half().to(dev)
    for m, with_bias in ((1, False), (1, True), (3, True)):
        x = torch.randn(m, 2 * k if silu else k, generator=gen).half().to(dev)
        bias = torch.randn(n, generator=gen).half().to(dev) if with_bias else None
        y = G.launch(x, w, cfg, bias, silu=silu)
        _check(y, x, w, bias, silu)
        assert torch.equal(G.launch(x, w, cfg, bias, silu=silu), y), "split-K must be deterministic"
    from vlmctl.runtime.kernels import w4a16

    assert int(w4a16._WS[str(x.device)]["cnt"].abs().sum()) == 0, "split-K tile counters must be reset"


def test_kernel_bf16_and_row_stride(dev):
    """bf16 activations, and x rows that are a view of a wider tensor (row stride > K)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 128
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(dev)
    base = torch.randn(2, 2 * k, generator=gen).to(torch.bfloat16).to(dev)
    x = base[:, :k]
    y = G.launch(x, w, G.Config(8, 64, 2, 2, True))
    _check(y, x, w, None, False, tol=2.0 ** -7)  # bf16 output rounding: 2**-8 per element


def test_reference_and_bad_inputs():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(8, 16, generator=gen)
    gu = torch.randn(1, 32, generator=gen)
    g, u = gu.chunk(2, -1)
    assert torch.allclose(G.reference(gu, w, silu=True), (torch.nn.functional.silu(g) * u) @ w.T)
    assert not G.usable(gu[:, :16], w)  # CPU tensors: gemv() falls back to torch
    assert torch.equal(G.gemv(gu[:, :16], w), gu[:, :16] @ w.T)
    with pytest.raises(ValueError, match="expects 32"):
        G.launch(gu[:, :16], w, G.Config(), silu=True)


def test_configs_and_table_round_trip(tmp_path, monkeypatch):
    for mode in ("auto", "triton", "cublas"):
        monkeypatch.setenv("VLMCTL_GEMV", mode)
        assert not G.preferred(torch.zeros(4096, 4096, dtype=torch.float16))  # CPU weights: never
    monkeypatch.setenv("VLMCTL_GEMV", "fast")
    with pytest.raises(OptionError, match="VLMCTL_GEMV"):
        G.preferred(torch.zeros(8, 8))
    monkeypatch.delenv("VLMCTL_GEMV", raising=False)
    for name, (n, k) in LLAVA_7B.items():
        c = G.heuristic_config(1, n, k)
        assert c.valid() and k % c.block_k == 0, name  # the 7B shapes run without K masks
        assert all(c.valid() for c in G.candidate_configs(1, n, k)), name
    saved = dict(G._TUNED)
    try:
        G._TUNED.clear()
        G.set_config(4096, 11008, torch.float16, G.Config(8, 512, 4, 4, False), silu=True)
        G.save_tuned(tmp_path / "g.json")
        G._TUNED.clear()
        assert G.load_tuned(tmp_path / "g.json") == 1
        assert G.select_config(1, 4096, 11008, torch.float16, silu=True) == G.Config(8, 512, 4, 4, False)
        assert G.select_config(1, 4096, 11008, torch.float16) == G.heuristic_config(1, 4096, 11008)
    finally:
        G._TUNED.clear()
        G._TUNED.update(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(LLAVA_7B))
def test_gpu_7b_shapes_candidates_and_graph(name):
    n, k = LLAVA_7B[name]
    silu = name == "down"
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, generator=gen, device="cuda").half() * 0.02
    bias = torch.randn(n, generator=gen, device="cuda").half()
    x = torch.randn(1, 2 * k if silu else k, generator=gen, device="cuda").half()
    for cfg in G.candidate_configs(1, n, k)[::3]:
        _check(G.launch(x, w, cfg, bias, silu=silu), x, w, bias, silu)
    G.warmup([w], [1], torch.float16, "cuda", silu_weights=[w] if silu else [])
    eager = G.gemv(x, w, bias, silu=silu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv(x, w, bias, silu=silu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("fuse_down", [True, False], ids=["silu-fused-down", "act-mul-then-down"])
def test_decoder_wiring_single_token(dev, tmp_path, fuse_down):
    """The decoder with its float linears switched to the GEMV (as VLMCTL_GEMV=triton does on CUDA;
    here forced, the kernel in the interpreter without CUDA): a one-token forward (M = 1 everywhere,
    down_proj either reading silu(gate) * up from the gate_up row or after the act·mul kernel, as the
    tuned table decides) gives the logits of the plain path."""
    pytest.importorskip("transformers")
    from test_awq_quantize import make_tiny_llama

    from vlmctl.runtime.decoder import Linear, TorchDecoder

    src = make_tiny_llama(tmp_path / "llama", layers=2, inter=192)
    dec = TorchDecoder.from_hf_dir(src, dtype="float16", device=dev)
    ids = torch.tensor([[5]])
    plain = dec.logits(ids).float()
    from vlmctl.runtime.kernels import gemv as G

    calls, launches = [], []
    real, real_launch = Linear.silu_mul, G.launch

    def spy(self, gu):
        calls.append(tuple(gu.shape))
        return real(self, gu)

    def spy_launch(x2, weight, config, bias=None, **kw):
        launches.append((tuple(x2.shape), kw.get("silu", False)))
        return real_launch(x2, weight, config, bias, **kw)

    lins = [lin for layer in dec.layers for lin in dec._linears(layer) if isinstance(lin, Linear)]
    downs = [layer.down for layer in dec.layers]
    assert len(lins) == 8
    try:
        for lin in lins:
            lin.gemv = True
            lin.gemv_silu = fuse_down and any(lin is d for d in downs)
        dec._fuse_silu_down = True
        Linear.silu_mul = spy
        G.launch = spy_launch
        fused = dec.logits(ids).float()
    finally:
        Linear.silu_mul, G.launch = real, real_launch
        for lin in lins:
            lin.gemv = lin.gemv_silu = False
        dec._fuse_silu_down = False
    assert calls == [(1, 384), (1, 384)]  # each layer's down_proj took the gate_up row
    assert len(launches) == 8  # the kernel ran every linear
    # the fused GEMV read the [1, 2 x 192] gate_up row; otherwise down_proj read act·mul's [1, 192]
    assert launches.count(((1, 384), True)) == (2 if fuse_down else 0)
    assert launches.count(((1, 192), False)) == (0 if fuse_down else 2)
    err = float((fused - plain).norm() / plain.norm())
    assert err <= 2.0 ** -8, err  # fp16 through two layers, summed in another order


@pytest.mark.parametrize("module", ["vlmctl.runtime.kernels.gemv", "vlmctl.runtime.kernels.w4a16"])
def test_public_names_exist(module):
    """Every name a kernel module exports is defined (`from ... import *` would fail otherwise)."""
    import importlib

    mod = importlib.import_module(module)
    assert [n for n in mod.__all__ if not hasattr(mod, n)] == []
