"""Timing for the GPU benchmarks: a list of calls captured as one CUDA graph and replayed, so what is
measured is GPU time. (Per-call timing of launches made from Python measures the host whenever it
falls behind the GPU, as the mma kernel's ctypes launches did: docs/benchmarks.md, session 7.)"""

from __future__ import annotations

import statistics


def graph_median_ms(fns, replays: int = 15) -> float:
    """Run the calls `fns` once on a side stream (compiles, allocates), capture them as one CUDA graph,
    replay it 3 times, then return the median ms of `replays` replays timed with CUDA events."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 20 after 5 warm-ups): the
    bandwidth bound the benchmarks quote, measured on the card at hand rather than taken from a data sheet."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    del a, b
    return 2 * (2 << 30) / statistics.median(times[5:])
