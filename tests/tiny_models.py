"""Tiny random checkpoints made locally (weights, tokenizer, processor, chat template).

Nothing is downloaded: the tokenizer is trained here on a few sentences, the image processor and
chat template are written here, and weights are random with a large initializer range so greedy
decoding is not decided by near-ties.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "USER: ASSISTANT: what is in this image? describe the picture in one sentence.",
    "a red square on a blue background, a cat, a dog, the sky is green today.",
    "hello world! how are you? I am fine, thank you. numbers 0 1 2 3 4 5 6 7 8 9",
    "The quick brown fox jumps over the lazy dog. Tell me a story about a robot.",
]

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_tokenizer(extra_special: list[str], vocab_size: int = 200):
    """A byte-level BPE tokenizer trained on CORPUS; ids of specials come first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"] + extra_special
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", extra_special_tokens={t.strip("<>") + "_token": t for t in extra_special} if False else None)
    fast.add_special_tokens({"additional_special_tokens": extra_special})
    return fast


def make_llava(out: Path, *, seed: int = 0, num_kv_heads: int = 2, feature_layer=-2, select_strategy="default",
               image_size: int = 28, patch_size: int = 7, text_layers: int = 2, hidden: int = 64,
               init_range: float = 0.2, tie: bool = False) -> Path:
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out)
    tok = make_tokenizer(["<image>"])
    image_id = tok.convert_tokens_to_ids("<image>")
    vocab = len(tok)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          image_size=image_size, patch_size=patch_size, projection_dim=32)
    tc = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers,
                     num_attention_heads=4, num_key_value_heads=num_kv_heads, vocab_size=vocab,
                     max_position_embeddings=1024, initializer_range=init_range, tie_word_embeddings=tie,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=image_id,
                      vision_feature_layer=feature_layer, vision_feature_select_strategy=select_strategy,
                      initializer_range=init_range, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # large weights so logits are far from ties
        for name, p in model.named_parameters():
            if "language_model" in name and p.dim() == 2:
                p.normal_(0, init_range)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    ip = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    n_extra = 1
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=patch_size,
                          vision_feature_select_strategy=select_strategy, chat_template=LLAVA_CHAT_TEMPLATE,
                          image_token="<image>", num_additional_image_tokens=n_extra)
    proc.save_pretrained(out)
    return out


