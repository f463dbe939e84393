"""Config variants real checkpoints have and the family tests do not build, against transformers.

Each case builds a tiny random LLaVA (CLIP tower, projector, and a Llama / Mistral / Qwen2 decoder whose
config carries the variant) or InternVL checkpoint, builds an fp32 (or bf16) engine the way the family tests
do, and compares greedy tokens with transformers' `generate` on the same checkpoint. A variant vlmctl does
not run must be refused at build time with one `error:` line and exit code 4 (UnsupportedModelError).

Defects found (and what guards them here):
- a Mistral decoder's `sliding_window` and a Qwen2 decoder's sliding layers (`use_sliding_window`,
  `max_window_layers`) were ignored: full causal attention, other tokens than transformers once a sequence
  passed the window (fixed in models/decoders.py: `sliding_window_layers`);
- `attention_bias` / `mlp_bias` decoders were refused late as a broken checkpoint (exit 3, "tensors the runtime
  does not use") although the checkpoint matches its config (fixed: exit 4, unsupported variant);
- `dynamic` and `longrope` rotary scaling: transformers switches frequencies once a sequence passes
  (original_)max_position_embeddings; vlmctl kept the short-sequence table and answered differently (fixed:
  refused at build-llm, exit 4, where the engine's limits reach past the switch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import cli, one_error_line, write_recipe
from parity import assert_greedy_parity
from tiny_models import LLAVA_CHAT_TEMPLATE, make_image, make_internvl, make_tokenizer

PROMPT = "what is in this image?"
MAX_NEW = 12
EOS = 2  # make_tokenizer's </s>


def make_llava_variant(out: Path, *, text_cls: str = "LlamaConfig", text_kw: dict | None = None,
                       top_kw: dict | None = None, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                       inter: int | None = None, seed: int = 0, init_range: float = 0.2, drop_lm_head: bool = False,
                       projector_scale: float | None = None) -> Path:
    """make_llava's checkpoint with the text config built by `text_cls` (a transformers config class) and
    `text_kw` over the defaults, `top_kw` on the LlavaConfig; `drop_lm_head` removes lm_head from the saved
    file (as checkpoints with tied embeddings ship), `projector_scale` multiplies the projector's weights."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out)
    tok = make_tokenizer(["<image>"])
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          image_size=28, patch_size=7, projection_dim=32)
    kw = dict(hidden_size=hidden, intermediate_size=inter or 2 * hidden, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=len(tok),
              max_position_embeddings=1024, initializer_range=init_range, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kw.update(text_kw or {})
    cfg = LlavaConfig(vision_config=vc, text_config=getattr(transformers, text_cls)(**kw),
                      image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                      vision_feature_select_strategy="default", initializer_range=init_range, **(top_kw or {}))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # large decoder weights (and biases) so greedy tokens are far from ties
        for name, p in model.named_parameters():
            if "language_model" in name and (p.dim() == 2 or name.endswith("bias")):
                p.normal_(0, init_range)
            if projector_scale and "multi_modal_projector" in name:
                p.mul_(projector_scale)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    if drop_lm_head:
        for f in out.glob("*.safetensors"):
            state = {k: v for k, v in load_file(str(f)).items() if not k.endswith("lm_head.weight")}
            save_file(state, str(f), metadata={"format": "pt"})
    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
                   chat_template=LLAVA_CHAT_TEMPLATE, image_token="<image>",
                   num_additional_image_tokens=1).save_pretrained(out)
    return out


def edit_config(ckpt: Path, fn) -> None:
    p = Path(ckpt) / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg, indent=2))


def hf_llava_greedy(ckpt: Path, image, dtype=torch.float32, state: dict | None = None) -> list[int]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
    if state is not None:
        _, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    inputs = proc(images=[image], text=proc.apply_chat_template(msgs, add_generation_prompt=True), return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def build_engine(tmp_path: Path, ckpt: Path, **recipe) -> Path:
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    r = load_recipe(write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 2}, **recipe))
    build(r, tmp_path / "eng")
    return tmp_path / "eng"


