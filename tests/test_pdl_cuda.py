"""The PDL contract of the CUDA kernels that launch with programmatic dependent launch, read from their sm_90
PTX (NVRTC, no GPU needed): each waits for the previous kernel exactly once (griddepcontrol.wait) and lets the
next one start exactly once; before its wait it writes no global memory (no st.global, atom, red), so it
cannot overwrite what the kernel before it still reads. The W4A16 GEMVs load their first weights before the
wait (ld.global), or, the mma kernel, start copying them into shared memory (cp.async); the decode
attention reads its step inputs and starts the copies of its cached K/V tiles there (cp.async into shared
memory), or, built to wait first (VLMCTL_ATTN_CUDA_EARLY=0), reads nothing before it, and writes the cache,
its partials and its ticket after it.
tests/test_pdl.py does the same for the Triton kernels.
"""

from __future__ import annotations

import re

import pytest
import torch

from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import paged_attention_cuda as PA
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
        "decode_attention": (PA.source(), PA.kernel_name(128, 1, torch.float16, early=True), "cp.async"),
        "decode_attention_gqa_bf16": (PA.source(), PA.kernel_name(128, 7, torch.bfloat16, early=True), "cp.async"),
        # VLMCTL_ATTN_CUDA_EARLY=0: it waits before it reads anything
        "decode_attention_late": (PA.source(), PA.kernel_name(128, 1, torch.float16, early=False), None),
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
    if ahead is None:
        assert not [ln for ln in before if re.match(r"(@!?%p\d+ )?(ld\.global|cp\.async)", ln)]
    else:
        assert any(re.match(rf"(@!?%p\d+ )?{re.escape(ahead)}", ln) for ln in before)
    assert any(STORE.match(ln) for ln in after)  # its output (and, for the attention, the cache and ticket)
    if name.startswith("decode_attention"):
        assert any(ln.startswith("atom.") or "atom.global" in ln for ln in after)  # the splits' ticket
