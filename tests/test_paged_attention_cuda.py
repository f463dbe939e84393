"""The CUDA decode attention with rotary and KV append (`runtime/kernels/decode_attention.cu`, launched by
`paged_attention_cuda`).

On any machine with NVRTC: every kind of template instance compiles for sm_90, and the selection rules hold.
With a C++ compiler: the kernel's C++ run on the CPU (tests/cuda_host.py) against the reference operations.
On a GPU (marked `gpu`): against the reference operations (rotary + append, then attention in float32 over
the updated cache) and against the Triton kernel it stands in for, over GQA groups up to 7, head sizes 32
and 128, block sizes 8 and 16, 1-32 splits, sliding windows, int32 and int64 positions, fp16 and bf16: the
same output within the dtype's rounding, the reference's K/V rows appended bit for bit and nothing else in
the cache touched, the split counters back at zero, deterministic and the same bits when built to wait
first (VLMCTL_ATTN_CUDA_EARLY=0); and, in a CUDA graph behind a PDL kernel that writes its qkv input, the
same result as run eagerly (a read of qkv before the wait would see the old rows).
"""

from __future__ import annotations

import pytest
import torch

from vlmctl.runtime import ops
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import paged_attention_cuda as PA

import cuda_host

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_kernel_compiles_for_sm90():
    names = [PA.kernel_name(d, g, dt, early) for d, g, dt, early in [
        (32, 1, torch.float16, True), (64, 2, torch.bfloat16, False), (128, 7, torch.float16, True),
        (256, 8, torch.bfloat16, True), (128, 1, torch.float16, False)]]
    assert names[2] == "decode_attention_rope<4, 8, 0, 1>"  # a group of 7 runs in the instance for 8
    cubin, lowered = cuda_rtc.compile_cubin(PA.source(), names, "sm_90")
    assert len(cubin) > 10_000 and set(lowered) == set(names)


def test_mode_and_selection(monkeypatch):
    x = torch.zeros(1, 3 * 128)
    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "sometimes")
    with pytest.raises(ValueError, match="VLMCTL_ATTN_CUDA"):
        PA.mode()
    monkeypatch.delenv("VLMCTL_ATTN_CUDA")
    assert PA.mode() == "0"  # off until it has been measured on a GPU
    assert PA.reads_early() and PA.kernel_name(128, 1, torch.float16).endswith(", 1>")
    monkeypatch.setenv("VLMCTL_ATTN_CUDA_EARLY", "0")
    assert PA.kernel_name(128, 1, torch.float16) == "decode_attention_rope<4, 1, 0, 0>"
    monkeypatch.setenv("VLMCTL_ATTN_CUDA_EARLY", "soon")
    with pytest.raises(ValueError, match="VLMCTL_ATTN_CUDA_EARLY='soon': expected 0 or 1"):
        PA.reads_early()
    monkeypatch.delenv("VLMCTL_ATTN_CUDA_EARLY")
    assert not PA.selected(x, n_q=1, n_kv=1)  # never asks the tensors
    cache = torch.zeros(2, 16, 1, 128)
    args = (x, torch.zeros(8, 128), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), cache, cache,
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "all")  # a measurement: what it cannot take is an error
    with pytest.raises(ValueError, match="VLMCTL_ATTN_CUDA=all, but .* cannot run here: not a CUDA tensor"):
        PA.selected(*args, n_q=1, n_kv=1)
    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "1")  # the would-be default: the Triton kernel takes it
    assert not PA.selected(*args, n_q=1, n_kv=1)
    assert PA.unsupported(*args, n_q=1, n_kv=1, num_splits=PA.MAX_SPLITS + 1) == "33 context splits (at most 32)"
    src = PA.source()
    assert f"#define MAX_SPLITS {PA.MAX_SPLITS} " in src  # the kernel's register array holds that many
    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "1")
    big = torch.zeros(PA.MAX_BATCH + 1, 3 * 128)
    assert not PA.selected(big, n_q=1, n_kv=1)  # "1": larger batches keep the Triton kernel


