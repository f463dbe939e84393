"""Programmatic dependent launch (`vlmctl.runtime.kernels.pdl`).

Without a GPU: the switch, and the contract each decode-step kernel keeps when launched with PDL,
read from its sm_90 PTX (compiled here by Triton's bundled ptxas in a subprocess): it waits for the
previous kernel exactly once, and before that wait it writes no global memory (no st.global, atom,
red), so it cannot overwrite what the previous kernel still reads; the GEMVs (their first weights)
and the RMSNorm (its weight) do load before it, which is the point, and the GEMVs also prefetch
into L2 there. With PDL off the kernels carry no grid-dependency
instruction at all.

On a GPU (`gpu` marks): chains of RMSNorm -> GEMV kernels, each reading the previous one's output,
give bit-identical results with PDL (and the L2 prefetch) on and off, eagerly and replayed from a
CUDA graph; a missing wait would read stale activations. The engine-level check is in
tests/test_gpu_runtime.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmctl.errors import OptionError
from w4a16_gpu_helpers import capture

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

HAS_CUDA = torch.cuda.is_available()
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ptx_facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(HERE / "pdl_ptx.py")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_step_kernel_waits_once_and_stores_nothing_before(ptx_facts):
    sys.path.insert(0, str(HERE))
    from pdl_ptx import kernels

    expected = kernels()
    assert set(ptx_facts) == set(expected)
    for name, f in ptx_facts.items():
        on, off = f["pdl"], f["no_pdl"]
        assert on["waits"] == 1 and on["releases"] == 1, (name, on)
        assert on["stores_before_wait"] == 0, (name, on)
        assert off["waits"] == 0 and off["releases"] == 0, (name, off)
        if expected[name][3]:  # reads weights ahead of the wait
            assert on["loads_before_wait"] > 0, (name, on)
        if name.startswith("gemv") or name.endswith("_prefetch"):
            assert on["l2_prefetches_before_wait"] > 0, (name, on)
    # neither switch: nothing read before the wait, the order measured before session 47
    assert ptx_facts["decode_rope"]["pdl"]["l2_prefetches_before_wait"] == 0
    assert ptx_facts["decode_rope"]["pdl"]["loads_before_wait"] == 0


def test_8bit_decode_kernels_widen_their_tiles_before_shared_memory(ptx_facts):
    """With `kv_rows.widen` (the default for fp16 models; VLMCTL_ATTN_KV8_WIDEN=0 casts instead) an 8-bit pool's K/V
    tiles reach the tensor cores as the 16-bit pool's do: widened to fp16 where they are loaded, then by ldmatrix.
    Triton moves a plain cast after the trip through shared memory, where 8-bit values take scalar loads and
    int8 an unpacked convert each (session 41's kernel, 12 % slower a batch-64 step with int8 on an H100)."""
    f16 = ptx_facts["decode_rope"]["pdl"]
    assert ptx_facts["decode_rope_fp8_cast"]["pdl"]["ldmatrix"] < f16["ldmatrix"]  # the cast: what the check tells apart
    for name in ("decode_rope_fp8", "decode_rope_int8"):
        f = ptx_facts[name]["pdl"]
        assert f["ldmatrix"] >= f16["ldmatrix"] > 0, (name, f, f16)
        assert f["s8_converts"] == 0, (name, f)


def test_switch(monkeypatch):
    from vlmctl.runtime.kernels import pdl

    monkeypatch.setenv("VLMCTL_PDL", "auto")
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("VLMCTL_PDL", "off")
    assert pdl.mode() == "0"
    monkeypatch.setenv("VLMCTL_PDL", "sometimes")
    with pytest.raises(OptionError, match="VLMCTL_PDL"):
        pdl.mode()
    monkeypatch.delenv("VLMCTL_PDL")
    assert pdl.l2_prefetch_blocks("int4") == pdl.DEFAULT_L2_PREFETCH["int4"]
    monkeypatch.setenv("VLMCTL_L2_PREFETCH", "3")
    assert pdl.l2_prefetch_blocks("fp16") == 3
    for bad in ("-1", "lots"):
        monkeypatch.setenv("VLMCTL_L2_PREFETCH", bad)
        with pytest.raises(OptionError, match="VLMCTL_L2_PREFETCH"):
            pdl.l2_prefetch_blocks("int4")


def test_attention_launch_switch(monkeypatch):
    """`VLMCTL_ATTN_PDL=0` (a measurement): the decode attention stays compiled with PDL, so that the o
    projection after it may still start early, but is launched as a plain dependent of qkv; where PDL is off
    it changes nothing; any other value is one OptionError."""
    from vlmctl.runtime.kernels import paged_attention as pa
    from vlmctl.runtime.kernels import pdl

    cpu = torch.device("cpu")
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device: {"PDL": True, "launch_pdl": True})
    monkeypatch.delenv("VLMCTL_ATTN_PDL", raising=False)
    assert pa._decode_launch_kwargs(cpu) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("VLMCTL_ATTN_PDL", "0")
    assert pa._decode_launch_kwargs(cpu) == {"PDL": True}
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device: {"PDL": False})
    assert pa._decode_launch_kwargs(cpu) == {"PDL": False}
    monkeypatch.setenv("VLMCTL_ATTN_PDL", "later")
    with pytest.raises(OptionError, match="VLMCTL_ATTN_PDL"):
        pa._decode_launch_kwargs(cpu)


