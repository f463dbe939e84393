"""The Hopper W4A16 kernel for 17-64 rows ("wgmma": `vlmctl/runtime/kernels/w4a16_wgmma.cu`).

On any machine with NVRTC: every config the selection rule or the benchmark uses compiles for sm_90a (as shipped,
and with the parallel stream-K fix-up that has not run on a GPU yet) without register spills, and ptxas does not
serialize its warpgroup MMAs (it does, silently but for a log line, when
their accumulators are touched on a path it cannot prove uniform). Everywhere: the configs' geometry rules and
that selection takes the kernel only on sm_90. On a GPU of compute capability 9.0 (marked `gpu`): results
against x @ dequantize(W)^T in fp32 for fp16 and bf16, odd N, groups 64 / 128 / 256 and stream-K splits of
one tile over many blocks; repeat launches bit-identical; a CUDA-graph replay equal to the eager result.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

GPU90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _bench_module(name):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    return importlib.import_module(name)


def _cfg(nwg, bm, stages):
    return W.Config("wgmma", block_n=64 * nwg, block_k=128, block_m=bm, split_k=1, num_warps=4 * nwg,
                    num_stages=stages)


def _ptxas_log(name: str, defines: str = "") -> str:
    lib = cuda_rtc.nvrtc_library()
    prog = ctypes.c_void_p()
    src = (defines + W.wgmma_source()).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"w4a16_wgmma.cu", 0, None, None) == 0
    assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--ptxas-options=-v"]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    log = buf.value.decode(errors="replace")
    assert res == 0, log
    return log


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("name", [
    W.wgmma_kernel_name(W.heuristic_wgmma_config(64), 128, "float16"),
    W.wgmma_kernel_name(W.heuristic_wgmma_config(32), 128, "float16"),
    W.wgmma_kernel_name(W.heuristic_wgmma_config(64), 64, "bfloat16"),
    W.wgmma_kernel_name(_cfg(2, 64, 5), 256, "float16"),
])
@pytest.mark.parametrize("defines", ["", "#define W4A16_WGMMA_PFIX 1\n", "#define W4A16_WGMMA_PIPE 1\n"],
                         ids=["shipped", "parallel-fixup", "pipeline"])
def test_compiles_for_sm90a_without_serialized_wgmma(name, defines):
    log = _ptxas_log(name, defines)
    assert "serialized" not in log, log  # ptxas: "wgmma.mma_async instructions are serialized due to ..."
    assert "is injected" not in log, log  # ptxas: a wgmma.wait_group it inserted inside the unit loop
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= 16, log  # at most a few words (the 128-register cap at 512 threads)


def test_config_rules():
    assert W.heuristic_wgmma_config(64).valid_for(12288, 4096, 128)
    assert W.heuristic_wgmma_config(17).block_m == 32 and W.heuristic_wgmma_config(33).block_m == 64
    assert W.heuristic_wgmma_config(64).valid_for(4096, 11008, 64)
    assert not W.heuristic_wgmma_config(64).valid_for(4096, 4096 + 64, 64)  # K a multiple of 128
    assert not W.heuristic_wgmma_config(64).valid_for(4096, 4096, 32)  # groups of 64 or a multiple of 128
    assert not _cfg(4, 64, 7).valid_for(4096, 4096, 128)  # 7 stages of 33 KB (+1 KB) exceed shared memory
    assert _cfg(4, 64, 6).valid_for(4096, 4096, 64)  # 6 of 34 KB (two groups' scales a unit) fit
    assert not _cfg(4, 64, 4).valid_for(4096, 4096, 128)  # scales are stored a unit before the stage is read
    # x 64 x 128 halfs, 256 rows of 16 words, a scale word per row: 33 KB a stage, and 1 KB for alignment
    assert W.wgmma_shared_bytes(_cfg(4, 64, 6), 128) == 6 * (64 * 256 + 256 * 64 + 256 * 4) + 1024
    # two warpgroups: 16 + 8 + 0.5 KB, rounded up to 25 KB a stage (swizzle atoms stay 1024-byte aligned)
    assert W.wgmma_shared_bytes(_cfg(2, 64, 5), 128) == 5 * 25 * 1024 + 1024


def test_selection_takes_it_only_on_sm90():
    # on the CPU (and any device that is not sm_90) selection never returns the kernel
    for m in (17, 32, 64):
        assert W.select_config(m, 12288, 4096, 128, torch.float16, torch.device("cpu")).kernel != "wgmma"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU90, reason="needs a GPU of compute capability 9.0 (warpgroup MMA)")
@pytest.mark.parametrize("fixup,pipe", [("serial", "0"), ("parallel", "0"), ("serial", "1"), ("parallel", "1")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_against_dequantized_reference(dtype, fixup, pipe, monkeypatch):
    random_packed = _bench_module("gpu_weights").random_packed
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    tol = 2e-3 if dtype == torch.float16 else 8e-3
    # (N, K, G): odd N, each group size, one tile split over 86 blocks (256 x 11008)
    for n, k, g in ((200, 384, 64), (1000, 1280, 256), (4096, 4096, 128), (256, 11008, 128)):
        p = random_packed(n, k, g, n + k)
        ref_w = W.dequantize(p, g, dtype).float()
        for m in (1, 17, 33, 64):
            x = torch.randn(m, k, generator=gen).to(dev, dtype)
            bias = torch.randn(n, generator=gen).to(dev, dtype)
            ref = x.float() @ ref_w.t() + bias.float()
            for c in (W.heuristic_wgmma_config(m), _cfg(2, 64, 5)):
                if m > c.block_m or not c.valid_for(n, k, g):
                    continue
                monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", fixup)
                monkeypatch.setenv("VLMCTL_W4A16_WGMMA_PIPE", pipe)
                y = W.launch(x, p, g, c, bias)
                assert torch.equal(y, W.launch(x, p, g, c, bias)), "repeat launches differ"
                err = float((y.float() - ref).norm() / ref.norm())
                assert err < tol, (n, k, g, m, W.describe(c), err)
                if (fixup, pipe) != ("serial", "0"):  # every build sums the same terms in the same order
                    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", "serial")
                    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_PIPE", "0")
                    assert torch.equal(y, W.launch(x, p, g, c, bias)), (n, k, g, m, W.describe(c))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU90, reason="needs a GPU of compute capability 9.0 (warpgroup MMA)")
@pytest.mark.parametrize("fixup,pipe", [("serial", "0"), ("parallel", "0"), ("serial", "1")])
def test_gpu_selected_and_graph_replay_equals_eager(fixup, pipe, monkeypatch):
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", fixup)
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_PIPE", pipe)
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA", "1")
    graph_median_ms = _bench_module("gpu_timing").graph_median_ms
    random_packed = _bench_module("gpu_weights").random_packed
    dev = torch.device("cuda")
    p = random_packed(4096, 4096, 128, 1)
    x = torch.randn(48, 4096, device=dev, dtype=torch.float16)
    c = W.select_config(48, 4096, 4096, 128, torch.float16, dev)
    assert c.kernel == "wgmma"
    y = W.w4a16_linear(x, p, 128)
    yg = torch.empty_like(y)
    graph_median_ms([lambda: W.launch(x, p, 128, c, out=yg)], replays=3)
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU90, reason="needs a GPU of compute capability 9.0 (warpgroup MMA)")
def test_gpu_refused_cooperative_launch_falls_back_to_serial(monkeypatch, caplog):
    """A process that owns fewer SMs than the device reports (an MPS client's share) gets its cooperative
    launches refused by the driver; the launcher then runs the serial fix-up, same bits, and stays there."""
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA_FIXUP", raising=False)
    monkeypatch.setattr(W, "_COOPERATIVE_REFUSED", set())
    random_packed = _bench_module("gpu_weights").random_packed
    dev = torch.device("cuda")
    p = random_packed(4096, 4096, 128, 3)
    x = torch.randn(48, 4096, device=dev, dtype=torch.float16)
    c = W.heuristic_wgmma_config(48)
    assert W.wgmma_shared_bytes(c, 128) > 228 * 1024 // 2  # one block per SM, so 2 x SMs cannot all be resident
    idx = torch.cuda.current_device()
    # The launcher sizes its grid from the SM count: claim twice the real one, a grid the driver cannot make resident
    monkeypatch.setitem(W._SM_COUNT, idx, 2 * torch.cuda.get_device_properties(idx).multi_processor_count)
    with caplog.at_level("WARNING", logger="vlmctl.runtime"):
        y = W.launch(x, p, 128, c)
    assert W.wgmma_cooperative_refused(dev)
    assert "refused a cooperative launch" in caplog.text
    assert torch.equal(y, W.launch(x, p, 128, c))  # the fallback sticks: no second refusal needed
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", "serial")
    assert torch.equal(y, W.launch(x, p, 128, c))  # what the serial fix-up gives on the same grid
    ref = x.float() @ W.dequantize(p, 128, torch.float16).float().t()
    assert float((y.float() - ref).norm() / ref.norm()) < 2e-3


def test_switch_values(monkeypatch):
    for value, mode in (("0", "0"), ("off", "0"), ("1", "1"), ("on", "1"), ("wide", "wide"), ("WIDE", "wide"),
                        ("", "1")):
        monkeypatch.setenv("VLMCTL_W4A16_WGMMA", value)
        assert W.wgmma_mode() == mode and W.wgmma_enabled() == (mode != "0")
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA")
    assert W.wgmma_mode() == "1"  # on by default for every shape (measured faster at 32-64 rows, session 17)
    for value, parallel in (("parallel", True), ("PARALLEL", True), ("serial", False), ("", True)):
        monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", value)
        assert W.wgmma_parallel_fixup() == parallel
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA_FIXUP")
    assert W.wgmma_parallel_fixup()  # the parallel fix-up by default
    assert W.wgmma_build_defines() == "#define W4A16_WGMMA_PFIX 1\n"
    assert W.wgmma_source(W.wgmma_build_defines()) is W.wgmma_source(W.wgmma_build_defines())  # one cached string
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_PIPE", "1")
    monkeypatch.setenv("VLMCTL_W4A16_WGMMA_FIXUP", "serial")
    assert W.wgmma_pipeline() and W.wgmma_build_defines() == "#define W4A16_WGMMA_PIPE 1\n"
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA_FIXUP")
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA_PIPE")
    assert not W.wgmma_pipeline()  # measured no faster: opt-in


def _stream_k_model(n, k, bn, sms):
    """The kernel's stream-K split, recomputed from its closed forms (w4a16_wgmma.cu), with the brute-force view
    of which blocks touch which tile. Returns (U, P, cpt, tiles, u0, u1, touching)."""
    cpt, tiles = k // 128, -(-n // bn)
    U = tiles * cpt
    P = min(U, sms)
    u0 = [U * b // P for b in range(P)]
    u1 = [U * (b + 1) // P for b in range(P)]
    touching = {t: [b for b in range(P) if u0[b] < (t + 1) * cpt and u1[b] > t * cpt] for t in range(tiles)}
    return U, P, cpt, tiles, u0, u1, touching


@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (1000, 1280),
                                 (256, 11008), (200, 384), (132 * 256, 4096)])
@pytest.mark.parametrize("sms", [132, 114, 78])
def test_stream_k_fixup_bookkeeping(n, k, sms):
    # The fix-ups' index arithmetic (the parallel one's, W4A16_WGMMA_PFIX, above all) against brute force: the blocks it expects on a tile's ticket, the blocks that sum it, their row slices, the
    # workspace slots, and that no block can wait for one that is itself waiting (all blocks are resident).
    bn = 256
    U, P, cpt, tiles, u0, u1, touching = _stream_k_model(n, k, bn, sms)
    arrivals, waits, slots = {}, {}, {}
    for t in range(tiles):
        blocks = touching[t]
        b_first = ((t * cpt + 1) * P - 1) // U  # the kernel's closed forms
        b_last = ((t + 1) * cpt * P - 1) // U
        assert blocks == list(range(b_first, b_last + 1))
        if len(blocks) == 1:  # stored whole by its one block, no fix-up
            b = blocks[0]
            assert t * cpt >= u0[b] and u1[b] >= (t + 1) * cpt
            continue
        summers = [b for b in blocks if (u1[b] - 1) // cpt == t]  # blocks whose range ends in this tile
        r_last = b_last if (U * (b_last + 1) // P - 1) // cpt == t else b_last - 1
        assert summers == list(range(b_first, r_last + 1)) and summers
        R = len(summers)
        rows = []
        for ri in range(R):
            lo4, hi4 = (bn // 4) * ri // R, (bn // 4) * (ri + 1) // R
            rows += range(4 * lo4, 4 * hi4)
        assert rows == list(range(bn))  # every row of the tile summed once
        # the summing loops' slot rule (both fix-ups): b_first's slot from its start, 0 for every later block
        first_slot = 0 if (U * b_first // P) // cpt == t else 1
        for b in blocks:  # a part is a block's first or last segment, in workspace slot 0 or 1 (kernel: flush)
            assert t in (u0[b] // cpt, (u1[b] - 1) // cpt)
            slot = 0 if t == u0[b] // cpt else 1
            assert slot == (first_slot if b == b_first else 0), (t, b)
            slots.setdefault(b, []).append(slot)
        arrivals[t] = set(blocks)
        waits.update({b: t for b in summers})
    assert all(len(v) == len(set(v)) for v in slots.values())  # a block's two parts never share a slot
    for b in range(P):  # the parallel fix-up's test after the main loop: sum the range's last tile unless stored whole
        last = (u1[b] - 1) // cpt
        assert (not (last * cpt >= u0[b] and u1[b] == (last + 1) * cpt)) == (waits.get(b) == last), b
    # Deadlock-free: play the blocks' segments in order; a block waits only at its last segment, for every
    # block on that tile to have arrived; every block finishes.
    pos = [u0[b] // cpt for b in range(P)]
    arrived = {t: set() for t in arrivals}
    done = [False] * P
    for _ in range(4 * (tiles + P)):
        moved = False
        for b in range(P):
            if done[b]:
                continue
            t = pos[b]
            if t in arrivals and b not in arrived[t]:
                arrived[t].add(b)
                moved = True
            if waits.get(b) == t and arrived[t] != arrivals[t]:
                continue
            if t >= (u1[b] - 1) // cpt:
                done[b] = True
            else:
                pos[b] += 1
            moved = True
        if not moved:
            break
    assert all(done), "a block would wait forever"