def engine_greedy(eng_dir: Path, image) -> list[int]:
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(eng_dir)
    prompt = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}], [image])
    return eng.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].token_ids


def build_and_compare(tmp_path: Path, ckpt: Path, **recipe) -> None:
    image = make_image(10, (40, 30))
    got = engine_greedy(build_engine(tmp_path, ckpt, **recipe), image)
    assert_greedy_parity(got, hf_llava_greedy(ckpt, image), EOS)


def build_is_refused_or_matches(tmp_path: Path, ckpt: Path, capsys) -> None:
    """`vlmctl build` either refuses the checkpoint (one error line, exit 4) or builds an engine whose greedy
    tokens equal transformers'."""
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 2})
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys, expect=None)
    if code != 0:
        one_error_line(code, err, 4)
        return
    image = make_image(10, (40, 30))
    assert_greedy_parity(engine_greedy(tmp_path / "eng", image), hf_llava_greedy(ckpt, image), EOS)


# ---- defects -----------------------------------------------------------------------------------
# The prompt (~30 tokens: 16 image rows and the text) passes a window of 8 within the prefill.
SLIDING = {
    # transformers' MistralModel masks every layer to the window when sliding_window is set (its config
    # class defaults it to 4096: llava-v1.6-mistral's recipe reaches 7168 tokens)
    "mistral-window-8": dict(text_cls="MistralConfig", text_kw={"sliding_window": 8}),
    # Qwen2Config: layers from max_window_layers on are sliding ones (layer_types)
    "qwen2-window-8-from-layer-1": dict(text_cls="Qwen2Config", text_kw={"use_sliding_window": True,
                                                                         "sliding_window": 8,
                                                                         "max_window_layers": 1}),
}


@pytest.mark.parametrize("kw", list(SLIDING.values()), ids=list(SLIDING))
def test_sliding_window_decoders_match_transformers(tmp_path, kw):
    """Was: the window ignored (every layer full attention), tokens diverged from the first one."""
    ckpt = make_llava_variant(tmp_path / "ckpt", **kw)
    build_and_compare(tmp_path, ckpt)


def test_sliding_window_spec_follows_the_config():
    """The spec's per-layer kinds are transformers' (Qwen2's max_window_layers; none without a window)."""
    from transformers import MistralConfig, Qwen2Config

    from vlmctl.models.decoders import decoder_spec

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100)
    q = decoder_spec(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=2, **base).to_dict())
    assert q.layer_types == ("full", "full", "sliding") and q.sliding_window == 16
    assert not decoder_spec(Qwen2Config(**base).to_dict()).layer_types  # use_sliding_window false
    m = decoder_spec(MistralConfig(sliding_window=32, **base).to_dict())
    assert m.layer_types == ("sliding",) * 3 and m.sliding_window == 32
    assert not decoder_spec(MistralConfig(sliding_window=None, **base).to_dict()).layer_types


@pytest.mark.parametrize("text_kw", [{"attention_bias": True}, {"mlp_bias": True}], ids=["attention_bias", "mlp_bias"])
def test_decoder_biases_are_refused_as_unsupported(tmp_path, capsys, text_kw):
    """Llama's attention_bias (o_proj too) and mlp_bias: the runtime has no such biases. Was: exit 3 after the
    vision stages, "decoder has N tensor(s) the runtime does not use" (the checkpoint is not broken)."""
    ckpt = make_llava_variant(tmp_path / "ckpt", text_kw=text_kw)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt)
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys, expect=None)
    line = one_error_line(code, err, 4)
    assert next(iter(text_kw)) in line
    assert not (tmp_path / "eng").exists()  # refused at convert, before any stage was written