def test_attention_prefetch_switch(monkeypatch):
    """`VLMCTL_ATTN_PREFETCH`: tiles of cached K/V the decode attention asks L2 for before its PDL wait; 0 where
    PDL is off (nothing runs ahead of the wait there); not a power of two or not a number is one OptionError."""
    from vlmctl.runtime.kernels import paged_attention as pa
    from vlmctl.runtime.kernels import pdl

    cpu = torch.device("cpu")
    monkeypatch.setenv("VLMCTL_ATTN_PREFETCH", "2")
    assert pa.prefetch_tiles(cpu) == 0
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert pa.prefetch_tiles(cpu) == 2
    monkeypatch.delenv("VLMCTL_ATTN_PREFETCH")
    assert pa.prefetch_tiles(cpu) == 0
    for bad in ("3", "-1", "all"):
        monkeypatch.setenv("VLMCTL_ATTN_PREFETCH", bad)
        with pytest.raises(OptionError, match="VLMCTL_ATTN_PREFETCH"):
            pa.prefetch_tiles(cpu)
    monkeypatch.setenv("VLMCTL_ATTN_EARLY_TILE", "1")
    assert pa.early_tile(cpu)
    monkeypatch.setenv("VLMCTL_ATTN_EARLY_TILE", "yes")
    with pytest.raises(OptionError, match="VLMCTL_ATTN_EARLY_TILE"):
        pa.early_tile(cpu)


