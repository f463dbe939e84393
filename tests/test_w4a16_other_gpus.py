"""The CUDA W4A16 kernels that selection picks on GPUs other than the H100 / H200 the tables were measured on compile
for those GPUs (Ampere, Ada, Hopper, Blackwell). An engine compiles them at load (`precompile_selected`) for the card it runs on, so an instance that
does not compile for, say, an A100's sm_80 would stop every AWQ engine there at load; no GPU here is such a card.

Without a GPU: the device's compute capability, name and multiprocessor count are given to selection as those cards
report them, and the load-time pass compiles what it picks with NVRTC for that architecture (into a temporary kernel
cache) at a 7B decoder's shapes, rows 1-512, fp16 and bf16, groups 64 and 128. And such a GPU gets one line in
the load log saying that the table holds nothing for it.
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

pytestmark = pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")

# compute capability -> (the name torch reports, multiprocessors)
CARDS = {(8, 0): ("NVIDIA A100-SXM4-80GB", 108), (8, 6): ("NVIDIA RTX A6000", 84), (8, 9): ("NVIDIA L40S", 142),
         (9, 0): ("NVIDIA H100 80GB HBM3", 132), (10, 0): ("NVIDIA B200", 148),
         (12, 0): ("NVIDIA GeForce RTX 5090", 170)}
SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # qkv, o, gate_up, down
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def _nvrtc_archs() -> set:
    import ctypes

    lib = cuda_rtc.nvrtc_library()
    n = ctypes.c_int()
    lib.nvrtcGetNumSupportedArchs(ctypes.byref(n))
    archs = (ctypes.c_int * n.value)()
    lib.nvrtcGetSupportedArchs(archs)
    return set(archs)


@pytest.fixture
def card(monkeypatch, tmp_path, request):
    cap = request.param
    if 10 * cap[0] + cap[1] not in _nvrtc_archs():
        pytest.skip(f"NVRTC {cuda_rtc.nvrtc_version()} does not compile for sm_{cap[0]}{cap[1]}")
    name, sms = CARDS[cap]
    monkeypatch.setenv("VLMCTL_CACHE_DIR", str(tmp_path))
    for var in ("VLMCTL_W4A16_TABLE", "VLMCTL_W4A16_GEMV_TC", "VLMCTL_W4A16_GEMV_TC_BATCH", "VLMCTL_W4A16_WGMMA",
                "VLMCTL_W4A16_MMA", "VLMCTL_W4A16_GEMV_CUDA", "VLMCTL_W4A16_MMA_GEMV", "VLMCTL_W4A16_DEQUANT_MASK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(W, "_capability", lambda device: cap)
    monkeypatch.setattr(W, "_device_name", lambda device: name)
    monkeypatch.setattr(W, "_sm_count", lambda device: sms)
    compiled = []
    real = cuda_rtc.precompile

    def recording(source, names, arch, workers=16):
        compiled.append((arch, sorted(set(names))))
        return real(source, names, arch, workers)

    monkeypatch.setattr(cuda_rtc, "precompile", recording)
    return cap, compiled


@pytest.mark.parametrize("card", sorted(CARDS), indirect=True, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_selected_kernels_compile_for_the_card(card, dtype):
    (major, minor), compiled = card
    device = torch.device("cuda", 0)
    total = 0
    for g in (128, 64):
        total += W.precompile_selected(SHAPES, g, ROWS, dtype, device, act_mul_shapes=[(22016, 4096)])
    names = [n for _, ns in compiled for n in ns]
    archs = {a for a, _ in compiled}
    assert total == len(names) > 0  # (an NVRTC error would have raised RtcError with its log)
    assert archs <= {f"sm_{major}{minor}", f"sm_{major}{minor}a"}, archs
    wgmma = [n for n in names if n.startswith("w4a16_wgmma")]
    if (major, minor) == (9, 0):
        assert wgmma and f"sm_{major}{minor}a" in archs  # 17-64 rows on Hopper's warpgroup MMA
    else:
        assert not wgmma  # sm_90a only
    if dtype == torch.float16:  # batch 1: a CUDA GEMV, and for gate_up the one with the act·mul epilogue
        gemvs = [n for n in names if n.startswith(("w4a16_gemv<", "w4a16_gemv_tc<"))]
        assert any(n.count(",") == (3 if n.startswith("w4a16_gemv<") else 4) for n in gemvs), names
        assert any(n.count(",") == (4 if n.startswith("w4a16_gemv<") else 5) for n in gemvs), names


def test_untuned_gpu_gets_one_load_log_line(monkeypatch):
    """An engine on a GPU the table has no entries for says so at load (the rules then pick every config)."""
    monkeypatch.delenv("VLMCTL_W4A16_TABLE", raising=False)
    shipped = W.tuned_devices()
    assert {"NVIDIA H200", "NVIDIA H100 80GB HBM3"} <= shipped  # the cards the shipped table was measured on
    cuda = torch.device("cuda", 0)
    for name, untuned in (("NVIDIA H200", False), ("NVIDIA H100 80GB HBM3", False), ("NVIDIA L40S", True)):
        monkeypatch.setattr(W, "_device_name", lambda device, name=name: name)
        note = W.untuned_device_note(cuda)
        assert (note is not None) == untuned, (name, note)
        if untuned:
            assert name in note and "w4a16_tuned.json" in note and "docs/awq.md" in note
    assert W.untuned_device_note(torch.device("cpu")) is None
    monkeypatch.setenv("VLMCTL_W4A16_TABLE", "off")
    monkeypatch.setattr(W, "_device_name", lambda device: "NVIDIA H200")
    assert W.tuned_devices() == set() and "VLMCTL_W4A16_TABLE=off" in W.untuned_device_note(cuda)
