"""Tiny random LLaVA-NeXT and LLaVA-OneVision checkpoints, made locally (see tiny_models.py).

Sizes are chosen so the anyres paths all run: several grid pinpoints (wide, tall, square), images
whose aspect ratio leaves padding to remove, and for OneVision an `anyres_max_N` small enough that
large grids get bilinearly downscaled while small ones do not.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import LLAVA_CHAT_TEMPLATE, make_tokenizer

# [INST] ... [/INST] as the llava-v1.6-mistral checkpoints render it.
MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{{ ' [/INST]' }}"
    "{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ ' ' + c['text'] }}{% endif %}{% endfor %}"
    "{{ '</s>' }}"
    "{% endif %}"
    "{% endfor %}"
)

# ChatML, as the llava-onevision-qwen2 checkpoints render it: a message's images, then its videos, then its text.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'video' %}{{ '<video>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [56, 84], [84, 56], [84, 84],
                [28, 112], [112, 28], [112, 112]]


def _big_init(model, init_range: float) -> None:
    """Large decoder weights (logits far from ties) and a visible image_newline."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and p.dim() == 2:
                p.normal_(0, init_range)
        model.model.image_newline.normal_(0, 1.0)


def make_llava_next(out: Path, *, decoder: str = "mistral", seed: int = 0, num_kv_heads: int = 2,
                    feature_layer=-2, image_size: int = 28, patch_size: int = 7, hidden: int = 64,
                    pinpoints=None, init_range: float = 0.2, tie: bool = False) -> Path:
    """LlavaNextForConditionalGeneration: CLIP tower (with CLS, `default` strategy), Mistral or Llama decoder."""
    import torch
    from transformers import (CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextProcessor, MistralConfig)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    out = Path(out)
    pinpoints = pinpoints or NEXT_PINPOINTS
    tok = make_tokenizer(["<image>"])
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          image_size=image_size, patch_size=patch_size, projection_dim=32)
    text_cls = {"mistral": MistralConfig, "llama": LlamaConfig}[decoder]
    tc = text_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=num_kv_heads, vocab_size=len(tok), max_position_embeddings=1024,
                  initializer_range=init_range, tie_word_embeddings=tie, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = LlavaNextConfig(vision_config=vc, text_config=tc, image_token_index=tok.convert_tokens_to_ids("<image>"),
                          vision_feature_layer=feature_layer, vision_feature_select_strategy="default",
                          image_grid_pinpoints=pinpoints, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    _big_init(model, init_range)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": image_size},
                                    crop_size={"height": image_size, "width": image_size},
                                    image_grid_pinpoints=pinpoints)
    template = MISTRAL_CHAT_TEMPLATE if decoder == "mistral" else LLAVA_CHAT_TEMPLATE
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=patch_size,
                              vision_feature_select_strategy="default", chat_template=template,
                              image_token="<image>", num_additional_image_tokens=1)
    proc.save_pretrained(out)
    return out


def make_llava_onevision(out: Path, *, seed: int = 0, num_kv_heads: int = 2, aspect_ratio: str = "anyres_max_9",
                         image_size: int = 28, patch_size: int = 7, hidden: int = 64, pinpoints=None,
                         init_range: float = 0.2, tie: bool = False) -> Path:
    """LlavaOnevisionForConditionalGeneration: SigLIP tower (no CLS, `full`), Qwen2 decoder (q/k/v biases).

    The combined LlavaOnevisionProcessor cannot be built without torchvision (its video
    processor), so its files are written directly: the image processor's preprocessor_config.json,
    the tokenizer, chat_template.jinja and processor_config.json with the processor's settings.
    """
    import torch
    from transformers import (GenerationConfig, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              Qwen2Config, SiglipVisionConfig)
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    out = Path(out)
    pinpoints = pinpoints or OV_PINPOINTS
    tok = make_tokenizer(["<image>", "<video>", "<|im_start|>", "<|im_end|>"])
    vc = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=image_size, patch_size=patch_size, vision_use_head=False)
    tc = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=num_kv_heads, vocab_size=len(tok), max_position_embeddings=1024,
                     initializer_range=init_range, tie_word_embeddings=tie, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = LlavaOnevisionConfig(vision_config=vc, text_config=tc,
                               image_token_index=tok.convert_tokens_to_ids("<image>"),
                               video_token_index=tok.convert_tokens_to_ids("<video>"),
                               vision_feature_layer=-1, vision_feature_select_strategy="full",
                               image_grid_pinpoints=pinpoints, vision_aspect_ratio=aspect_ratio,
                               tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    _big_init(model, init_range)
    with torch.no_grad():  # q/k/v biases matter: make them visible
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, init_range)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    ip = LlavaOnevisionImageProcessorPil(size={"height": image_size, "width": image_size},
                                         image_grid_pinpoints=pinpoints)
    ip.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "image_token": "<image>", "video_token": "<video>",
        "num_image_tokens": (image_size // patch_size) ** 2, "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": aspect_ratio}, indent=2))
    return out


def dequantized_reference(model_cls, ckpt: Path, quantized_llm: Path, family):
    """The HF VLM from `ckpt` (fp32) with its decoder replaced by an AWQ decoder's weights,
    dequantized: the model whose greedy tokens an AWQ engine must reproduce exactly."""
    import torch

    from vlmctl.checkpoint import iter_tensors
    from vlmctl.models.base import DECODER
    from vlmctl.quant.packing import dequantize_gemm

    quant = json.loads((Path(quantized_llm) / "config.json").read_text())["quantization_config"]
    tensors = {k: t for k, t, _ in iter_tensors(quantized_llm)}
    model = model_cls.from_pretrained(ckpt, dtype=torch.float32).eval()
    state = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales")):
            continue
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            t = dequantize_gemm(t, tensors[base + ".qzeros"], tensors[base + ".scales"],
                                bits=quant["bits"], group_size=quant["group_size"])
            name = base + ".weight"
        state[family.join_key(DECODER, name)] = t.to(torch.float32)
    current = model.state_dict()
    missing = [k for k in state if k not in current]
    assert not missing, missing[:3]
    assert any(k.endswith("q_proj.weight") for k in state)
    model.load_state_dict(state, strict=False)
    return model
