"""Weights brought into L2 while a small decode batch's attention runs.

At batch 1 a 7B decode step's attention takes ~12 us a layer for a ~2.6 MB KV read: a chain of round
trips that leaves DRAM nearly idle (docs/benchmarks.md, session 21). The linears after it (o, then the
MLP's gate_up) are bandwidth-bound and can only start their loads once the attention ends. This kernel,
launched on a side stream when the qkv linear has finished, asks L2 for the o weights and the first
rows of gate_up (`cp.async.bulk.prefetch.L2`: one instruction per piece, nothing waits for it), so
those linears read part of their bytes from L2. It writes nothing and reads nothing back, so it cannot
change any result; the decoder joins the side stream at the end of the step.

`VLMCTL_ATTN_PREFETCH`: "off" (default until measured), or the megabytes of gate_up rows to prefetch
beside all of o (0: o only). `VLMCTL_ATTN_PREFETCH_BATCH`: the largest decode batch it runs at (1).
"""

from __future__ import annotations

import os
import struct

MAX_RANGES = 12
PIECE = 8192  # bytes per prefetch instruction: pieces spread over the grid's threads
THREADS = 32

SOURCE = r"""
struct PrefetchRanges {
    unsigned long long ptr[12];
    unsigned int bytes[12];
    unsigned int count;
};

// Pieces of `piece` bytes laid end to end over the ranges; thread i takes pieces i, i + stride, ...
// A range's start is rounded up and its end down to 16 bytes (the bulk prefetch's alignment).
extern "C" __global__ void l2_prefetch(PrefetchRanges r, unsigned int piece) {
#if __CUDA_ARCH__ >= 900
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long first = 0;  // global index of range j's first piece
    for (unsigned int j = 0; j < r.count && j < 12; ++j) {
        const unsigned long long lo = (r.ptr[j] + 15ull) & ~15ull;
        const unsigned long long hi = (r.ptr[j] + r.bytes[j]) & ~15ull;
        if (hi <= lo) continue;
        const unsigned long long n = (hi - lo + piece - 1) / piece;
        for (; i < first + n; i += stride) {
            const unsigned long long a = lo + (i - first) * piece;
            const unsigned long long left = hi - a;
            const unsigned int size = left < piece ? (unsigned int)left : piece;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(size) : "memory");
        }
        first += n;
    }
#endif
}
"""


def setting() -> tuple[float | None, int]:
    """(megabytes of gate_up rows, or None when off; the largest batch) from the environment."""
    v = os.environ.get("VLMCTL_ATTN_PREFETCH", "off").strip().lower()
    if v in ("", "off", "none", "false"):
        mb = None
    elif v == "empty":  # measurement only: the side-stream launches with nothing to prefetch
        mb = -1.0
    else:
        try:
            mb = float(v)
        except ValueError:
            raise ValueError(f"VLMCTL_ATTN_PREFETCH={v!r}: expected 'off' or megabytes of gate_up rows") from None
        if mb < 0:
            raise ValueError(f"VLMCTL_ATTN_PREFETCH={v!r}: expected megabytes >= 0")
    b = os.environ.get("VLMCTL_ATTN_PREFETCH_BATCH", "1").strip()
    try:
        batch = int(b)
    except ValueError:
        raise ValueError(f"VLMCTL_ATTN_PREFETCH_BATCH={b!r}: expected a batch size") from None
    return mb, batch


def row_prefix(t, rows: int, start: int = 0) -> tuple[int, int]:
    """(address, bytes) of rows [start, start + rows) of a row-major tensor."""
    rows = max(0, min(rows, t.shape[0] - start))
    row_bytes = t.stride(0) * t.element_size()
    return t.data_ptr() + start * row_bytes, rows * row_bytes


def whole(t) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


class Prefetch:
    """One launch's ranges, packed as the kernel's by-value parameter."""

    def __init__(self, ranges: list[tuple[int, int]], empty: bool = False):
        self.empty = empty
        ranges = [(a, n) for a, n in ranges if n >= 16]
        if len(ranges) > MAX_RANGES:
            raise ValueError(f"at most {MAX_RANGES} ranges, got {len(ranges)}")
        if any(n >= 2 ** 32 for _, n in ranges):
            raise ValueError("a prefetch range must be under 4 GiB")
        self.ranges = ranges
        self.bytes = sum(n for _, n in ranges)
        ptrs = [a for a, _ in ranges] + [0] * (MAX_RANGES - len(ranges))
        sizes = [n for _, n in ranges] + [0] * (MAX_RANGES - len(ranges))
        self.param = struct.pack(f"<{MAX_RANGES}Q{MAX_RANGES}II", *ptrs, *sizes, len(ranges)) + b"\0" * 4
        pieces = sum(-(-n // PIECE) for _, n in ranges)
        self.grid = max(1, min(-(-pieces // THREADS), 264))

    def launch(self, device) -> None:
        """On torch's current stream of `device` (compute capability 9.0+; `available` says)."""
        from . import cuda_rtc

        if self.ranges or self.empty:
            cuda_rtc.load_kernel(SOURCE, "l2_prefetch", device).launch(
                (self.grid, 1, 1), (THREADS, 1, 1), 0, [self.param, PIECE], device)


def available(device) -> bool:
    """Whether the prefetch can run on `device`: a CUDA device of compute capability 9.0+ and NVRTC."""
    import torch

    from . import cuda_rtc

    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9 and cuda_rtc.available()


__all__ = ["Prefetch", "SOURCE", "available", "row_prefix", "setting", "whole"]
