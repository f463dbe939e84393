"""W4A16: the packed layout, the exact repack from AutoAWQ's GEMM layout, and the Triton kernels.

The reference for every kernel result is an fp32 matmul of x with `dequantize(packed)` rounded to the
activation dtype (what a dequantize-then-cuBLAS path computes). Tolerance, on the norm-wise relative
error ||y - ref|| / ||ref||: 2 units of roundoff of the activation dtype (fp16 2**-10, bf16 2**-7).
Why that bound: the kernels dequantize exactly in fp32 and accumulate in fp32, so what remains is the
single rounding of each output to fp16/bf16 (at most one unit of roundoff per element), fp32
accumulation-order differences (~2**-24 * sqrt(K), negligible here), and on the bf16 GEMV path weights
that were never rounded to bf16 (the reference rounds them; one more unit at most).

On a machine without CUDA the kernel tests run in Triton's interpreter (TRITON_INTERPRET=1) on small
shapes; with CUDA they run on the device. `gpu`-marked tests repeat the comparison at LLaVA-1.5-7B
shapes and check CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from vlmctl.errors import OptionError
from vlmctl.formats.awq_gemm import dequantize_gemm, pack_gemm
from vlmctl.runtime.kernels import w4a16 as W

HAS_CUDA = torch.cuda.is_available()
TOL = {torch.float16: 2 * 2.0 ** -11, torch.bfloat16: 2 * 2.0 ** -8}


def _random_awq(n, k, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.05 + 1e-3).half()
    qweight, qzeros = pack_gemm(codes, zeros)
    return codes, zeros, scales, qweight, qzeros


# ------------------------------------------------------------------------------------------ layout


def test_nibble_order_and_sign_bit():
    """The code of k = 8j + 2t + e sits in bits 4t+16e of word j; a 15 in the top nibble makes it negative."""
    codes = torch.zeros(3, 16, dtype=torch.long)
    codes[0, 3] = 5  # word 0, t = 1, e = 1 -> bits 20..23
    codes[1, 15] = 15  # word 1, t = 3, e = 1 -> bits 28..31 (the sign nibble)
    codes[2, 8 + 6] = 9  # word 1, t = 3, e = 0 -> bits 12..15
    p = W.pack(codes, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1).half(), 16)
    assert p["q4weight"].dtype == torch.int32 and tuple(p["q4weight"].shape) == (3, 2)
    assert int(p["q4weight"][0, 0]) == 5 << 20 and int(p["q4weight"][0, 1]) == 0
    assert int(p["q4weight"][1, 1]) == -(1 << 28) and int(p["q4weight"][1, 0]) == 0  # 0xF0000000 as int32
    assert int(p["q4weight"][2, 1]) == 9 << 12
    # the same interleave as AutoAWQ's (along N there, along K here)
    from vlmctl.formats.awq_gemm import ORDER

    assert W.ORDER == ORDER
    assert p["q4zeros"].dtype == torch.uint8 and p["q4scales"].dtype == torch.float16


@pytest.mark.parametrize("n,k,g", [(104, 256, 64), (24, 512, 128), (8, 192, 64), (40, 96, 32)])
def test_pack_unpack_and_dequantize_formula(n, k, g):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3).half()
    p = W.pack(codes, zeros, scales, g)
    assert W.check_packed(p, g) == (n, k)
    c2, z2, s2 = W.unpack(p)
    assert torch.equal(c2.long(), codes) and torch.equal(z2.long(), zeros) and torch.equal(s2, scales)
    # the formula written out independently of the module, one element at a time for a few entries
    w = W.dequantize(p, g)
    for (r, col) in [(0, 0), (n - 1, k - 1), (n // 2, g), (1, k // 2 + 3)]:
        expect = (int(codes[r, col]) - int(zeros[r, col // g])) * float(scales[r, col // g])
        assert float(w[r, col]) == expect
    assert W.dequantize(p, g, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("n,k,g", [(104, 256, 64), (24, 512, 128), (8 * 17, 384, 128), (576, 576, 64)])
def test_repack_awq_gemm_is_exact(n, k, g):
    codes, zeros, scales, qweight, qzeros = _random_awq(n, k, g, seed=n * k)
    p = W.repack_awq_gemm(qweight, qzeros, scales, g)
    assert W.check_packed(p, g) == (n, k)
    assert torch.equal(W.dequantize(p, g), dequantize_gemm(qweight, qzeros, scales, 4, g))
    c2, z2, s2 = W.unpack(p)
    assert torch.equal(c2.long(), codes) and torch.equal(z2.long(), zeros) and torch.equal(s2, scales.t())


def test_repack_of_fused_linears_is_the_concatenation():
    """qkv / gate_up: AutoAWQ tensors concatenated along the output axis (as layout.fuse_decoder does)
    repack to the dim-0 concatenation of the parts, and dequantize to the stacked weights."""
    g, k = 64, 256
    parts = [_random_awq(n, k, g, seed=i) for i, n in enumerate((64, 24, 40))]
    cat = [torch.cat([p[j] for p in parts], 1) for j in (2, 3, 4)]  # scales, qweight, qzeros
    fused = W.repack_awq_gemm(cat[1], cat[2], cat[0], g)
    singles = [W.repack_awq_gemm(p[3], p[4], p[2], g) for p in parts]
    for key in W.KEYS:
        assert torch.equal(fused[key], torch.cat([s[key] for s in singles], 0))
    stacked = torch.cat([dequantize_gemm(p[3], p[4], p[2], 4, g) for p in parts], 0)
    assert torch.equal(W.dequantize(fused, g), stacked)


def test_repack_in_several_chunks(monkeypatch):
    """A linear wider than one repack chunk (chunks bound build-time memory) repacks exactly."""
    from vlmctl.formats import w4a16 as layout

    monkeypatch.setattr(layout, "_REPACK_CHUNK_ELEMS", 3 * 256)  # 3 words per row -> 24 output columns per chunk
    g, k = 128, 256
    n = 8 * 13
    codes, zeros, scales, qweight, qzeros = _random_awq(n, k, g, seed=3)
    p = W.repack_awq_gemm(qweight, qzeros, scales, g)
    c2, z2, _ = W.unpack(p)
    assert torch.equal(c2.long(), codes) and torch.equal(z2.long(), zeros)


@pytest.mark.parametrize("bad", ["group", "zeros_shape", "scales_shape"])
def test_repack_rejects_inconsistent_tensors(bad):
    _, _, scales, qweight, qzeros = _random_awq(16, 128, 64)
    if bad == "group":
        with pytest.raises(ValueError, match="group size"):
            W.repack_awq_gemm(qweight, qzeros, scales, 48)
    elif bad == "zeros_shape":
        with pytest.raises(ValueError, match="inconsistent"):
            W.repack_awq_gemm(qweight, qzeros[:1], scales, 64)
    else:
        with pytest.raises(ValueError, match="inconsistent"):
            W.repack_awq_gemm(qweight, qzeros, scales[:, :8], 64)


def test_check_packed_rejects_wrong_dtypes():
    codes, zeros, scales, qweight, qzeros = _random_awq(16, 128, 64)
    p = W.repack_awq_gemm(qweight, qzeros, scales, 64)
    with pytest.raises(ValueError, match="q4zeros"):
        W.check_packed({**p, "q4zeros": p["q4zeros"].to(torch.int32)}, 64)
    with pytest.raises(ValueError, match="lacks"):
        W.check_packed({"q4weight": p["q4weight"]}, 64)


def test_reference_linear_on_cpu_matches_dense_and_caches():
    g = 64
    codes, zeros, scales, qweight, qzeros = _random_awq(48, 128, g, seed=5)
    p = W.repack_awq_gemm(qweight, qzeros, scales, g)
    dense = dequantize_gemm(qweight, qzeros, scales, 4, g)
    x = torch.randn(2, 3, 128)
    bias = torch.randn(48)
    y = W.w4a16_linear(x, p, g, bias)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, x @ dense.T + bias, rtol=1e-5, atol=1e-5)
    cached = W._DEQ_CACHE[id(p["q4weight"])][(torch.float32, x.device)]
    W.w4a16_linear(x, p, g)
    assert W._DEQ_CACHE[id(p["q4weight"])][(torch.float32, x.device)] is cached
    with pytest.raises(ValueError, match="features"):
        W.w4a16_linear(torch.randn(2, 64), p, g)


def test_module_import_is_light_and_works_without_triton():
    """Importing the module pulls neither torch nor triton; with triton unimportable the reference path runs."""
    code = ("import sys; import vlmctl.runtime.kernels.w4a16 as W; "
            "print('torch' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch; from vlmctl.runtime.kernels import w4a16 as W\n"
            "assert not W.triton_available()\n"
            "codes = torch.randint(0, 16, (16, 64)); z = torch.randint(0, 16, (16, 1)); s = torch.rand(16, 1).half()\n"
            "p = W.pack(codes, z, s, 64); x = torch.randn(3, 64)\n"
            "y = W.w4a16_linear(x, p, 64)\n"
            "assert torch.allclose(y, x @ W.dequantize(p, 64).T, atol=1e-5)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_configs_fit_odd_shapes():
    assert W._fit_block_k(256, 11008, 128) == 256 and W._fit_block_k(512, 11008, 128) == 256
    assert W._fit_block_k(256, 576, 64) == 64
    for m in (1, 3, 16, 17, 64, 130, 2048):
        for n, k, g in ((12288, 4096, 128), (4096, 11008, 128), (1536, 576, 64), (104, 192, 64), (48, 96, 24)):
            c = W.heuristic_config(m, n, k, g)
            assert c.valid_for(n, k, g), (m, n, k, g, c)
            assert all(cc.valid_for(n, k, g) for cc in W.candidate_configs(m, n, k, g))


def test_tuned_table_round_trip(tmp_path):
    before = dict(W._TUNED)
    try:
        cfg = W.Config("gemv", 16, 256, 1, 4, 2, 2)
        W.set_config(1, 4096, 4096, 128, torch.float16, cfg)
        path = tmp_path / "t.json"
        W.save_tuned(path)
        W._TUNED.clear()
        assert W.load_tuned(path) >= 1
        assert W.select_config(1, 4096, 4096, 128, torch.float16) == cfg
    finally:
        W._TUNED.clear()
        W._TUNED.update(before)



def test_table_setting_reads_another_table_or_none(monkeypatch, tmp_path):
    """VLMCTL_W4A16_TABLE: a table file read in place of the shipped one (its entries decide), off (the rules
    decide), a path that is not a file (a clear error); unset again, the shipped table is back."""
    monkeypatch.delenv("VLMCTL_W4A16_TABLE", raising=False)
    shipped = W.select_config(1, 4096, 4096, 128, torch.float32)
    rule = W.heuristic_config(1, 4096, 4096, 128)
    pinned = W.Config("gemv", 16, 256, 1, 4, 2, 2)
    assert pinned not in (shipped, rule)
    table = tmp_path / "mine.json"
    table.write_text(json.dumps({"format": W.FORMAT, "entries": [
        {"device": "cpu", "bucket": 1, "n": 4096, "k": 4096, "group_size": 128, "dtype": "float32",
         "config": dataclasses.asdict(pinned)}]}))
    try:
        monkeypatch.setenv("VLMCTL_W4A16_TABLE", str(table))
        assert W.tuned_table_source() == str(table)
        assert W.select_config(1, 4096, 4096, 128, torch.float32) == pinned
        assert W.select_config(1, 4096, 11008, 128, torch.float32) == W.heuristic_config(1, 4096, 11008, 128)
        monkeypatch.setenv("VLMCTL_W4A16_TABLE", "off")
        assert W.select_config(1, 4096, 4096, 128, torch.float32) == rule
        monkeypatch.setenv("VLMCTL_W4A16_TABLE", str(tmp_path / "missing.json"))
        with pytest.raises(OptionError, match="VLMCTL_W4A16_TABLE"):
            W.select_config(1, 4096, 4096, 128, torch.float32)
        for name, text in (("broken.json", "{\"format\": "), ("other.json", json.dumps({"format": "gemv/1"})),
                           ("list.json", "[]")):
            (tmp_path / name).write_text(text)
            monkeypatch.setenv("VLMCTL_W4A16_TABLE", str(tmp_path / name))
            for _ in range(2):  # refused again on the next selection, not left as an empty table
                with pytest.raises(OptionError, match="is not a W4A16 tuned table"):
                    W.select_config(1, 4096, 4096, 128, torch.float32)
        monkeypatch.setenv("VLMCTL_W4A16_TABLE", str(table))
        assert W.select_config(1, 4096, 4096, 128, torch.float32) == pinned
    finally:
        monkeypatch.delenv("VLMCTL_W4A16_TABLE")
    assert W.select_config(1, 4096, 4096, 128, torch.float32) == shipped
    assert W.tuned_table_source() == str(W.TUNED_TABLE)


# ------------------------------------------------------------------------------------------ kernels


@pytest.fixture
def kern(triton_device):
    """conftest's `triton_device`, with the interpreter's bf16 fixes applied on the CPU."""
    if triton_device == "cuda":
        return "cuda"
    from vlmctl.runtime.kernels import _interpreter

    _interpreter.patch()  # the interpreter's bf16 tl.dot and float32 -> bf16 rounding (see that module)
    return "cpu"


def _case(n, k, g, seed, device):
    codes, zeros, scales, qweight, qzeros = _random_awq(n, k, g, seed)
    p = W.repack_awq_gemm(qweight, qzeros, scales, g)
    return {key: t.to(device) for key, t in p.items()}


def _check(y, x, packed, g, bias, dtype, tol_mult=1.0):
    w = W.dequantize(packed, g, dtype).float()
    ref = x.float() @ w.T
    if bias is not None:
        ref = ref + bias.float()
    assert y.dtype == dtype and y.shape == ref.shape
    err = float((y.float() - ref).norm() / ref.norm())
    tol = TOL[dtype] * tol_mult
    assert err <= tol, f"relative error {err:.2e} > {tol:.2e}"
    return err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g,k", [(64, 256), (128, 512)])
def test_kernel_heuristic_configs_match_reference(kern, dtype, g, k):
    """What w4a16_linear runs on a GPU (the untuned heuristic), for M in 1, 3, 16, 17, 64, 130, with bias."""
    n = 104  # an odd multiple of 8: the last N tile is partial
    p = _case(n, k, g, seed=k + g, device=kern)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=gen).to(dtype).to(kern)
    for m in (1, 3, 16, 17, 64, 130):
        x = torch.randn(m, k, generator=gen).to(dtype).to(kern)
        cfg = W.heuristic_config(m, n, k, g)
        if cfg.kernel == "dequant_mm":
            cfg = W.Config("dot", 64, 64, 128, 1, 4, 2)  # the interpreter has no cuBLAS; test the GEMM form
        y = W.launch(x, p, g, cfg, bias=bias)
        _check(y, x, p, g, bias, dtype)


SPLIT_CONFIGS = [
    W.Config("gemv", 16, 64, 1, 1, 4, 2),  # block inside a group, register prefetch
    W.Config("gemv", 32, 256, 1, 2, 4, 2),  # block spanning groups, split-K
    W.Config("gemv", 8, 64, 1, 3, 2, 1),  # uneven split-K (K blocks not a multiple of 3), no prefetch
    W.Config("gemv", 16, 64, 1, 5, 1, 2),  # prefetch with an empty last split slice (8 blocks, 5 slices)
    W.Config("gemv", 8, 64, 1, 3, 2, 2, k_major=True),  # the K slices of a row tile launched side by side
    W.Config("dot", 16, 32, 16, 5, 4, 2),  # split-K with an empty last slice
    W.Config("dot", 16, 32, 16, 3, 4, 2, k_major=True),  # split-K, K-major grid
    W.Config("dot", 32, 256, 32, 2, 4, 2),
    W.Config("dot", 64, 128, 64, 1, 4, 3),
]


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=W.describe)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_configs_and_split_k(kern, cfg, dtype):
    g, n, k = 64, 40, 512
    p = _case(n, k, g, seed=7, device=kern)
    gen = torch.Generator().manual_seed(2)
    for m in ((1, 2) if cfg.kernel == "gemv" else (1, 5)):  # the GEMV runs one program per row
        x = torch.randn(m, k, generator=gen).to(dtype).to(kern)
        bias = torch.randn(n, generator=gen).to(dtype).to(kern) if m > 1 else None
        y = W.launch(x, p, g, cfg, bias=bias)
        _check(y, x, p, g, bias, dtype)
        assert torch.equal(W.launch(x, p, g, cfg, bias=bias), y), "split-K must be deterministic"
    cnt = W._WS[str(x.device)]["cnt"]
    assert int(cnt.abs().sum()) == 0, "split-K tile counters must be reset for the next launch"


def test_kernel_group_size_24(kern):
    """A group size that is a multiple of 8 but not a power of two: K blocks of 8 inside the groups."""
    g, n, k = 24, 16, 96
    p = _case(n, k, g, seed=13, device=kern)
    x = torch.randn(1, k).half().to(kern)
    cfg = W.heuristic_config(1, n, k, g)
    assert cfg.kernel == "gemv" and cfg.block_k == 8
    _check(W.launch(x, p, g, cfg), x, p, g, None, torch.float16)


def test_kernel_strided_rows(kern):
    """x rows with a stride larger than K (a view of a wider tensor)."""
    g, n, k = 64, 24, 128
    p = _case(n, k, g, seed=9, device=kern)
    base = torch.randn(4, 2 * k).half().to(kern)
    x = base[:, :k]
    y = W.launch(x, p, g, W.Config("dot", 16, 64, 16, 2, 4, 2))
    _check(y, x, p, g, None, torch.float16)


def test_dequantize_kernel_matches_reference(kern):
    for g, k in ((64, 256), (128, 512)):
        p = _case(40, k, g, seed=11, device=kern)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            w = torch.empty(40, k, dtype=dtype, device=kern)
            W.dequantize_into(p, g, w)
            assert torch.equal(w, W.dequantize(p, g, dtype))


# ------------------------------------------------------------------------------------------ GPU

LLAVA_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(LLAVA_7B))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_7b_shapes_match_reference(name, dtype):
    n, k = LLAVA_7B[name]
    g = 128
    p = _case(n, k, g, seed=n, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 8, 16, 33, 64, 128, 512, 2048):
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        # cuBLAS (the dequantize + cuBLAS path) may reduce split-K partials in fp16/bf16
        # (torch's allow_fp16_reduced_precision_reduction): one more rounding allowed there
        mult = 2.0 if W.select_config(m, n, k, g, dtype, x.device).kernel == "dequant_mm" else 1.0
        _check(W.w4a16_linear(x, p, g), x, p, g, None, dtype, mult)
    for cfg in W.candidate_configs(1, n, k, g)[:6] + W.candidate_configs(16, n, k, g)[:6]:
        x = torch.randn(3, k, generator=gen, device="cuda").to(dtype)
        _check(W.launch(x, p, g, cfg), x, p, g, None, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_dequantize_bf16_exact_and_cuda_graph():
    g, n, k = 128, 4096, 4096
    p = _case(n, k, g, seed=1, device="cuda")
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    W.dequantize_into(p, g, w)
    assert torch.equal(w, W.dequantize(p, g, torch.bfloat16))
    bias = torch.randn(n, device="cuda").half()
    ms = (1, 4, 16, 64)
    W.warmup([p], g, ms, torch.float16, device="cuda")
    xs = {m: torch.randn(m, k, device="cuda").half() for m in ms}
    eager = {m: W.w4a16_linear(xs[m], p, g, bias) for m in ms}
    graph = torch.cuda.CUDAGraph()
    outs = {}
    with torch.cuda.graph(graph):
        for m in ms:
            outs[m] = W.w4a16_linear(xs[m], p, g, bias)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for m in ms:
        assert torch.equal(outs[m], eager[m]), f"graph replay differs from eager at M={m}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_graph_survives_later_larger_calls():
    """A decode graph captured at small M must keep its results after a larger (prefill-sized) call
    grows the shared split-K buffers: the engine prefills between decode-graph replays."""
    g, n, k = 128, 4096, 4096
    p = _case(n, k, g, seed=3, device="cuda")
    W.warmup([p], g, (1, 8), torch.float16, device="cuda")
    xs = {m: torch.randn(m, k, device="cuda").half() for m in (1, 8)}
    eager = {m: W.w4a16_linear(xs[m], p, g) for m in xs}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {m: W.w4a16_linear(xs[m], p, g) for m in xs}
    for m_big in (128, 512, 2048):  # every path that may grow a buffer
        W.w4a16_linear(torch.randn(m_big, k, device="cuda").half(), p, g)
        torch.cuda.empty_cache()
        for o in outs.values():
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for m in xs:
            assert torch.equal(outs[m], eager[m]), f"graph at M={m} broken after a call at M={m_big}"


# ------------------------------------------------------------------------------------------ half2 GEMV
# The half2 GEMV ("gemv_h2", fp16 only) rounds each dequantized weight to fp16 (as the reference
# does), each product x * w to fp16, and each partial sum of a run (8 or 16 products) to fp16 before
# the fp32 accumulation; then the output to fp16. Each of those roundings is at most 2**-11 relative,
# the run's sum holds at most 15 of them, and they do not all line up: the bound tested, on the
# norm-wise error against a float64 product with the fp16-rounded dequantized weights, is
# 2**-9 (~2e-3, four units of fp16 roundoff). The interpreter runs the Triton-op form (tree sums); the
# inline-PTX form (chained sums) runs on a GPU (the gpu-marked tests below).
H2_TOL = 2.0 ** -9

H2_CONFIGS = [
    W.Config("gemv_h2", 16, 64, 1, 1, 4, 1, 2),  # block inside a group, no prefetch
    W.Config("gemv_h2", 32, 256, 1, 2, 2, 2, 2),  # block spanning groups, split-K, prefetch
    W.Config("gemv_h2", 8, 128, 1, 3, 1, 2, 1),  # runs of one word, uneven split-K
    W.Config("gemv_h2", 16, 64, 1, 5, 1, 2, 2),  # an empty last split slice (8 blocks, 5 slices)
    W.Config("gemv_h2", 16, 64, 1, 5, 1, 2, 2, k_major=True),  # the same, K-major grid
    W.Config("gemv_h2", 8, 128, 1, 2, 1, 1, 2, k_major=True),  # K-major, no prefetch
]


def _check_f64(y, x, packed, g, bias, tol):
    w = W.dequantize(packed, g, torch.float16).double()  # the fp16 weights, computed without the kernels
    ref = x.double() @ w.T
    if bias is not None:
        ref = ref + bias.double()
    err = float((y.double() - ref).norm() / ref.norm())
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert err <= tol, f"relative error {err:.2e} > {tol:.2e}"
    return err


@pytest.mark.parametrize("cfg", H2_CONFIGS, ids=W.describe)
def test_h2_gemv_configs_and_split_k(kern, cfg):
    g, n, k = 64, 40, 512  # N = 40: the last row tile is partial for every block_n here but 8
    p = _case(n, k, g, seed=17, device=kern)
    gen = torch.Generator().manual_seed(4)
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen).half().to(kern)
        bias = torch.randn(n, generator=gen).half().to(kern) if m > 1 else None
        y = W.launch(x, p, g, cfg, bias=bias)
        _check_f64(y, x, p, g, bias, H2_TOL)
        assert torch.equal(W.launch(x, p, g, cfg, bias=bias), y), "split-K must be deterministic"
    assert int(W._WS[str(x.device)]["cnt"].abs().sum()) == 0, "split-K tile counters must be reset"


def test_h2_gemv_large_activations_do_not_overflow(kern):
    """Activations in the thousands (LLaMA-style outliers): the products are of scaled weights, so the
    fp16 runs stay finite."""
    g, n, k = 128, 16, 256
    p = _case(n, k, g, seed=19, device=kern)
    x = torch.randn(1, k).half()
    x[0, :16] = 3000.0
    x = x.to(kern)
    y = W.launch(x, p, g, W.Config("gemv_h2", 16, 128, 1, 1, 1, 1, 2))
    assert torch.isfinite(y).all()
    _check_f64(y, x, p, g, None, H2_TOL)


def test_h2_selection_follows_the_table_and_the_switch(monkeypatch):
    """auto (default) and triton: the half2 GEMV, with the config the tuned table pins for this device
    (none for the CPU here) or else its heuristic; cublas: never."""
    monkeypatch.delenv("VLMCTL_GEMV", raising=False)
    assert W.select_config(1, 4096, 4096, 128, torch.float16) == W.heuristic_h2_config(1, 4096, 4096, 128)
    h2 = W.h2_candidate_configs(1, 4096, 4096, 128)[-1]
    assert h2 != W.heuristic_h2_config(1, 4096, 4096, 128)
    try:
        W._TUNED_H2[(W._device_name(None), 1, 4096, 4096, 128, "float16")] = h2
        assert W.select_config(1, 4096, 4096, 128, torch.float16) == h2
        monkeypatch.setenv("VLMCTL_GEMV", "cublas")
        assert W.select_config(1, 4096, 4096, 128, torch.float16).kernel != "gemv_h2"
    finally:
        W._TUNED_H2.pop((W._device_name(None), 1, 4096, 4096, 128, "float16"), None)
    monkeypatch.setenv("VLMCTL_GEMV", "triton")
    c = W.select_config(1, 4096, 11008, 128, torch.float16)
    assert c.kernel == "gemv_h2" and c.valid_for(4096, 11008, 128)
    assert W.select_config(1, 4096, 4096, 128, torch.bfloat16).kernel != "gemv_h2"  # fp16 only
    assert W.select_config(16, 4096, 4096, 128, torch.float16).kernel != "gemv_h2"  # batch 1 only
    with pytest.raises(ValueError, match="fp16"):
        W.launch(torch.zeros(1, 256, dtype=torch.bfloat16), _case(8, 256, 128, 0, "cpu"), 128,
                 W.Config("gemv_h2", 8, 128, 1, 1, 1, 1, 2))


def test_h2_configs_and_table_round_trip(tmp_path):
    assert not W.Config("gemv_h2", 16, 64, 1, 1, 1, 1, 3).valid_for(16, 256, 64)  # run_words 1 or 2
    assert not W.Config("gemv_h2", 16, 8, 1, 1, 1, 1, 2).valid_for(16, 256, 64)  # one word per group block
    for name, (n, k) in LLAVA_7B.items():
        cands = W.h2_candidate_configs(1, n, k, 128)
        assert cands and all(c.kernel == "gemv_h2" and c.valid_for(n, k, 128) for c in cands), name
    tables = (W._TUNED, *W._VARIANT_TABLES.values())  # every table save_tuned writes
    saved = [dict(t) for t in tables]
    try:
        for t in tables:
            t.clear()
        c = W.Config("gemv_h2", 32, 256, 1, 4, 2, 2, 2)
        cu = W.Config("gemv_cuda", block_n=16, num_warps=4, num_stages=2)
        W.set_config(1, 4096, 4096, 128, torch.float16, c)
        W.set_config(1, 4096, 4096, 128, torch.float16, W.Config("gemv", 128, 64, 1, 8, 1, 2))
        W.set_config(1, 4096, 4096, 128, torch.float16, cu)  # same key, each kernel keeps its own entry
        W.save_tuned(tmp_path / "t.json")
        for t in tables:
            t.clear()
        assert W.load_tuned(tmp_path / "t.json") == 3
        assert list(W._TUNED_H2.values()) == [c] and list(W._TUNED.values())[0].kernel == "gemv"
        assert list(W._TUNED_CUDA.values()) == [cu]
    finally:
        for t, s in zip(tables, saved):
            t.clear()
            t.update(s)


# ------------------------------------------------------------------------------------------ act·mul epilogue
# A gate_up GEMV can return act(gate) * up itself (`launch(..., act=...)`, `w4a16_act_mul`): each tile
# holds a run of gate rows and their up rows. The result must equal the plain GEMV's output put through the
# act·mul kernel, bit for bit: same per-row arithmetic, same roundings.
ACT_CONFIGS = [
    (W.Config("gemv", 16, 64, 1, 1, 4, 2), torch.float16),  # no split: the epilogue stores directly
    (W.Config("gemv", 32, 256, 1, 2, 4, 2), torch.bfloat16),  # split-K: the last program applies it
    (W.Config("gemv", 8, 64, 1, 3, 2, 2, k_major=True), torch.float16),  # uneven split, K-major grid
    (W.Config("gemv_h2", 16, 64, 1, 1, 1, 2, 2), torch.float16),  # the shipped gate_up form: split 1
    (W.Config("gemv_h2", 32, 256, 1, 2, 2, 2, 2), torch.float16),
    (W.Config("gemv_h2", 16, 64, 1, 5, 1, 2, 2, k_major=True), torch.float16),  # an empty last slice
]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("cfg,dtype", ACT_CONFIGS, ids=[W.describe(c) for c, _ in ACT_CONFIGS])
def test_gemv_act_mul_epilogue_equals_the_act_mul_kernel(kern, cfg, dtype, activation):
    from vlmctl.runtime import ops
    from vlmctl.runtime.kernels.fused import act_mul

    g, n, k = 64, 2 * 36, 512  # I = 36: the last pair tile is partial for every block_n here
    p = _case(n, k, g, seed=23, device=kern)
    gen = torch.Generator().manual_seed(5)
    for m, with_bias in ((1, False), (2, True)):
        x = (torch.randn(m, k, generator=gen) * 4).to(dtype).to(kern)  # gate values well into SiLU's tails
        bias = torch.randn(n, generator=gen).to(dtype).to(kern) if with_bias else None
        plain = W.launch(x, p, g, cfg, bias=bias)
        fused = W.launch(x, p, g, cfg, bias=bias, act=activation)
        assert fused.shape == (m, n // 2) and fused.dtype == dtype
        assert torch.equal(fused, act_mul(plain, activation)), "the epilogue must equal the act·mul kernel"
        ref = ops.act_mul(plain.cpu(), activation)  # torch's form: the rounding the kernels follow
        assert float((fused.cpu().float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2.0 ** -7
    assert int(W._WS[str(x.device)]["cnt"].abs().sum()) == 0, "split-K tile counters must be reset"


def test_act_mul_launch_rejects_what_it_cannot_fuse():
    p = _case(24, 256, 128, 0, "cpu")
    x = torch.zeros(1, 256, dtype=torch.float16)
    # the CUDA GEMV pairs gate and up rows within a warp: one row per warp cannot
    for cfg in (W.Config("dot", 16, 64, 16, 1, 4, 2), W.Config("gemv_cuda", block_n=4, num_warps=4, num_stages=2)):
        with pytest.raises(ValueError, match="epilogue"):
            W.launch(x, p, 128, cfg, act="silu")


def test_w4a16_act_mul_declines_off_the_gpu_and_with_the_switch(monkeypatch):
    """None (the caller runs the linear and the act·mul kernel) on the CPU, for an odd N, and with
    VLMCTL_W4A16_ACT_MUL=0; the CPU engine path never reaches the kernels."""
    p = _case(16, 256, 128, 0, "cpu")
    assert W.w4a16_act_mul(torch.zeros(1, 256, dtype=torch.float16), p, 128, "silu") is None
    monkeypatch.setenv("VLMCTL_W4A16_ACT_MUL", "0")
    assert not W.act_mul_fusion_enabled()
    monkeypatch.setenv("VLMCTL_W4A16_ACT_MUL", "1")
    assert W.act_mul_fusion_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_act_mul_at_7b_gate_up_and_in_a_graph(dtype, activation, monkeypatch):
    """What the decoder runs at batch 1: `w4a16_act_mul` on LLaVA-1.5-7B's gate_up equals the same config's
    linear + the act·mul kernel bit for bit (a Triton GEMV) or that config's epilogue (the CUDA GEMV), eager
    and replayed from a CUDA graph; with the switch off it declines. Where selection picks a kernel without the
    fused epilogue (bf16 on an H200: the tensor-core GEMV's table entry), it declines, and the epilogue
    is checked on the Triton GEMV that selection falls back to without that kernel."""
    from vlmctl.runtime.kernels.fused import act_mul

    n, k = LLAVA_7B["gate_up"]
    g = 128
    p = _case(n, k, g, seed=3, device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    if W.select_config(1, n, k, g, dtype, x.device, act_mul=True).kernel not in W.ACT_MUL_KERNELS:
        assert W.w4a16_act_mul(x, p, g, activation) is None
        monkeypatch.setenv("VLMCTL_W4A16_MMA_GEMV", "0")
        assert W.select_config(1, n, k, g, dtype, x.device, act_mul=True).kernel in W.ACT_MUL_KERNELS
    W.warmup([p], g, [1], dtype, "cuda", act_mul=[p], activation=activation)
    # The pair runs the fused call's config: on a card without table entries a plain gate_up call takes the CUDA
    # GEMV's plain rule and the fused call its act·mul rule (another config), and the two sum in different orders.
    cfg = W.select_config(1, n, k, g, dtype, x.device, act_mul=True)
    if cfg.kernel in ("gemv_cuda", "gemv_tc"):
        # the CUDA GEMVs (this card's table entry, or the act·mul rule where it has none), whose epilogue rounds act
        # differently from the act·mul kernel (tests/test_w4a16_gemv_cuda.py bounds it against that pair): here
        # the fused call must be that config's epilogue, eager and replayed
        want = W.launch(x, p, g, cfg, act=activation)
    else:
        want = act_mul(W.launch(x, p, g, cfg), activation)
    got = W.w4a16_act_mul(x, p, g, activation)
    assert got is not None and torch.equal(got, want)
    xs = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = W.w4a16_act_mul(xs, p, g, activation)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    monkeypatch.setenv("VLMCTL_W4A16_ACT_MUL", "0")
    assert W.w4a16_act_mul(x, p, g, activation) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(LLAVA_7B))
def test_gpu_h2_7b_shapes_and_graph(name):
    """The inline-PTX half2 GEMV at LLaVA-1.5-7B shapes: every candidate within the bound, and the
    heuristic's launch replayed from a CUDA graph equals the eager result."""
    n, k = LLAVA_7B[name]
    g = 128
    p = _case(n, k, g, seed=n + 1, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, generator=gen, device="cuda").half()
    bias = torch.randn(n, generator=gen, device="cuda").half()
    for cfg in W.h2_candidate_configs(1, n, k, g):
        _check_f64(W.launch(x, p, g, cfg, bias=bias), x, p, g, bias, H2_TOL)
    cfg = W.heuristic_h2_config(1, n, k, g)
    eager = W.launch(x, p, g, cfg, bias=bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = W.launch(x, p, g, cfg, bias=bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _run_ptx(asm: str, operands: list[int]) -> float:
    """A tiny interpreter for the instructions `_h2_run_asm` emits (numpy fp16 arithmetic, one rounding
    per instruction; fma rounds once from float64, exact for fp16 operands at these magnitudes)."""
    import re

    import numpy as np

    regs = {f"${i + 1}": np.uint32(v & 0xFFFFFFFF) for i, v in enumerate(operands)}

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    def h2(v):
        return np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16)

    def pack(f):
        u = np.asarray(f, dtype=np.float16).view(np.uint16).astype(np.uint32)
        return np.uint32(u[0] | (u[1] << 16))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":  # mov.b32 {l, h}, a
            lo_hi, src = re.match(r"\{(\w+), (\w+)\}, (\w+)", rest).groups()[:2], rest.rsplit(", ", 1)[1]
            v = val(src)
            regs[lo_hi[0]], regs[lo_hi[1]] = np.uint16(v & 0xFFFF), np.uint16(v >> 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], args[1:]
        if op == "lop3.b32":
            a, b, c = (val(s) for s in src[:3])
            assert int(src[3], 0) == 0xEA
            regs[d] = (a & b) | c
        elif op == "shr.u32":
            regs[d] = val(src[0]) >> np.uint32(int(src[1]))
        elif op == "sub.rn.f16x2":
            regs[d] = pack(h2(val(src[0])) - h2(val(src[1])))
        elif op == "mul.rn.f16x2":
            regs[d] = pack(h2(val(src[0])) * h2(val(src[1])))
        elif op == "fma.rn.f16x2":
            f = h2(val(src[0])).astype(np.float64) * h2(val(src[1])) + h2(val(src[2]))
            regs[d] = pack(f)
        elif op == "cvt.f32.f16":
            regs[d] = np.array([regs[src[0]]], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        elif op == "add.f32":
            regs[d] = np.float32(regs[src[0]]) + np.float32(regs[src[1]])
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return float(regs["$0"])


@pytest.mark.parametrize("nw", [1, 2])
def test_h2_inline_ptx_program_computes_the_run(nw):
    """The PTX the GPU runs (which the CPU cannot), interpreted here: for random words, zero points,
    scales and activations it must give sum_k x[k] * w[k] over the run's 8 * nw weights, w as
    `dequantize` rounds it to fp16, within fp16 accumulation error."""
    pytest.importorskip("triton")
    from vlmctl.runtime.kernels._w4a16_triton import _h2_run_asm

    gen = torch.Generator().manual_seed(nw)
    asm = _h2_run_asm(nw)
    for trial in range(20):
        codes = torch.randint(0, 16, (1, 8 * nw), generator=gen)
        z = int(torch.randint(0, 16, (1,), generator=gen))
        s = (torch.rand(1, generator=gen) * 0.05 + 1e-3).half()
        x = (torch.randn(8 * nw, generator=gen) * (100 if trial % 5 == 0 else 1)).half()
        p = W.pack(codes, torch.tensor([[z]]), s.view(1, 1), 8 * nw)
        words = [int(v) for v in p["q4weight"][0]]
        xi = x.view(torch.int16).to(torch.int32) & 0xFFFF
        pairs = [int(xi[2 * i] | (xi[2 * i + 1] << 16)) for i in range(4 * nw)]  # word i, t -> index 4i + t
        zf2 = (0x6400 | z) * 0x10001
        s2 = (int(s.view(torch.int16)) & 0xFFFF) * 0x10001
        got = _run_ptx(asm, words + pairs + [zf2, s2])
        w = W.dequantize(p, 8 * nw, torch.float16).double()[0]
        ref = float((x.double() * w).sum())
        scale = float((x.double() * w).abs().sum())
        assert abs(got - ref) <= 8 * 2.0 ** -11 * scale + 1e-12, (trial, got, ref)


def test_h2_heuristic_reproduces_the_measured_block_and_splits():
    """The untuned half2 GEMV rule (fp16, batch 1, shapes the table lacks) gives exactly the config the
    H200 sweep chose for the 7B linears that took its 32-row block (the shipped table is measured data,
    not this rule's output), and fits other models' shapes."""
    data = json.loads(W.TUNED_TABLE.read_text())
    checked = 0
    for e in data["entries"]:
        c = W.Config(**e["config"])
        if e.get("variant") == "h2" and e["device"] == "NVIDIA H200" and c.block_n == 32:
            assert W.heuristic_h2_config(1, e["n"], e["k"], e["group_size"], 132) == c, e
            checked += 1
    assert checked == 3
    for n, k in ((4608, 3584), (37888, 3584), (3584, 18944), (15360, 5120), (5120, 13824), (960, 576)):
        for g in (64, 128):
            if k % g == 0:
                c = W.heuristic_h2_config(1, n, k, g, 132)
                assert c is not None and c.valid_for(n, k, g), (n, k, g)


# ------------------------------------------------------------------------------------------ warm-up


def test_prefill_buckets_cover_what_the_decode_buckets_leave():
    decode = [1, 2, 4, 8, 16, 32, 48, 64]  # TorchDecoder.buckets(64)
    assert W.PREFILL_DEQUANT_MIN_M == 1024  # the default threshold these cases assume
    # every larger step takes the one dequantize-and-cuBLAS path, so 1024 stands for 1024-2048
    assert W.prefill_buckets(2048, decode) == [128, 256, 512, 1024]
    assert W.prefill_buckets(100, decode) == [128]
    assert W.prefill_buckets(64, decode) == []
    assert W.prefill_buckets(512, [1, 2, 4, 8, 16]) == [32, 64, 128, 256, 512]
    # 48 rows select through bucket 64: 64 itself is covered
    assert W.prefill_buckets(64, [1, 48]) == [2, 4, 8, 16, 32]
    # each warmed count stands for its bucket's whole range
    for max_rows in (70, 300, 2048, 5000):
        warmed = {W.bucket(m) for m in decode + W.prefill_buckets(max_rows, decode)}
        assert all(W.bucket(m) in warmed for m in range(1, min(max_rows, W.PREFILL_DEQUANT_MIN_M) + 1))


def test_cuda_build_names_every_nvrtc_kernel(monkeypatch):
    """`precompile_selected` compiles what `launch` will load: a build for each NVRTC kernel kind, none for the
    Triton kinds and cuBLAS."""
    monkeypatch.delenv("VLMCTL_W4A16_WGMMA_FIXUP", raising=False)
    monkeypatch.setattr(W, "_COOPERATIVE_REFUSED", set())
    cpu = torch.device("cpu")
    monkeypatch.setattr(W, "_device_index", lambda device: 0)
    cases = {"gemv_cuda": W.heuristic_gemv_cuda_config(4096, 4096, 128),
             "gemv_tc": W.heuristic_gemv_tc_config(4096, 4096, 128),
             "mma_gemv": W.heuristic_mma_gemv_config(4096, 4096, 128),
             "wgmma": W.heuristic_wgmma_config(48)}
    for kind, c in cases.items():
        assert c.kernel == kind
        src, name, suffix = W.cuda_build(c, 128, torch.float16, cpu, 4096)
        assert name.startswith(f"w4a16_{kind.replace('_cuda', '')}<") and suffix == ("a" if kind == "wgmma" else "")
        assert name.endswith(", 4096>") == (kind == "gemv_tc")  # compiled for each K
        assert src == (W.wgmma_source(W.wgmma_build_defines()) if kind == "wgmma" else W.mma_source())
    mma = W.heuristic_mma_config(4096, 4096, 128, 132, "float16")
    assert mma.kernel == "mma" and W.cuda_build(mma, 128, torch.float16, cpu)[1].startswith("w4a16_mma<")
    # after a refused cooperative launch the serial fix-up's build is the one loaded
    assert "W4A16_WGMMA_PFIX" in W.cuda_build(cases["wgmma"], 128, torch.float16, cpu)[0][:200]
    W._COOPERATIVE_REFUSED.add(0)
    assert "W4A16_WGMMA_PFIX" not in W.cuda_build(cases["wgmma"], 128, torch.float16, cpu)[0][:200]
    for c in (W.heuristic_config(1, 4096, 4096, 128), W.heuristic_config(256, 4096, 4096, 128),
              W.heuristic_config(2048, 4096, 4096, 128), W.heuristic_h2_config(1, 4096, 4096, 128)):
        assert c.kernel in ("gemv", "dot", "dequant_mm", "gemv_h2") and W.cuda_build(c, 128, torch.float16, cpu) is None
    assert W.precompile_selected([(4096, 4096)], 128, [1, 256], torch.float16, cpu) == 0  # nothing to compile off the GPU


def test_precompile_selected_includes_the_fused_gate_up(monkeypatch):
    """The load's parallel NVRTC pass also compiles the CUDA GEMV with the act·mul epilogue that a fused gate_up
    will run at one row (the table's config or the act·mul rule), for the decoder's activation; not for other
    row counts. Without a GPU: the device's probes answer as an sm_90 card's and the compiles are recorded."""
    from vlmctl.runtime.kernels import cuda_rtc

    compiled = []
    monkeypatch.setattr(cuda_rtc, "available", lambda: True)
    monkeypatch.setattr(cuda_rtc, "precompile", lambda src, names, arch: compiled.append((arch, set(names))) or len(names))
    monkeypatch.setattr(W, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(W, "_gemv_cuda_ok", lambda device: True)
    dev = torch.device("cuda")
    n, k = LLAVA_7B["gate_up"]
    untabled = (n + 16, k)  # a gate_up no table names: the act·mul rule
    monkeypatch.setenv("VLMCTL_W4A16_TABLE", "off")
    W.precompile_selected([untabled, LLAVA_7B["down"]], 128, [1], torch.float16, dev, act_mul_shapes=[untabled],
                          activation="gelu_tanh")
    names = set().union(*(ns for _, ns in compiled))
    assert W.gemv_cuda_kernel_name(W.heuristic_gemv_cuda_act_mul_config(), 128, "gelu_tanh") in names
    assert W.gemv_cuda_kernel_name(W.heuristic_gemv_cuda_config(*untabled, 128), 128) in names  # its plain call
    assert all(arch == "sm_90" for arch, _ in compiled)
    compiled.clear()
    W.precompile_selected([untabled], 128, [2], torch.float16, dev, act_mul_shapes=[untabled])
    # no epilogue kernel (the GEMV's fifth template argument) for a batch that does not fuse
    assert not {name for _, ns in compiled for name in ns if name.startswith("w4a16_gemv<") and name.count(",") == 4}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_warmup_loads_every_selected_nvrtc_kernel():
    """After `warmup` over the decode and prefill buckets, no call at any row count up to the budget loads
    (or compiles) a kernel: the step that first meets a row count must not stall on NVRTC."""
    from vlmctl.runtime.kernels import cuda_rtc

    g = 128
    dev = torch.device("cuda")
    ps = [_case(n, k, g, seed=n, device="cuda") for n, k in LLAVA_7B.values()]
    decode = [1, 2, 4, 8, 16, 32, 48, 64]
    W.warmup(ps, g, decode + W.prefill_buckets(2048, decode), torch.float16, dev)
    loaded = len(cuda_rtc._KERNELS)
    for p in ps:
        for m in (1, 3, 17, 40, 64, 65, 205, 700, 1023, 1500):
            W.w4a16_linear(torch.randn(m, p["q4weight"].shape[1] * 8, device=dev).half(), p, g)
    torch.cuda.synchronize()
    assert len(cuda_rtc._KERNELS) == loaded