def _case(dtype, n_q, n_kv, d, bs, lens, pos_dtype, seed=5, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    maxb = -(-max(lens) // bs) + 1
    nblocks = B * maxb + 1
    lens = torch.tensor(lens, dtype=torch.int32)
    # each sequence owns its blocks, as in the engine's pool
    tables = (torch.randperm(nblocks - 1, generator=g)[:B * maxb].view(B, maxb) + 1).to(torch.int32)
    slots = torch.tensor([int(tables[b, (int(lens[b]) - 1) // bs]) * bs + (int(lens[b]) - 1) % bs for b in range(B)])
    kc = (torch.randn(nblocks, bs, n_kv, d, generator=g) * 2).to(device, dtype)
    vc = torch.randn(nblocks, bs, n_kv, d, generator=g).to(device, dtype)
    qkv = torch.randn(B, (n_q + 2 * n_kv) * d, generator=g).to(device, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(4096).float()[:, None] * inv
    cos_sin = torch.cat((f.cos(), f.sin()), -1).to(device)
    pos = (lens.long() - 1 + 3).to(pos_dtype).to(device)  # rotary positions need not equal cache indices
    return qkv, cos_sin, pos, slots.to(pos_dtype).to(device), kc, vc, tables.to(device), lens.to(device)


def _reference(qkv, cos_sin, pos, slots, kc, vc, tables, lens, n_q, n_kv, window):
    """(output in float32, K cache, V cache) after the reference operations: rotary and append, then attention."""
    B, d = qkv.shape[0], kc.shape[-1]
    kc_ref, vc_ref, qkv_ref = kc.clone(), vc.clone(), qkv.clone()
    ops.rope_and_cache_reference(qkv_ref, cos_sin, pos.long(), n_q, n_kv, d, kc_ref, vc_ref, slots.long())
    want = ops.paged_decode_reference(qkv_ref[:, :n_q * d].view(B, n_q, d).float(), kc_ref.float(), vc_ref.float(),
                                      tables, lens, d ** -0.5, window)
    return want, kc_ref, vc_ref


HOST = cuda_host.unavailable()


@pytest.mark.skipif(HOST is not None, reason=f"the CUDA kernel cannot run on the host: {HOST}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_kv,d,bs,splits,window", [
    (4, 4, 32, 8, 1, None), (4, 4, 32, 16, 3, None), (8, 2, 32, 16, 4, 7), (14, 2, 32, 8, 16, None),
    (6, 2, 64, 16, 2, 33), (2, 1, 128, 16, 32, None), (8, 1, 256, 16, 2, None)])
def test_on_the_host_against_reference(dtype, n_q, n_kv, d, bs, splits, window, monkeypatch):
    """The kernel's C++ run on the CPU (tests/cuda_host.py) through its real launcher, `decode_rope`: the
    reference's result within the dtype's rounding, its appended K/V rows bit for bit and nothing else in the
    cache moved, the counters back at zero, q/k/v read only after the PDL wait (they hold NaN until it), and
    the same bits for another order of blocks, threads and copy arrivals and with the wait first
    (`VLMCTL_ATTN_CUDA_EARLY=0`). Groups of 1-7 q heads (7 in the instance for 8), head sizes 32-256, contexts
    from the new token alone to many tiles, windows."""
    from vlmctl.runtime.kernels.paged_attention import split_workspace

    lens = [1, 17, 45, 160] if d < 256 else [1, 40]
    pos_dtype = torch.int64 if splits % 2 else torch.int32
    case = _case(dtype, n_q, n_kv, d, bs, lens, pos_dtype, device="cpu")
    qkv, cos_sin, pos, slots, kc, vc, tables, lens_t = case
    want, kc_ref, vc_ref = _reference(*case, n_q, n_kv, window)
    outs = []
    for seed, early in ((0, "1"), (1, "0")):
        monkeypatch.setenv("VLMCTL_ATTN_CUDA_EARLY", early)
        rtc = cuda_host.HostRTC(guard=0, seed=seed)
        monkeypatch.setattr(cuda_rtc, "load_kernel", rtc.load_kernel)
        k, v = kc.clone(), vc.clone()
        out = torch.empty(len(lens), n_q, d, dtype=dtype)
        part, ml, cnt = split_workspace(len(lens), n_q, d, splits, "cpu") if splits > 1 else (None, None, None)
        PA.decode_rope(qkv, cos_sin, pos, slots, k, v, tables, lens_t, out, part, ml, cnt, d ** -0.5, n_q, n_kv,
                       splits, window)
        assert rtc.launched == [PA.kernel_name(d, n_q // n_kv, dtype)]
        eps = torch.finfo(dtype).eps
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 2 * eps, err
        assert torch.equal(k, kc_ref) and torch.equal(v, vc_ref)
        if cnt is not None:
            assert torch.count_nonzero(cnt) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def _run(env, monkeypatch, qkv, cos_sin, pos, slots, kc, vc, tables, lens, n_q, n_kv, splits, window, ws=None):
    from vlmctl.runtime.kernels.paged_attention import paged_decode_rope, split_workspace

    monkeypatch.setenv("VLMCTL_ATTN_CUDA", env)
    d = kc.shape[-1]
    if ws is None and splits > 1:
        ws = split_workspace(qkv.shape[0], n_q, d, splits, "cuda")
    out = paged_decode_rope(qkv, cos_sin, pos, slots, kc, vc, tables, lens, d ** -0.5, n_q, n_kv, num_splits=splits,
                            workspace=ws, window=window)
    torch.cuda.synchronize()
    return out, ws


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU of compute capability 8.0 or later")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_kv,d", [(4, 4, 32), (8, 2, 32), (14, 2, 128), (32, 32, 128)])
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("splits", [1, 2, 4, 16, 32])
@pytest.mark.parametrize("window", [None, 7, 100])
def test_against_reference_and_triton(dtype, n_q, n_kv, d, bs, splits, window, monkeypatch):
    lens = [1, 20, 45, 200, 657]  # context incl. the new token: none cached, part of a tile, several tiles
    pos_dtype = torch.int64 if splits != 2 else torch.int32
    qkv, cos_sin, pos, slots, kc, vc, tables, lens_t = _case(dtype, n_q, n_kv, d, bs, lens, pos_dtype)
    want, kc_ref, vc_ref = _reference(qkv, cos_sin, pos, slots, kc, vc, tables, lens_t, n_q, n_kv, window)
    tri, _ = _run("0", monkeypatch, qkv, cos_sin, pos, slots, kc.clone(), vc.clone(), tables, lens_t, n_q, n_kv, splits,
                  window)
    kc0, vc0 = kc.clone(), vc.clone()
    got, ws = _run("all", monkeypatch, qkv, cos_sin, pos, slots, kc, vc, tables, lens_t, n_q, n_kv, splits, window)
    eps = torch.finfo(dtype).eps
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 2 * eps, err  # float32 arithmetic, then one rounding of the output
    assert ((got.float() - tri.float()).norm() / want.norm()).item() < 3 * eps
    # the appended rows are the reference's bit for bit (each product rounded as torch rounds it; the Triton
    # kernel's K may differ by one rounding where its compiler fuses a product into an FMA), nothing else moved
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    if ws is not None:
        assert torch.count_nonzero(ws[2]) == 0  # the counters are back at zero for the next call
    monkeypatch.setenv("VLMCTL_ATTN_CUDA_EARLY", "0")  # the build that waits first computes the same bits
    again, _ = _run("all", monkeypatch, qkv, cos_sin, pos, slots, kc0, vc0, tables, lens_t, n_q, n_kv, splits, window, ws)
    assert torch.equal(again, got) and torch.equal(kc0, kc) and torch.equal(vc0, vc)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU of compute capability 8.0 or later")
@pytest.mark.parametrize("splits", [1, 16])
def test_in_a_graph_behind_the_kernel_that_writes_its_input(splits, monkeypatch):
    """q, k and v are read after the wait: with the kernel graphed behind a PDL kernel that writes its qkv rows
    (an RMSNorm into the buffer), every replay equals the eager result for that step's rows."""
    from vlmctl.runtime.kernels import fused, pdl
    from vlmctl.runtime.kernels.paged_attention import paged_decode_rope, split_workspace

    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "all")  # "all": an error, not the Triton kernel, where it cannot run
    n_q = n_kv = 32
    d = 128
    qkv, cos_sin, pos, slots, kc, vc, tables, lens = _case(torch.float16, n_q, n_kv, d, 16, [300], torch.int32)
    src = torch.randn(1, qkv.shape[1], device="cuda", dtype=torch.float16) * 3
    w = torch.ones(qkv.shape[1], device="cuda", dtype=torch.float16)
    ws = split_workspace(1, n_q, d, splits, "cuda") if splits > 1 else None
    kc_g, vc_g = kc.clone(), vc.clone()

    def step(kcache, vcache):
        fused.add_rms_norm(src, w, 1e-6, out=qkv)
        return paged_decode_rope(qkv, cos_sin, pos, slots, kcache, vcache, tables, lens, d ** -0.5, n_q, n_kv,
                                 num_splits=splits, workspace=ws)

    step(kc_g.clone(), vc_g.clone())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(kc_g, vc_g)
    for i in range(3):
        src.normal_()
        g.replay()
        torch.cuda.synchronize()
        want = step(kc.clone(), vc.clone())
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
    assert pdl.enabled(qkv.device) == (torch.cuda.get_device_capability() >= (9, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU of compute capability 8.0 or later")
@pytest.mark.parametrize("group", [None, 64])
def test_decoder_steps_follow_the_triton_kernel(group, monkeypatch):
    """A random decoder (fp16 weights, or AWQ's) stepping 40 tokens from one prompt: with the CUDA attention each
    step's logits and appended K/V are within fp16 noise of the Triton kernel's, and the greedy tokens agree."""
    import sys
    from pathlib import Path

    import numpy as np

    from vlmctl.runtime.decoder import Chunk

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu as D

    cfg = D.llama7b_config(3, {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 2000})
    dec = D.make_decoder(cfg, D.random_hf_state(cfg, "cuda", 0), group)
    dec.allocate_cache(64, 16)
    dec.use_graphs = False  # the switch is read at each eager step (graphs read it when captured)
    bs, n = dec.block_size, 300
    ids = np.random.default_rng(0).integers(0, dec.vocab_size, n)
    table = list(range(1, 1 + -(-(n + 80) // bs)))
    monkeypatch.setenv("VLMCTL_ATTN_CUDA", "0")
    tok = int(dec.forward([Chunk(ids, np.arange(n), 0, table)]).argmax(-1)[0])

    def step(env, p):
        monkeypatch.setenv("VLMCTL_ATTN_CUDA", env)
        slot = table[p // bs] * bs + p % bs
        logits = dec.decode(np.array([tok]), np.array([p]), np.array([slot]), [table], np.array([p + 1])).float()
        return logits, dec.k_cache[:, slot // bs, slot % bs].float(), dec.v_cache[:, slot // bs, slot % bs].float()

    agree = 0
    for i in range(40):
        la, ka, va = step("0", n + i)
        lb, kb, vb = step("all", n + i)  # "all": never the Triton kernel in its place
        assert float((la - lb).abs().max()) <= 1e-2 * float(la.abs().max())
        assert float((ka - kb).abs().max()) <= 1e-2 * float(ka.abs().max())
        assert float((va - vb).abs().max()) <= 1e-2 * float(va.abs().max())
        # layer 0's V comes from the same embedding in both steps and is copied as it is; later layers' V
        # follow the earlier layers' attention, whose sums differ in rounding
        assert torch.equal(va[0], vb[0])
        agree += int(la.argmax() == lb.argmax())
        tok = int(la.argmax())
    assert agree >= 38
