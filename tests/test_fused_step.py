"""The fused batch-1 decode steps: the ring step (`vlmctl/runtime/kernels/fused_step.py`, `decode_step.cu`,
VLMCTL_FUSED_STEP=1) and the dataflow step (`flow_step.py`, `decode_flow.cu`, VLMCTL_FUSED_STEP=flow).

On any machine with NVRTC (`pip install nvidia-cuda-nvrtc`): the kernel compiles for sm_90. On a GPU of
compute capability 9.0 (marked `gpu`): a random AWQ decoder's decode steps fused and kernel by kernel, from
the same cache, give logits within fp16 noise of
each other and the same greedy argmax; the K/V rows the fused step appends match; a captured CUDA graph of
the fused step equals its eager run; and decoders it does not cover say why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmctl.runtime.kernels import cuda_rtc, flow_step as FL, fused_step as FS

GPU90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_kernel_compiles_for_sm90():
    names = [FS.kernel_name(g) for g in (32, 64, 128)]
    cubin, lowered = cuda_rtc.compile_cubin(FS.source(), names, "sm_90")
    assert len(cubin) > 10_000 and set(lowered) == set(names)


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_flow_kernel_compiles_for_sm90():
    # LLaVA-1.5-7B's shapes (group 128), Qwen2-VL-7B's (I = 18,944: one row a down task), the tests' small one
    names = [FL.kernel_name(8, 128, 4096, 4096, 11008), FL.kernel_name(8, 128, 3584, 3584, 18944),
             FL.kernel_name(8, 64, 512, 512, 1536), FL.kernel_name(12, 32, 512, 512, 1536, 3),
             FL.kernel_name(8, 128, 4096, 4096, 11008, 7),
             # the ring kernel (VLMCTL_FLOW_OPTS bit 32), at the same shapes
             FL.kernel_name(7, 128, 4096, 4096, 11008, 32), FL.kernel_name(8, 128, 3584, 3584, 18944, 48),
             FL.kernel_name(7, 64, 512, 512, 1536, 32)]
    cubin, lowered = cuda_rtc.compile_cubin(FL.source(), names, "sm_90")
    assert len(cubin) > 10_000 and set(lowered) == set(names)


def test_flow_slot_setting(monkeypatch):
    from vlmctl.errors import OptionError

    monkeypatch.delenv("VLMCTL_FLOW_SLOT_KB", raising=False)
    assert FL.ring_slot_bytes() == 32 * 1024
    monkeypatch.setenv("VLMCTL_FLOW_SLOT_KB", "16")
    assert FL.ring_slot_bytes() == 16 * 1024
    for bad in ("4", "big"):
        monkeypatch.setenv("VLMCTL_FLOW_SLOT_KB", bad)
        with pytest.raises(OptionError, match="VLMCTL_FLOW_SLOT_KB"):
            FL.ring_slot_bytes()


def test_ring_scales_words():
    # the ring kernel's per-group words: fp16 scale bits | zero point << 16, rows padded to 16 bytes; K / G = 86
    # (Qwen2-VL-7B-like down: K = 11,008, G = 128) pads to 88
    g = torch.Generator().manual_seed(0)
    n, kg = 5, 86
    sc = (torch.rand(n, kg, generator=g) * 0.1 - 0.05).to(torch.float16)
    zp = torch.randint(0, 16, (n, kg), generator=g, dtype=torch.uint8)
    assert FL.ring_row_words(11008, 128) == 88 and FL.ring_row_words(4096, 128) == 32
    out = FL.ring_scales({"q4scales": sc, "q4zeros": zp}, 128)
    assert out.shape == (n, 88) and out.dtype == torch.int32
    words = out.numpy().view(np.uint32)
    want = sc.numpy().view(np.uint16).astype(np.uint32) | (zp.numpy().astype(np.uint32) << 16)
    assert np.array_equal(words[:, :kg], want)
    assert not words[:, kg:].any()


def test_fused_step_modes(monkeypatch):
    for value, want in (("0", ""), ("", ""), ("1", "ring"), ("ring", "ring"), ("flow", "flow"), ("FLOW", "flow")):
        monkeypatch.setenv("VLMCTL_FUSED_STEP", value)
        assert FS.mode() == want
    monkeypatch.delenv("VLMCTL_FUSED_STEP")
    assert FS.mode() == "" and not FS.enabled()


def test_flow_warps_setting(monkeypatch):
    from vlmctl.errors import OptionError

    monkeypatch.delenv("VLMCTL_FLOW_WARPS", raising=False)
    assert FL.flow_warps() == 8
    monkeypatch.setenv("VLMCTL_FLOW_WARPS", "12")
    assert FL.flow_warps() == 12
    for bad in ("33", "0", "eight"):
        monkeypatch.setenv("VLMCTL_FLOW_WARPS", bad)
        with pytest.raises(OptionError, match="VLMCTL_FLOW_WARPS"):
            FL.flow_warps()


def test_tile_rows():
    assert FS.tile_rows(4096, 128) == 16  # 16 rows of 2,144 bytes fit a 48 KB slot
    assert FS.tile_rows(11008, 128) == 8  # 16 rows of 5,762 bytes do not
    assert FS.tile_rows(11008, 64) == 8


def _decoder(hidden=512, inter=1536, heads=4, kv=2, layers=3, group=64, seed=0, vocab=2000):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu as D

    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv, "vocab_size": vocab}
    cfg = D.llama7b_config(layers, shape)
    return D.make_decoder(cfg, D.random_hf_state(cfg, "cuda", seed), group)


def _prefill(dec, n, seed=0):
    from vlmctl.runtime.decoder import Chunk

    ids = np.random.default_rng(seed).integers(0, dec.vocab_size, n)
    table = list(range(1, 1 + -(-(n + 80) // dec.block_size)))
    return int(dec.forward([Chunk(ids, np.arange(n), 0, table)]).argmax(-1)[0]), table


def _step(dec, tok, n, table, fused):
    dec._fused = fused
    bs = dec.block_size
    slot = table[n // bs] * bs + n % bs
    logits = dec.decode(np.array([tok]), np.array([n]), np.array([slot]), [table], np.array([n + 1])).float()
    return logits, dec.k_cache[:, slot // bs, slot % bs].float(), dec.v_cache[:, slot // bs, slot % bs].float()


def _set_variant(monkeypatch, variant):
    """VLMCTL_FUSED_STEP for a variant: "1" the ring step, "flow" the dataflow step, "flow-ring" its ring kernel."""
    monkeypatch.setenv("VLMCTL_FUSED_STEP", variant.split("-")[0])
    monkeypatch.setenv("VLMCTL_FLOW_OPTS", str(FL.RING) if variant == "flow-ring" else "0")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["1", "flow", "flow-ring"])
@pytest.mark.parametrize("group,prompt", [(64, 37), (128, 64), (32, 95)])
def test_fused_step_follows_the_kernel_by_kernel_step(group, prompt, variant, monkeypatch):
    _set_variant(monkeypatch, variant)
    if not GPU90:
        pytest.skip("needs a CUDA GPU of compute capability 9.0+")
    dec = _decoder(group=group)
    dec.allocate_cache(64, 16)
    dec.use_graphs = False
    fused = FL.build_step(dec)
    assert fused is not None, dec.fused_step_reason
    assert type(fused).__name__ == ("FusedStep" if variant == "1" else "FlowStep")
    assert getattr(fused, "ring", False) == (variant == "flow-ring")
    tok, table = _prefill(dec, prompt)
    agree = 0
    for i in range(40):
        la, ka, va = _step(dec, tok, prompt + i, table, None)
        lb, kb, vb = _step(dec, tok, prompt + i, table, fused)
        # fp16 noise: the two paths sum the int4 products in different orders
        assert float((la - lb).abs().max()) <= 2e-2 * float(la.abs().max())
        assert float((ka - kb).abs().max()) <= 2e-2 * float(ka.abs().max())
        assert float((va - vb).abs().max()) <= 2e-2 * float(va.abs().max())
        agree += int(la.argmax() == lb.argmax())
        tok = int(la.argmax())
    assert agree >= 38


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["1", "flow", "flow-ring"])
def test_captured_fused_step_equals_eager(variant, monkeypatch):
    _set_variant(monkeypatch, variant)
    if not GPU90:
        pytest.skip("needs a CUDA GPU of compute capability 9.0+")
    dec = _decoder(group=128, kv=1)
    dec.allocate_cache(64, 16)
    dec.capture_graphs(1)
    assert dec._fused not in (None, False), dec.fused_step_reason
    tok, table = _prefill(dec, 50)
    lg, kg, vg = _step(dec, tok, 50, table, dec._fused)
    dec.use_graphs = False
    le, ke, ve = _step(dec, tok, 50, table, dec._fused)
    assert torch.equal(lg, le) and torch.equal(kg, ke) and torch.equal(vg, ve)


@pytest.mark.gpu
def test_unsupported_decoders_say_why(monkeypatch):
    monkeypatch.setenv("VLMCTL_FUSED_STEP", "1")
    if not GPU90:
        pytest.skip("needs a CUDA GPU of compute capability 9.0+")
    dec = _decoder(hidden=512, group=None)  # fp16 weights: not W4A16
    assert FS.unsupported_reason(dec) == "every layer's linears must be W4A16"
    dec = _decoder(hidden=384, heads=3, kv=3, group=64)  # K = 384 is not a multiple of 256
    assert "K % 256" in FS.unsupported_reason(dec)
    monkeypatch.setenv("VLMCTL_FUSED_STEP", "0")
    assert FS.unsupported_reason(_decoder(group=64)).startswith("off")


def test_linear_table_rows():
    # the StepLinear rows both fused steps read: four a layer, gate_up's N counting gate rows
    from types import SimpleNamespace

    def lin(n, k, g=128, bias=False):
        packed = {"q4weight": torch.zeros(n, k // 8, dtype=torch.int32),
                  "q4scales": torch.zeros(n, k // g, dtype=torch.float16),
                  "q4zeros": torch.zeros(n, k // g, dtype=torch.uint8)}
        return SimpleNamespace(packed=packed, bias=torch.zeros(n, dtype=torch.float16) if bias else None)

    layers = [SimpleNamespace(qkv=lin(768, 256, bias=True), o=lin(256, 256), gate_up=lin(1024, 256), down=lin(256, 512))
              for _ in range(2)]
    rows = FS.linear_table(SimpleNamespace(layers=layers), lambda k: 16 if k == 256 else 8, 16)
    assert len(rows) == 8
    qkv, o, gate_up, down = rows[4:]
    lay = layers[1]
    assert qkv == [lay.qkv.packed["q4weight"].data_ptr(), lay.qkv.packed["q4scales"].data_ptr(),
                   lay.qkv.packed["q4zeros"].data_ptr(), lay.qkv.bias.data_ptr(), 768, 256, 0, 16]
    assert o[3:] == [0, 256, 256, 0, 16]
    assert gate_up[4:] == [512, 256, 512, 16]
    assert down[4:] == [256, 512, 0, 8]