def _chain(kind: str):
    """RMSNorm -> GEMV, eight times, each GEMV's output the next norm's input (4096 x 4096 weights); one row,
    or five for the tensor-core GEMV ("mma_gemv")."""
    from vlmctl.runtime.kernels import fused, gemv
    from vlmctl.runtime.kernels import w4a16 as W

    n = k = 4096
    g = 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    norm_w = (torch.rand(k, generator=gen, device="cuda") + 0.5).half()
    if kind == "fp16":
        ws = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).half() for _ in range(8)]
        cfg = gemv.heuristic_config(1, n, k)

        def lin(x, w):
            return gemv.launch(x, w, cfg)
    else:
        ws = []
        for _ in range(8):
            codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.int32)
            zeros = torch.randint(0, 16, (n, k // g), generator=gen, device="cuda", dtype=torch.int32)
            scales = torch.rand(n, k // g, generator=gen, device="cuda") * 2 * k ** -0.5 / 4
            ws.append(W.pack(codes, zeros, scales, g))
        cfg = {"h2": W.heuristic_h2_config(1, n, k, g), "cuda": W.heuristic_gemv_cuda_config(n, k, g),
               "mma_gemv": W.Config("mma_gemv", block_n=16, block_m=8, num_warps=8, num_stages=3)}.get(
            kind, W.heuristic_config(1, n, k, g))

        def lin(x, p):
            return W.launch(x, p, g, cfg)

    x0 = torch.randn(5 if kind == "mma_gemv" else 1, k, generator=gen, device="cuda").half()  # 5 rows: batch 5

    def run():
        x = x0
        for w in ws:
            x = lin(fused.add_rms_norm(x, norm_w, 1e-6), w)
        return x

    return run


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp16", "h2", "gemv", "cuda", "mma_gemv"])
def test_gpu_pdl_chain_equals_plain_launches(kind, monkeypatch):
    from vlmctl.runtime.kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    monkeypatch.setenv("VLMCTL_PDL", "0")
    run = _chain(kind)
    plain = run()
    monkeypatch.setenv("VLMCTL_PDL", "1")
    monkeypatch.setenv("VLMCTL_L2_PREFETCH", "2")
    assert pdl.enabled(plain.device)
    eager = run()
    graph, out = capture(run)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all() and plain.abs().max() > 0
    assert torch.equal(eager, plain)
    assert torch.equal(out, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("ctx", [700, 1900])  # 1900: programs of several tiles, more than one prefetched
def test_gpu_attention_prefetch_changes_nothing(ctx, monkeypatch):
    """The qkv GEMV -> the decode attention (rotary, KV append, split-K with the combine folded in) under PDL,
    with the first 0, 1 or 2 tiles of cached K/V asked of L2 before the wait (`VLMCTL_ATTN_PREFETCH`) and with the
    first tile loaded into registers there (`VLMCTL_ATTN_EARLY_TILE`): the same bits as with PDL off, eagerly
    and replayed from a CUDA graph."""
    from vlmctl.runtime.kernels import gemv, pdl
    from vlmctl.runtime.kernels import paged_attention as pa

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    n_q = n_kv = 32
    d, bs, hidden = 128, 16, 4096
    maxb = 2048 // bs
    g = torch.Generator().manual_seed(3)
    table = (torch.randperm(4 * maxb, generator=g)[:maxb] + 1).to(torch.int32).view(1, maxb)
    nblocks = 4 * maxb + 1
    slot = int(table[0, (ctx - 1) // bs]) * bs + (ctx - 1) % bs
    kc = torch.randn(nblocks, bs, n_kv, d, generator=g).half().cuda()
    vc = torch.randn(nblocks, bs, n_kv, d, generator=g).half().cuda()
    w = (torch.randn((n_q + 2 * n_kv) * d, hidden, generator=g) * hidden ** -0.5).half().cuda()
    x = torch.randn(1, hidden, generator=g).half().cuda()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(4096).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).cuda()
    pos, slots = torch.tensor([ctx - 1], device="cuda"), torch.tensor([slot], device="cuda")
    lens, table = torch.tensor([ctx], dtype=torch.int32, device="cuda"), table.cuda()
    splits = pa.choose_splits(1, n_kv, 2048, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = pa.split_workspace(1, n_q, d, splits, "cuda")
    cfg = gemv.heuristic_config(1, w.shape[0], hidden)

    def step():
        qkv = gemv.launch(x, w, cfg)
        return pa.paged_decode_rope(qkv, cos_sin, pos, slots, kc, vc, table, lens, d ** -0.5, n_q, n_kv,
                                    num_splits=splits, workspace=ws)

    monkeypatch.setenv("VLMCTL_PDL", "0")
    plain = step()
    kc_plain, vc_plain = kc.clone(), vc.clone()
    assert torch.isfinite(plain).all() and plain.abs().max() > 0
    monkeypatch.setenv("VLMCTL_PDL", "1")
    for tiles, early in (("0", "0"), ("1", "0"), ("2", "0"), ("0", "1"), ("1", "1")):
        monkeypatch.setenv("VLMCTL_ATTN_PREFETCH", tiles)
        monkeypatch.setenv("VLMCTL_ATTN_EARLY_TILE", early)
        assert pa.prefetch_tiles(plain.device) == int(tiles) and pdl.enabled(plain.device)
        assert pa.early_tile(plain.device) == (early == "1")
        assert torch.equal(step(), plain), (tiles, early)
        graph, out = capture(step)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), (tiles, early)
        assert torch.equal(kc, kc_plain) and torch.equal(vc, vc_plain)  # the append rewrote its own slot only
        assert torch.count_nonzero(ws[2]) == 0