ROPE_SWITCHING = {
    # DynamicNTK: transformers recomputes inv_freq once a sequence passes max_position_embeddings (24 here)
    "dynamic": {"max_position_embeddings": 24,
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    # LongRoPE: the long factors once a sequence passes original_max_position_embeddings (16 here)
    "longrope": {"max_position_embeddings": 64,
                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                     "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                     "original_max_position_embeddings": 16}},
}


@pytest.mark.parametrize("text_kw", list(ROPE_SWITCHING.values()), ids=list(ROPE_SWITCHING))
def test_length_dependent_rope_is_refused_past_its_switch_and_built_within_it(tmp_path, capsys, text_kw):
    """Was: built with the short-sequence table and no check (models/decoders.py rotary_tables keeps the rotary
    class's init-time inv_freq); past (original_)max_position_embeddings transformers switches tables and the
    tokens differed. Now refused at build-llm (exit 4) where the engine's limits reach past the switch, and
    built where they do not."""
    ckpt = make_llava_variant(tmp_path / "ckpt", text_kw=text_kw)
    switch = text_kw["rope_parameters"].get("original_max_position_embeddings", text_kw["max_position_embeddings"])
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 2})  # 2048 + 512 positions
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys, expect=None)
    line = one_error_line(code, err, 4)
    assert f"past {switch} positions" in line and "limits.max_input_len" in line
    # text only: an image of this checkpoint takes 16 prompt rows, more than the switch leaves
    within = write_recipe(tmp_path / "w.yaml", ckpt, limits={"max_batch_size": 2, "max_input_len": switch - 4,
                                                             "max_output_len": 4, "max_images_per_request": 0})
    cli("build", within, "-o", tmp_path / "eng2", capsys=capsys)


# ---- variants that work (kept as parity tests) ---------------------------------------------------
def test_llama3_rope_head_dim_gqa_odd_vocab_matches_transformers(tmp_path):
    """Llama 3 rotary scaling with rope_theta 5e5, head_dim 32 != hidden/heads (16), 6 heads over 3 KV heads,
    a vocabulary (257) larger than the tokenizer's, an lm_head absent with tie_word_embeddings only at the
    top level of the VLM config."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    ckpt = make_llava_variant(tmp_path / "ckpt", hidden=96, heads=6, kv_heads=3, seed=4, drop_lm_head=True,
                              text_kw={"rope_parameters": rope, "head_dim": 32, "vocab_size": 257},
                              top_kw={"tie_word_embeddings": True})
    edit_config(ckpt, lambda c: c["text_config"].update(tie_word_embeddings=False))
    build_and_compare(tmp_path, ckpt)


def test_internvl_tie_at_top_level_only_matches_transformers(tmp_path):
    """InternVL (Qwen2 decoder, q/k/v biases): tie_word_embeddings true at the top, false in text_config,
    lm_head absent from the file: transformers ties by the top-level flag, so must the engine."""
    from safetensors.torch import load_file, save_file
    from test_internvl import hf_greedy, load_hf, user

    ckpt = make_internvl(tmp_path / "ckpt", seed=5)
    for f in ckpt.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(str(f)).items() if "lm_head" not in k}, str(f), metadata={"format": "pt"})
    edit_config(ckpt, lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=False)))
    image = make_image(30, (70, 30))
    model = load_hf(ckpt)
    ref = hf_greedy(model, ckpt, [user(1, PROMPT)], [image], MAX_NEW)
    got = engine_greedy(build_engine(tmp_path, ckpt), image)
    assert_greedy_parity(got, ref, model.generation_config.eos_token_id)


def test_awq_group_32_intermediate_not_multiple_of_128_qwen2(tmp_path):
    """AWQ with group size 32 on a Qwen2 decoder (q/k/v biases) whose intermediate size (96) is no multiple
    of 64 or 128, and large image features (projector weights x60): the engine's tokens equal transformers'
    with the AWQ checkpoint's dequantized weights."""
    from vlmctl.checkpoint import load_state_dict
    from vlmctl.formats.awq_gemm import dequantize_gemm
    from vlmctl.models.base import DECODER
    from vlmctl.models.registry import get_family

    ckpt = make_llava_variant(tmp_path / "ckpt", text_cls="Qwen2Config", inter=96, seed=6, projector_scale=60.0)
    eng = build_engine(tmp_path, ckpt, quantization={"method": "awq", "group_size": 32,
                                                     "calibration": {"samples": 4, "seq_len": 64}})
    image = make_image(10, (40, 30))
    got = engine_greedy(eng, image)
    qdir = eng / "quantize" / "llm"
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["group_size"] == 32
    fam, tensors, state = get_family("llava"), load_state_dict(qdir), {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[fam.join_key(DECODER, base + ".weight")] = dequantize_gemm(
                t, tensors[base + ".qzeros"], tensors[base + ".scales"], 4, 32)
        elif not name.endswith((".qzeros", ".scales")):
            state[fam.join_key(DECODER, name)] = t.float()
    assert sum(n.endswith(".qweight") for n in tensors) == 7 * 2
    assert_greedy_parity(got, hf_llava_greedy(ckpt, image, state=state), EOS)


def test_bfloat16_engine_matches_transformers_bfloat16(tmp_path):
    """dtype bfloat16 end to end on the CPU (vision and decoder) against transformers in bfloat16."""
    ckpt = make_llava_variant(tmp_path / "ckpt", seed=1)  # seed 7 has a 0.027-nat near-tie at token 3
    image = make_image(10, (40, 30))
    got = engine_greedy(build_engine(tmp_path, ckpt, dtype="bfloat16"), image)
    assert_greedy_parity(got, hf_llava_greedy(ckpt, image, dtype=torch.bfloat16), EOS)


def test_a_window_no_sequence_can_outgrow_leaves_the_layers_unmasked():
    """A sliding window at least the engine's longest sequence masks nothing, so the decoder runs those layers
    as full attention (the unmasked kernels, the fused step where it applies); a shorter one is kept. Logits
    are the same either way over a sequence inside the window."""
    from transformers import MistralConfig, MistralForCausalLM

    from vlmctl.runtime.decoder import TorchDecoder

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(sliding_window=64, **base)).eval()
    tensors = {k: v for k, v in hf.state_dict().items()}
    text_cfg = hf.config.to_dict()
    wide = TorchDecoder.from_hf_tensors(text_cfg, tensors, max_seq=64)
    narrow = TorchDecoder.from_hf_tensors(text_cfg, tensors, max_seq=65)
    assert [layer.window for layer in wide.layers] == [None, None]
    assert [layer.window for layer in narrow.layers] == [64, 64]
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    for dec in (wide, narrow):
        got = dec.logits(ids).float().reshape(ref.shape)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), float((got - ref).abs().max())


