"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (sm_90 and later).

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
running: once every program of that kernel has called `release`, the next one's programs start
on free SM slots and do what does not depend on it (address arithmetic, the first loads of their
weights) until `wait`, which blocks until the previous kernel has completed and its writes are
visible. At batch 1 a step is ~260 short kernels, so the launch latency and the ramp of each
GEMV's loads are a large part of it; PDL overlaps them with the kernel before. In a CUDA graph
the launches become programmatic edges.

The contract every kernel launched with PDL keeps: before `wait` it writes no global memory and
reads only weights (nothing in a step writes them) and the step's inputs (lengths, positions, block
tables: copied in before the step's first kernel, and copies wait for their predecessors as usual);
activations, the KV cache, split-K workspaces and tickets are read only after it. An L2 prefetch
may name anything (the decode attention's cached K/V rows): it moves no value into a register or
L1, and L2 is where every SM's reads and writes meet, so it cannot make a load stale. Completion is transitive (a kernel completes only after its
own `wait` returned), so after `wait` everything earlier on the stream has completed too.
Kernels launched without PDL (torch's, cuBLAS's) wait for their predecessors as usual.

`VLMCTL_PDL`: "auto" (default) uses it on CUDA devices of compute capability 9.0 and later when
the installed Triton has the grid-dependency ops; "0" never (A/B measurements, debugging); "1" as
"auto" but an error where it cannot run. Triton's CPU interpreter has no such ops: kernels run
there with PDL off.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ...errors import OptionError
from .settings import env_int

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    _gdc_wait = _gdc_launch_dependents = None

MODES = ("auto", "0", "1")
# Measured on an H200 with a 7B decoder at batch 1 (docs/benchmarks.md, session 5 r3): the int4
# step went from 2.29-2.37 to 2.16-2.17 ms with 1-2 blocks (4: 2.26, 16: 2.48: more than L2 keeps
# while the previous kernel runs); the fp16 step, its GEMVs already near the bandwidth bound, only
# lost (3.87-3.94 ms -> 4.09 with 1 block).
DEFAULT_L2_PREFETCH = {"int4": 2, "fp16": 0}
_SUPPORTED: dict[str, bool] = {}


def mode() -> str:
    m = os.environ.get("VLMCTL_PDL", "auto").strip().lower() or "auto"
    m = {"off": "0", "on": "1", "false": "0", "true": "1"}.get(m, m)
    if m not in MODES:
        raise OptionError(f"VLMCTL_PDL={m!r}: expected auto, 0 or 1")
    return m


_ENABLED: dict = {}


def enabled(device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring). Asked at every launch (~300 a
    prompt step, whose launches are the host's work): the answer is kept per device and environment."""
    key = (device, os.environ.get("VLMCTL_PDL"), os.environ.get("TRITON_INTERPRET"))
    answer = _ENABLED.get(key)
    if answer is None:
        answer = _ENABLED[key] = _enabled(device)
    return answer


def _enabled(device) -> bool:
    m = mode()
    if m == "0" or getattr(device, "type", str(device).split(":")[0]) != "cuda" \
            or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    key = str(device)
    if key not in _SUPPORTED:
        import torch

        major, _ = torch.cuda.get_device_capability(device)
        _SUPPORTED[key] = major >= 9 and _gdc_wait is not None
    if m == "1" and not _SUPPORTED[key]:
        raise OptionError(f"VLMCTL_PDL=1 but {device} cannot use programmatic dependent launch "
                           "(it needs compute capability 9.0+ and Triton >= 3.3)")
    return _SUPPORTED[key]


def l2_prefetch_blocks(weights: str) -> int:
    """K blocks of weights per program that a batch-1 GEMV bulk-prefetches into L2 before its `wait`
    when launched with PDL: `DEFAULT_L2_PREFETCH[weights]` ("int4" or "fp16"), or `VLMCTL_L2_PREFETCH`
    for both (0: none; for A/B measurements)."""
    return env_int("VLMCTL_L2_PREFETCH", DEFAULT_L2_PREFETCH[weights], minimum=0)


def launch_kwargs(device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's launch flag."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel on the stream be scheduled (it still waits for this one in `wait`)."""
    if PDL:
        _gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel on the stream has completed and its writes are visible."""
    if PDL:
        _gdc_wait()


@triton.jit
def prefetch_l2(row_ptrs, nbytes):
    """Ask for `nbytes` from each row pointer to be brought into L2 (sm_90 bulk prefetch: one
    instruction per row, nothing waits for it). Issued before `wait`, it moves a GEMV's first
    weights while the previous kernel, often latency-bound at batch 1, leaves the memory idle.
    Row pointers must be 16-byte aligned and nbytes a multiple of 16."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;", "=r,l,r",
                              [row_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
