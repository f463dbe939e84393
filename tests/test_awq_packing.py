"""AWQ GEMM packing: exact round trips, AutoAWQ's nibble order, and AutoAWQ's own dequantization."""

from __future__ import annotations

import pytest
import torch

from vlmctl.formats.awq_gemm import ORDER, dequantize_gemm, pack_gemm, unpack_gemm


def _random(out_f=64, in_f=128, g=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
    zeros = torch.randint(0, 16, (out_f, in_f // g), generator=gen)
    scales = (torch.rand(in_f // g, out_f, generator=gen) * 0.05 + 1e-3).half()
    return codes, zeros, scales


def _autoawq():
    from vlmctl.quant.autoawq_impl import import_autoawq

    try:
        return import_autoawq()
    except Exception as e:  # BackendUnavailableError, or an incompatible install
        pytest.skip(f"autoawq is not importable here ({e})")


@pytest.mark.parametrize("out_f,in_f,g", [(8, 8, 8), (64, 128, 32), (24, 192, 64), (576, 576, 64)])
def test_pack_unpack_round_trip(out_f, in_f, g):
    codes, zeros, _ = _random(out_f, in_f, g, seed=out_f + in_f)
    qweight, qzeros = pack_gemm(codes, zeros)
    assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (in_f, out_f // 8)
    assert qzeros.dtype == torch.int32 and tuple(qzeros.shape) == (in_f // g, out_f // 8)
    c2, z2 = unpack_gemm(qweight, qzeros)
    assert torch.equal(c2, codes) and torch.equal(z2, zeros)


def test_nibble_order_and_sign_bit():
    """Word j of row i holds output 8j+ORDER[k] in bits 4k..4k+3; a 15 in the top nibble makes it negative."""
    codes = torch.zeros(8, 8, dtype=torch.long)
    zeros = torch.zeros(8, 1, dtype=torch.long)
    for o in range(8):
        codes[o, 0] = o + 1  # input 0: output o has code o+1
    codes[ORDER[7], 1] = 15
    qweight, _ = pack_gemm(codes, zeros)
    word = int(qweight[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * k)) & 0xF for k in range(8)] == [ORDER[k] + 1 for k in range(8)]
    assert int(qweight[1, 0]) < 0


def test_packed_linears_concatenate_along_outputs():
    """The runtime fuses q/k/v by concatenating packed tensors: dequantizing the concatenation
    must equal concatenating the dequantized weights."""
    parts = [_random(o, 128, 32, seed=o) for o in (64, 16, 16)]
    packed = [pack_gemm(c, z) + (s,) for c, z, s in parts]
    cat = [torch.cat([p[i] for p in packed], 1) for i in range(3)]
    whole = dequantize_gemm(*cat, 4, 32)
    assert torch.equal(whole, torch.cat([dequantize_gemm(*p, 4, 32) for p in packed], 0))


def test_dequantize_formula():
    codes, zeros, scales = _random(16, 64, 16)
    qweight, qzeros = pack_gemm(codes, zeros)
    w = dequantize_gemm(qweight, qzeros, scales, 4, 16)
    ref = (codes - zeros.repeat_interleave(16, 1)).float() * scales.float().t().repeat_interleave(16, 1)
    assert w.dtype == torch.float32 and tuple(w.shape) == (16, 64)
    assert torch.equal(w, ref)


def test_rejects_bad_input():
    codes, zeros, scales = _random(16, 64, 16)
    with pytest.raises(ValueError):
        pack_gemm(codes + 16, zeros)
    with pytest.raises(ValueError):
        pack_gemm(codes[:12], zeros[:12])  # 12 outputs: not a multiple of 8
    with pytest.raises(ValueError):
        pack_gemm(codes, zeros, bits=8)
    qweight, qzeros = pack_gemm(codes, zeros)
    with pytest.raises(ValueError):
        dequantize_gemm(qweight, qzeros, scales, 4, 32)  # wrong group size


def test_matches_autoawq_dequantize_gemm():
    """AutoAWQ's own dequantization of vlmctl's packing gives vlmctl's weights: bit for bit in fp16
    (AutoAWQ computes in the scales' dtype) and exactly with float32 scales."""
    _autoawq()
    from awq.utils.packing_utils import dequantize_gemm as awq_dequantize

    for out_f, in_f, g in ((64, 128, 32), (576, 576, 64), (40, 256, 128)):
        codes, zeros, scales = _random(out_f, in_f, g, seed=in_f)
        qweight, qzeros = pack_gemm(codes, zeros)
        ours = dequantize_gemm(qweight, qzeros, scales, 4, g)
        theirs = awq_dequantize(qweight, qzeros, scales, 4, g)  # [in, out]
        assert torch.equal(ours.half(), theirs.t())
        assert torch.equal(ours, awq_dequantize(qweight, qzeros, scales.float(), 4, g).t())


def test_matches_autoawq_packing():
    """AutoAWQ's WQLinear_GEMM.from_linear packs the same integer codes into the same words."""
    _autoawq()
    from awq.modules.linear.gemm import WQLinear_GEMM

    g = 32
    codes, zeros, scales = _random(64, 128, g, seed=3)
    lin = torch.nn.Linear(128, 64, bias=False)
    s = scales.float().t()  # [out, in/g]
    lin.weight.data = (codes - zeros.repeat_interleave(g, 1)).float() * s.repeat_interleave(g, 1)
    q = WQLinear_GEMM.from_linear(lin, 4, g, scales=s.t().contiguous(), zeros=zeros.t().contiguous().float())
    qweight, qzeros = pack_gemm(codes, zeros)
    assert torch.equal(q.qweight, qweight) and torch.equal(q.qzeros, qzeros)
    assert torch.equal(q.scales, scales)