def make_image(seed: int, size=(40, 30)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


# ---- InternVL (HF format) ----------------------------------------------------------------------
INTERNVL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
# The template transformers' convert_internvl_weights_to_hf.py writes for InternVL3-*-hf.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


def make_internvl(out: Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 4, max_patches: int = 6,
                  feature_layer: int = -1, num_kv_heads: int = 2, tie: bool = False, qk_norm: bool = False,
                  norm_type: str = "layer_norm", mean_pooling: bool = True, text_layers: int = 2, hidden: int = 64,
                  init_range: float = 0.2) -> Path:
    """A tiny InternVLForConditionalGeneration laid out like OpenGVLab/InternVL3-*-hf: Qwen2 decoder,
    Qwen-style tokenizer (no BOS, eos <|im_end|>) with the img/context tokens as extra specials,
    a GotOcr2 preprocessor_config.json naming the Fast class (as on the hub), the chat template."""
    import json

    import torch
    from tokenizers import processors
    from transformers import (GenerationConfig, GotOcr2ImageProcessorPil, InternVLConfig,
                              InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(INTERNVL_SPECIALS)
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # Qwen2: no BOS
    tok.chat_template = INTERNVL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in INTERNVL_SPECIALS}
    eos = ids["<|im_end|>"]
    vc = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, use_qk_norm=qk_norm, norm_type=norm_type,
                              use_mean_pooling=mean_pooling, attention_bias=True)
    tc = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers,
                     num_attention_heads=4, num_key_value_heads=num_kv_heads, vocab_size=len(tok),
                     max_position_embeddings=2048, initializer_range=init_range, tie_word_embeddings=tie,
                     bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    grid = image_size // patch_size
    cfg = InternVLConfig(vision_config=vc, text_config=tc, image_token_id=ids["<IMG_CONTEXT>"],
                         image_seq_length=(grid // 2) ** 2, downsample_ratio=0.5, vision_feature_layer=feature_layer,
                         vision_feature_select_strategy="default", tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random everywhere (HF zero-inits cls/position embeddings), large decoder weights
        for name, p in model.named_parameters():
            if "language_model" in name and p.dim() == 2:
                p.normal_(0, init_range)
            elif "language_model" not in name and not name.startswith("lm_head"):
                if p.dim() >= 2:
                    p.normal_(0, 0.1)
                elif name.endswith("bias"):
                    p.normal_(0, 0.05)
                else:  # norm weights, layer-scale lambdas
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tcfg = json.loads(tc_path.read_text())
    tcfg["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                    "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tc_path.write_text(json.dumps(tcfg, indent=2))
    ip = GotOcr2ImageProcessorPil(size={"height": image_size, "width": image_size}, max_patches=max_patches,
                                  min_patches=1, crop_to_patches=False, image_mean=[0.485, 0.456, 0.406],
                                  image_std=[0.229, 0.224, 0.225])
    ip.save_pretrained(out)
    pp = out / "preprocessor_config.json"
    pcfg = json.loads(pp.read_text())
    pcfg.update({"image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor"})
    pp.write_text(json.dumps(pcfg, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                           "image_seq_length": (grid // 2) ** 2}, indent=2))
    (out / "chat_template.jinja").write_text(INTERNVL_CHAT_TEMPLATE)
    return out


# ---- Qwen2-VL / Qwen2.5-VL ---------------------------------------------------------------------

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]

# The chat template of Qwen/Qwen2-VL-7B-Instruct (processor chat_template), verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content"
    " or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


# A Qwen2.5-VL-like template that renders tools the Hermes way (written for these tests). transformers
# renders with trim_blocks, which eats a newline right after a {% tag %}: those are written {{ '\n' }}.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content[0].text if messages[0].content is not string "
    "else messages[0].content }}{% else %}You are a helpful assistant.{% endif %}{{ '\n\n' }}# Tools\n\n"
    "Functions you can call are listed in <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "To call one, write its name and arguments as a JSON object inside <tool_call></tool_call>:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not tools %}<|im_start|>system\n"
    "{{ message.content[0].text if message.content is not string else message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message.tool_calls or [] %}{% if not loop.first or message.content %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_qwen_tokenizer(vocab_size: int = 240, tool_tokens: bool = False):
    """Byte-level BPE like Qwen2's: no BOS, <|endoftext|> pads, <|im_end|> ends a turn. `tool_tokens`:
    <tool_call> and </tool_call> as added (not special) tokens, as in Qwen2.5's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = CORPUS + ["system You are a helpful assistant. user assistant"]
    tok.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    if tool_tokens:
        fast.add_tokens(["<tool_call>", "</tool_call>"])
    return fast


def make_qwen2_vl(out: Path, *, version: str = "2", seed: int = 0, num_kv_heads: int = 2, text_layers: int = 2,
                  hidden: int = 64, vision_depth: int = 3, patch_size: int = 4, min_pixels: int = 256,
                  max_pixels: int = 4096, window_size: int = 16, fullatt_block_indexes=(1,), tie: bool = False,
                  mrope_section=(2, 3, 3), init_range: float = 0.2, vision_init: float = 0.1,
                  chat_template: str = QWEN2_VL_CHAT_TEMPLATE, tool_tokens: bool = False) -> Path:
    """A tiny random Qwen2-VL (version "2") or Qwen2.5-VL (version "2.5") checkpoint in the hub's layout
    (legacy tensor names `visual.*` / `model.layers.*`, preprocessor_config.json with min/max pixels).
    `chat_template` (default Qwen2-VL's own) and `tool_tokens` (make_qwen_tokenizer) let a test build a
    checkpoint whose template renders tools the Hermes way (TOOLS_TEMPLATE)."""
    import json

    import torch
    from transformers import GenerationConfig

    out = Path(out)
    tok = make_qwen_tokenizer(tool_tokens=tool_tokens)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=num_kv_heads, vocab_size=len(tok),
                max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=init_range,
                rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": list(mrope_section)},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if version == "2":
        from transformers import Qwen2VLConfig as Cfg
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=vision_depth, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=4,
                      patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2)
    elif version == "2.5":
        from transformers import Qwen2_5_VLConfig as Cfg
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=hidden,
                      patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2, window_size=window_size,
                      fullatt_block_indexes=list(fullatt_block_indexes), tokens_per_second=2)
    else:
        raise ValueError(version)
    cfg = Cfg(text_config=text, vision_config=vision, tie_word_embeddings=tie, **special)
    torch.manual_seed(seed)
    model = Model(cfg).eval()
    with torch.no_grad():  # large weights so logits are far from ties, and images matter
        for name, p in model.named_parameters():
            if "language_model" in name and p.dim() == 2:
                p.normal_(0, init_range)
            elif "visual" in name and p.dim() >= 2:
                p.normal_(0, vision_init)
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                                               eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]])
    model.save_pretrained(out)
    # The hub's (transformers 4.x) tensor names, which vlmctl must map: visual.*, model.layers.*, lm_head.
    from safetensors.torch import load_file, save_file

    for f in out.glob("*.safetensors"):
        state = load_file(str(f))
        renamed = {}
        for k, v in state.items():
            if k.startswith("model.visual."):
                k = k[len("model."):]
            elif k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model."):]
            renamed[k] = v
        save_file(renamed, str(f), metadata={"format": "pt"})
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(chat_template)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": patch_size, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if version == "2.5" else "Qwen2VLProcessor"}, indent=2))
    return out