@pytest.mark.parametrize("cls, kw", [("MistralConfig", {"sliding_window": 5}),
                                     ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5,
                                                      "max_window_layers": 1})], ids=["mistral", "qwen2"])
def test_awq_calibration_pass_applies_the_sliding_window(cls, kw):
    """What AWQ's calibration feeds each layer reproduces transformers' own forward layer by layer at a
    sequence longer than the window. Was: causal attention in every layer (the window only for Gemma 3), so
    the scales were searched on activations the model never produces."""
    import transformers

    from vlmctl.models.decoders import calibration_layer_kwargs, decoder_family

    cfg = getattr(transformers, cls)(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1, **kw)
    torch.manual_seed(0)
    hf = getattr(transformers, cls.replace("Config", "ForCausalLM"))(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, 90, (2, 17))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
    hf.config._attn_implementation = "sdpa"  # as quant/awq.py runs the layers
    inner = hf.model
    x = torch.nn.functional.embedding(ids, inner.embed_tokens.weight)
    kwargs = calibration_layer_kwargs(decoder_family(cfg.model_type), hf.config, inner.rotary_emb, x,
                                      torch.arange(17)[None])
    assert any(k["attention_mask"] is not None for k in kwargs)
    with torch.no_grad():
        for i, layer in enumerate(inner.layers):
            x = layer(x, **kwargs[i])
            x = x[0] if isinstance(x, tuple) else x
            if i + 1 < len(inner.layers):
                assert torch.allclose(x, ref[i + 1], atol=1e-4), i
