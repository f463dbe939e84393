"""vlmctl's native AWQ on tiny random Llama models: checkpoint format, faithfulness to AutoAWQ's
search, runtime parity with transformers on the dequantized weights, and input errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tiny_models import CORPUS, make_tokenizer

GROUP = 32


def make_tiny_llama(out: Path, *, kv_heads: int = 2, hidden: int = 128, inter: int = 256, layers: int = 2,
                    seed: int = 0, outliers: bool = True) -> Path:
    """A random Llama with a few outlier activation channels (as real LLMs have: what AWQ protects)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer([])
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=kv_heads, vocab_size=len(tok), max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            if outliers and name.endswith("layernorm.weight"):
                p[torch.randperm(hidden)[:4]] *= 12.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def calib_file(tmp_path: Path) -> Path:
    import random

    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 20))) for _ in range(300)]
    p = tmp_path / "calib.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def settings(data=None, group=GROUP, samples=4, seq_len=64, **kw):
    from vlmctl.recipe import QuantizationSettings

    return QuantizationSettings(method="awq", group_size=group, calibration={"data": str(data) if data else None,
                                                                            "samples": samples, "seq_len": seq_len},
                                **kw)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from vlmctl.quant.awq import quantize_causal_lm

    d = tmp_path_factory.mktemp("awq")
    src = make_tiny_llama(d / "src")
    t0 = time.perf_counter()
    summary = quantize_causal_lm(src, d / "out", settings(calib_file(d)), base_dir=d)
    summary["_measured_s"] = time.perf_counter() - t0  # the call's own duration, for the summary's wall_s
    return src, d / "out", summary


def dequantized_state(qdir: Path, dequant=None) -> dict:
    from vlmctl.checkpoint import load_state_dict
    from vlmctl.formats.awq_gemm import dequantize_gemm

    dequant = dequant or dequantize_gemm
    cfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    t = load_state_dict(qdir)
    state = {}
    for name, v in t.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[base + ".weight"] = dequant(v, t[base + ".qzeros"], t[base + ".scales"], 4, cfg["group_size"])
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = v.float()
    return state


def float_model(src: Path, state: dict | None = None):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def heldout_ids(src: Path, n=2, t=48):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(" ".join(reversed(CORPUS)) * 4, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: n * t]).view(n, t)


