"""Shared by the tests of the CUDA W4A16 kernels (test_w4a16_mma.py, test_w4a16_mma_gemv.py,
test_w4a16_gemv_cuda.py): random packed weights, the fp32 reference, capturing a call as a CUDA graph, and
running a launcher's kernel on the host (tests/cuda_host.py)."""

from __future__ import annotations

import torch

from vlmctl.runtime.kernels import w4a16 as W


def random_packed(n, k, g, seed, device="cuda"):
    """Random codes, zero points and scales (0.001-0.005) of an [n, k] weight in the packed layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=gen, device=device, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen, device=device) * 0.004 + 0.001).half()
    return {"q4weight": words, "q4scales": scales, "q4zeros": zeros}


def reference(x, p, g, bias):
    """x @ dequantize(W)^T (+ bias) in fp32, with the weights rounded to x's dtype as the kernels round them."""
    y = x.float() @ W.dequantize(p, g, x.dtype).float().T
    return y if bias is None else y + bias.float()


def capture(fn):
    """Run fn once on a side stream (compiles, sizes buffers), then capture it as a CUDA graph; returns
    (graph, what the captured call returned)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def on_host(launch, x, packed, g, config, bias, n, monkeypatch, seeds=(0, 1)) -> list:
    """`launch(x, packed, g, config, bias, y)` (a W4A16 launcher) with its kernel run on the CPU
    (tests/cuda_host.py), once per seed (an order of blocks, threads and copy arrivals); x is read only
    after the PDL wait. Returns each run's y."""
    import cuda_host

    from vlmctl.runtime.kernels import cuda_rtc

    out = []
    for seed in seeds:
        monkeypatch.setattr(cuda_rtc, "load_kernel", cuda_host.HostRTC(guard=0, seed=seed).load_kernel)
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        launch(x, packed, g, config, bias, y)
        out.append(y)
    return out


def check_exact_dequantization(launch, config, dtype, rows, monkeypatch, n=64, k=256, g=128):
    """Rows of the identity pick single weights out: with one 1.0 per row a kernel must return
    dequantize(W).to(dtype) bit for bit (its rounding, not just its tolerance); `rows` per call."""
    p = random_packed(n, k, g, seed=7, device="cpu")
    p["q4scales"] = p["q4scales"] * 700  # scales whose products need the final rounding to the dtype
    wd = W.dequantize(p, g, dtype)
    for k0 in range(0, k, rows):
        x = torch.zeros(rows, k, dtype=dtype)
        x[torch.arange(rows), k0 + torch.arange(rows)] = 1
        (y,) = on_host(launch, x, p, g, config, None, n, monkeypatch, seeds=(0,))
        assert torch.equal(y, wd[:, k0:k0 + rows].T.contiguous()), f"columns {k0}..{k0 + rows - 1}"
