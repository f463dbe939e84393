"""Tiny random Llama 3.2 Vision (`MllamaForConditionalGeneration`) checkpoints, made locally (see tiny_models.py).

Laid out like meta-llama/Llama-3.2-11B-Vision-Instruct: `model.vision_model.*` (a tiled ViT with a
local and a gated global encoder), `model.multi_modal_projector.*`, `model.language_model.*` (self-
attention layers with gated cross-attention layers interleaved) and a separate `lm_head`. As on the
hub, `<|image|>` is the token right after the text vocabulary: its id equals `text_config.vocab_size`,
so only the token embedding (vocab_size + 8 rows) has a row for it, the LM head has none. The
tokenizer is Llama 3's shape (BOS `<|begin_of_text|>`, header and turn tokens), the image processor
is transformers' PIL Mllama processor (tiles of `image_size`, at most 4, with the hub's 8 aspect
ratios), and the chat template follows the hub's rules: a system block ("Cutting Knowledge Date")
only for prompts without images, `<|image|>` where a message has an image part.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import CORPUS

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
IMAGE_TOKEN = "<|image|>"

# The hub template's rules, written compactly: BOS; a system block when no message has an image
# (refusing a system message together with images, as the hub's does); each message as a header,
# its parts in order (`<|image|>` for an image part), `<|eot_id|>`.
MLLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text']|trim %}{%- endif %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- set image_ns = namespace(has_images=false) %}"
    "{%- for message in messages %}{%- if message['content'] is not string %}"
    "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}"
    "{%- set image_ns.has_images = true %}{%- endif %}{%- endfor %}{%- endif %}{%- endfor %}"
    "{%- if image_ns.has_images and not system_message == '' %}"
    "{{- raise_exception('Prompting with images is incompatible with system messages.') }}{%- endif %}"
    "{%- if not image_ns.has_images %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def make_llama3_tokenizer(vocab_size: int = 200):
    """A byte-level BPE tokenizer trained on CORPUS with Llama 3's special tokens; `<|image|>` is
    added last, so its id is the text vocabulary's size (as on the hub: 128256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>")
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert fast.convert_tokens_to_ids(IMAGE_TOKEN) == len(fast) - 1
    return fast


def make_mllama(out: Path, *, seed: int = 0, image_size: int = 16, patch_size: int = 4, vision_layers: int = 3,
                global_layers: int = 2, text_layers: int = 5, cross_layers=(1, 3), hidden: int = 64,
                num_kv_heads: int = 2, init_range: float = 0.4, vision_init: float = 0.2,
                gate: float = 1.0) -> Path:
    """A tiny MllamaForConditionalGeneration. Tiles are `image_size` px (the hub: 560), each
    (image_size / patch_size)^2 + 1 rows; images split into at most 4 tiles. `gate`: scale of the
    cross-attention layers' tanh gates (transformers initializes them to 0, which would hide the
    images; the hub's trained gates are far from 0)."""
    import torch
    from transformers import GenerationConfig, MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_llama3_tokenizer()
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = image_id  # the text vocabulary ends right before <|image|>
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA3_SPECIALS}
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=num_kv_heads, cross_attention_layers=list(cross_layers),
                max_position_embeddings=1024, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64},
                bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos,
                pad_token_id=ids["<|finetune_right_pad_id|>"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                  num_global_layers=global_layers, attention_heads=4, image_size=image_size, patch_size=patch_size,
                  max_num_tiles=4, vision_output_dim=32 * (1 + 2), intermediate_layers_indices=[0, vision_layers - 1],
                  norm_eps=1e-5)
    cfg = MllamaConfig(text_config=text, vision_config=vision, image_token_index=image_id)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.copy_(gate * (0.8 + 0.4 * torch.rand_like(p)))
            elif "language_model" in name and p.dim() == 2 or name.startswith("lm_head"):
                p.normal_(0, init_range)
            elif "language_model" in name:  # norm gains (self and per-head q/k norms)
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate"):  # the vision tower's gated positional / tile embeddings
                p.normal_(0, 1.0)
            elif p.dim() >= 2 or "embedding" in name:
                p.normal_(0, vision_init)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            else:  # layer norm gains
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=eos,
                                               pad_token_id=text["pad_token_id"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    ip = MllamaImageProcessorPil(size={"height": image_size, "width": image_size}, max_image_tiles=4,
                                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    ip.save_pretrained(out)
    pp = out / "preprocessor_config.json"
    pcfg = json.loads(pp.read_text())
    # the hub names the (torchvision) class and the combined processor
    pcfg.update({"image_processor_type": "MllamaImageProcessor", "processor_class": "MllamaProcessor"})
    pp.write_text(json.dumps(pcfg, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": MLLAMA_CHAT_TEMPLATE}, indent=2))
    return out
