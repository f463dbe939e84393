"""Shared by the GPU tests of the CUDA W4A16 kernels (test_w4a16_mma.py, test_w4a16_gemv_cuda.py):
random packed weights, the fp32 reference, and capturing a call as a CUDA graph."""

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
