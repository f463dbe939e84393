"""The PDL contract of the CUDA kernels that launch with programmatic dependent launch, read from their sm_90
PTX (NVRTC, no GPU needed): each waits for the previous kernel exactly once (griddepcontrol.wait) and lets the
next one start exactly once; before its wait it writes no global memory (no st.global, atom, red), so it
cannot overwrite what the kernel before it still reads. The W4A16 GEMVs load their first weights before the
wait (ld.global), or, the mma kernel, start copying them into shared memory (cp.async).
tests/test_pdl.py does the same for the Triton kernels.
"""

from __future__ import annotations

import re

import pytest

from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

pytestmark = pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")

STORE = re.compile(r"(@!?%p\d+ )?(st\.global|atom\.|red\.)")


def _kernels() -> dict:
    """name: (source, template instance, what it must do before its wait)"""
    return {
        "gemv_cuda": (W.mma_source(), W.gemv_cuda_kernel_name(W.heuristic_gemv_cuda_config(4096, 4096, 128), 128),
                      "ld.global"),
        "mma_gemv": (W.mma_source(), W.mma_gemv_kernel_name(W.heuristic_mma_gemv_config(4096, 4096, 128), 128),
                     "ld.global"),
        "mma": (W.mma_source(), W.mma_kernel_name(W.heuristic_mma_config(4096, 4096, 128, 132, "float16"), 128),
                "cp.async"),
    }


@pytest.mark.parametrize("name", list(_kernels()))
def test_waits_once_and_writes_nothing_before(name):
    source, instance, ahead = _kernels()[name]
    ptx, _ = cuda_rtc.compile_ptx(source, [instance], "sm_90")
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    releases = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents")]
    assert len(waits) == 1 and len(releases) == 1, (len(waits), len(releases))
    before, after = lines[:waits[0]], lines[waits[0]:]
    assert not [ln for ln in before if STORE.match(ln)]
    assert any(re.match(rf"(@!?%p\d+ )?{re.escape(ahead)}", ln) for ln in before)
    assert any(STORE.match(ln) for ln in after)  # its output