# ---- format --------------------------------------------------------------------------------------
def test_checkpoint_is_autoawq_gemm(quantized):
    from vlmctl.checkpoint import load_state_dict

    src, out, summary = quantized
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == \
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    t = load_state_dict(out)
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
    shapes = {k: v.shape for k, v in load_state_dict(src).items()}
    for i in range(2):
        for lin in linears:
            p = f"model.layers.{i}.{lin}"
            out_f, in_f = shapes[p + ".weight"]
            assert p + ".weight" not in t
            assert t[p + ".qweight"].dtype == torch.int32 and tuple(t[p + ".qweight"].shape) == (in_f, out_f // 8)
            assert t[p + ".qzeros"].dtype == torch.int32 and tuple(t[p + ".qzeros"].shape) == (in_f // GROUP, out_f // 8)
            assert t[p + ".scales"].dtype == torch.float16 and tuple(t[p + ".scales"].shape) == (in_f // GROUP, out_f)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert t[f"model.layers.{i}.{norm}.weight"].dtype == torch.float32
    assert torch.equal(t["model.embed_tokens.weight"], load_state_dict(src)["model.embed_tokens.weight"])
    assert summary["layers"] == 2 and summary["quantized_linears"] == 14
    # the summary's timing is the quantizer's: within the measured duration of the call (rounded to 10 ms)
    assert 0 < summary["wall_s"] <= round(summary["_measured_s"], 2) + 0.01
    # peak memory is this process's high-water mark: at least the float weights it read
    assert summary["peak_rss_mib"] * (1 << 20) >= sum(p.stat().st_size for p in src.glob("*.safetensors"))


def test_runtime_equals_transformers_on_dequantized_weights(quantized):
    """vlmctl's runtime on the AWQ checkpoint == transformers with the dequantized weights."""
    from vlmctl.runtime.decoder import TorchDecoder

    src, out, _ = quantized
    state = dequantized_state(out)
    ids = heldout_ids(src)
    with torch.no_grad():
        ref = float_model(src, state)(ids).logits
    got = TorchDecoder.from_hf_dir(out).logits(ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_autoawq_dequantizes_to_the_same_weights(quantized):
    """AutoAWQ's own dequantization of vlmctl's checkpoint yields exactly the weights vlmctl's does."""
    _autoawq()
    from awq.utils.packing_utils import dequantize_gemm as awq_dequantize

    _, out, _ = quantized
    state = dequantized_state(out)
    theirs = dequantized_state(out, lambda *a: awq_dequantize(*a).t())
    for k, v in state.items():
        assert torch.equal(v.half(), theirs[k].half()), k


def test_awq_beats_round_to_nearest(quantized):
    """On a model with outlier activation channels, AWQ's logits are closer to the float model's
    than plain round-to-nearest at the same group size."""
    from vlmctl.quant.awq_math import pseudo_quantize

    src, out, _ = quantized
    ids = heldout_ids(src, n=4)
    fmodel = float_model(src)
    rtn = {k: (pseudo_quantize(v, GROUP) if k.endswith("_proj.weight") else v) for k, v in fmodel.state_dict().items()}
    with torch.no_grad():
        ref = fmodel(ids).logits
        err_rtn = (float_model(src, rtn)(ids).logits - ref).pow(2).mean()
        err_awq = (float_model(src, dequantized_state(out))(ids).logits - ref).pow(2).mean()
    assert err_awq < 0.8 * err_rtn, (float(err_awq), float(err_rtn))


# ---- the algorithm ---------------------------------------------------------------------------
def _layer(kv_heads=2, seed=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=kv_heads,
                      num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    x = torch.randn(4, 32, 128) * (1 + 10 * (torch.rand(128) < 0.05))
    pos = torch.arange(32)[None]
    kw = {"position_embeddings": LlamaRotaryEmbedding(cfg)(x, pos), "attention_mask": None, "position_ids": pos}
    return layer, x, kw


def test_scale_folding_is_exact():
    from vlmctl.models.decoders import decoder_family
    from vlmctl.quant.awq_layer import LayerQuantizer

    fam = decoder_family("llama")
    layer, x, kw = _layer(kv_heads=4)
    with torch.no_grad():
        before = layer(x, **kw)
        for g in fam.awq_groups:
            LayerQuantizer.apply_scale(layer, g, torch.rand(layer.get_submodule(g.linears[0]).in_features) + 0.5)
        after = layer(x, **kw)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads,expect_o", [(2, False), (4, True)], ids=["gqa", "mha"])
def test_groups_come_from_the_family(monkeypatch, kv_heads, expect_o):
    """o_proj is scaled against v_proj only when their shapes agree (not under grouped-query attention)."""
    from vlmctl.models.decoders import decoder_family
    from vlmctl.quant.awq_layer import LayerQuantizer

    searched = []
    orig = LayerQuantizer.search_scale
    monkeypatch.setattr(LayerQuantizer, "search_scale",
                        lambda self, layer, g, x: searched.append(g.linears) or orig(self, layer, g, x))
    layer, x, kw = _layer(kv_heads=kv_heads)
    with torch.inference_mode():
        _, packed = LayerQuantizer(decoder_family("llama"), GROUP, False, kw, 2).quantize(layer, x)
    assert (("self_attn.o_proj",) in searched) == expect_o
    assert ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") in searched
    assert len(packed) == 7


def test_bf16_delta_search_ranks_like_float32():
    """The block search with bf16 deltas (fast path) computes the float32 losses closely."""
    from vlmctl.models.decoders import decoder_family
    from vlmctl.quant.awq_layer import LayerQuantizer
    from vlmctl.quant.awq_math import grid_scales

    layer, x, kw = _layer()
    fam = decoder_family("llama")
    for g in (fam.awq_groups[0], fam.awq_groups[2]):
        lins = [layer.get_submodule(n) for n in g.linears]
        ws = [m.weight.data for m in lins]
        with torch.no_grad():
            xin = layer.input_layernorm(x) if g.module == "self_attn" else layer.post_attention_layernorm(x)
            scales = grid_scales(xin.abs().reshape(-1, 128).mean(0))
            exact = LayerQuantizer(fam, GROUP, False, kw, 2, None)._block_grid_losses(
                layer.get_submodule(g.module), lins, ws, xin, scales)
            fast = LayerQuantizer(fam, GROUP, False, kw, 2, torch.bfloat16)._block_grid_losses(
                layer.get_submodule(g.module), lins, ws, xin, scales)
        torch.testing.assert_close(fast, exact, rtol=2e-2, atol=0)
        assert all(torch.equal(m.weight.data, w) for m, w in zip(lins, ws))  # weights restored


def _autoawq():
    """The `awq` module; the test skips, saying why, where AutoAWQ is not installed (`make test` installs it)."""
    from vlmctl.errors import BackendUnavailableError
    from vlmctl.quant.autoawq_impl import import_autoawq

    try:
        return import_autoawq()
    except BackendUnavailableError as e:
        pytest.skip(f"autoawq is not installed here ({e})")


def _autoawq_quantizer(group_size, duo=False):
    from vlmctl.quant.autoawq_impl import fixed_quantizer_cls

    _autoawq()
    q = object.__new__(fixed_quantizer_cls())  # only the search methods are used; no model needed
    q.group_size, q.w_bit, q.zero_point, q.duo_scaling = group_size, 4, True, duo
    q.max_chunk_memory, q.n_parallel_calib_samples = 1 << 30, None
    return q


@pytest.mark.parametrize("duo", [False, True], ids=["x-only", "duo"])
def test_scale_search_matches_autoawq(duo):
    """Same best scales as AutoAWQ's _search_best_scale (with its CPU weight-backup bug fixed), for a
    block group and a single-linear group."""
    from vlmctl.models.decoders import decoder_family
    from vlmctl.quant.awq_layer import LayerQuantizer

    aq = _autoawq_quantizer(GROUP, duo)
    fam = decoder_family("llama")
    layer, x, kw = _layer()
    with torch.no_grad():
        n2 = layer.post_attention_layernorm(x)
        h = layer.mlp.act_fn(layer.mlp.gate_proj(n2)) * layer.mlp.up_proj(n2)
    ours = LayerQuantizer(fam, GROUP, duo, kw, 4, None)
    mlp_group, down_group = fam.awq_groups[2], fam.awq_groups[3]
    with torch.no_grad():
        s_mlp = ours.search_scale(layer, mlp_group, n2)
        s_down = ours.search_scale(layer, down_group, h)
        _, _, t_mlp = aq._search_best_scale(layer, layer.post_attention_layernorm,
                                            [layer.mlp.gate_proj, layer.mlp.up_proj], n2, module2inspect=layer.mlp)
        _, _, t_down = aq._search_best_scale(layer, layer.mlp.up_proj, [layer.mlp.down_proj], h)
    torch.testing.assert_close(s_mlp, t_mlp.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_down, t_down.float(), rtol=1e-5, atol=1e-6)


def test_autoawq_cpu_backup_fix():
    """AutoAWQ's own duo search on the CPU leaves the weights scaled by its first candidate (its
    backup aliases the live tensors); the subclass vlmctl hands it leaves them untouched."""
    from vlmctl.quant.autoawq_impl import fixed_quantizer_cls

    aq = _autoawq_quantizer(GROUP, duo=True)
    base = type(aq).__mro__[1]
    for cls, intact in ((base, False), (fixed_quantizer_cls(), True)):
        q = object.__new__(cls)
        q.__dict__.update(aq.__dict__)
        layer, x, _ = _layer()
        w0 = layer.mlp.gate_proj.weight.detach().clone()
        with torch.no_grad():
            n2 = layer.post_attention_layernorm(x)
            q._search_best_scale(layer, layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj], n2,
                                 module2inspect=layer.mlp)
        assert torch.equal(layer.mlp.gate_proj.weight, w0) == intact, cls.__name__


def test_clip_search_matches_autoawq():
    from vlmctl.quant.awq_math import clip_thresholds

    aq = _autoawq_quantizer(GROUP)
    torch.manual_seed(1)
    w = torch.randn(128, 256) * (1 + 5 * (torch.rand(128, 256) < 0.01))
    x = torch.randn(3, 700, 256)
    with torch.no_grad():
        ours = clip_thresholds(w, x, GROUP)
        theirs = aq._compute_best_clip(w, x)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


# ---- errors ---------------------------------------------------------------------------------------
def test_group_size_must_divide_every_layer(tmp_path):
    from vlmctl.errors import InputError
    from vlmctl.quant.awq import quantize_causal_lm

    src = make_tiny_llama(tmp_path / "src", hidden=96, inter=192)
    with pytest.raises(InputError) as e:
        quantize_causal_lm(src, tmp_path / "out", settings(calib_file(tmp_path), group=64), base_dir=tmp_path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj" in msg and "96" in msg and "8, 16, 24, 32, 48, 96" in msg


def test_rejects_an_already_quantized_checkpoint(quantized, tmp_path):
    from vlmctl.errors import CheckpointError
    from vlmctl.quant.awq import quantize_causal_lm

    _, out, _ = quantized
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_causal_lm(out, tmp_path / "again", settings())


def test_cpu_delta_dtype_is_measured_once_and_exact_overrides(monkeypatch):
    from vlmctl.quant import awq_layer

    monkeypatch.setattr(awq_layer, "_CPU_BF16", {})
    calls = []
    monkeypatch.setattr(awq_layer, "_cpu_bf16_is_fast", lambda: calls.append(1) or True)
    assert awq_layer.fast_delta_dtype("cpu") == torch.bfloat16
    assert awq_layer.fast_delta_dtype("cpu") == torch.bfloat16 and len(calls) == 1  # once a process
    monkeypatch.setenv("VLMCTL_AWQ_EXACT", "1")
    assert awq_layer.fast_delta_dtype("cpu") is None
