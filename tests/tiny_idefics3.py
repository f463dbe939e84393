"""Tiny random Idefics3 / SmolVLM checkpoints, made locally (see tiny_models.py).

Laid out like the hub's SmolVLM checkpoints: `model.vision_model.*` / `model.connector.*` /
`model.text_model.*` / `lm_head.*` tensors, a Llama text config, a SmolLM2-like tokenizer with the
image tokens (`<fake_token_around_image>`, `<image>`, `<global-img>`, `<row_i_col_j>`,
`<end_of_utterance>`), a preprocessor_config.json naming the (torchvision) class the hub names,
processor_config.json with `image_seq_len`, and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import make_tokenizer

ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SMOLVLM_SPECIALS = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                    *ROW_COL]

# The template of HuggingFaceTB/SmolVLM-*-Instruct (Idefics3 architecture), verbatim.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# SmolVLM2's template (SmolVLMForConditionalGeneration): string content and video parts as well.
SMOLVLM2_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def make_idefics3(out: Path, *, arch: str = "idefics3", seed: int = 0, image_size: int = 32, patch_size: int = 4,
                  scale_factor: int = 2, longest_edge: int | None = None, do_image_splitting: bool = True,
                  num_kv_heads: int = 2, text_layers: int = 2, hidden: int = 64, vision_layers: int = 2,
                  tie: bool = False, text_tie: bool | None = None, bos: bool = True, image_seq_len: int | None = None,
                  layout_tokens: bool = True, init_range: float = 0.2, vision_init: float = 0.1) -> Path:
    """A tiny Idefics3ForConditionalGeneration (arch "idefics3") or SmolVLMForConditionalGeneration
    (arch "smolvlm"). `tie` is the top-level tie_word_embeddings, `text_tie` the text config's
    (absent when None). `bos`: the tokenizer adds a BOS of its own in front of the template's
    `<|im_start|>` (as Llama 3's does for Idefics3-8B), or adds nothing (SmolLM2's). Without
    `layout_tokens`, `<global-img>` and `<row_i_col_j>` are not tokens (as in Idefics3-8B's tokenizer):
    they are tokenized as text."""
    import torch
    from tokenizers import processors
    from transformers import GenerationConfig, Idefics3ImageProcessorPil, LlamaConfig

    if arch == "idefics3":
        from transformers import Idefics3Config as Cfg
        from transformers import Idefics3ForConditionalGeneration as Model
    elif arch == "smolvlm":
        from transformers import SmolVLMConfig as Cfg
        from transformers import SmolVLMForConditionalGeneration as Model
    else:
        raise ValueError(arch)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specials = SMOLVLM_SPECIALS if layout_tokens else SMOLVLM_SPECIALS[:4]
    tok = make_tokenizer(specials)
    if not bos:
        tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    eos = ids["<end_of_utterance>"]
    text = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers, num_attention_heads=4,
                num_key_value_heads=num_kv_heads, vocab_size=len(tok), max_position_embeddings=2048,
                initializer_range=init_range, rms_norm_eps=1e-5, rope_theta=100000.0,
                bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    if text_tie is not None:
        text["tie_word_embeddings"] = text_tie
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size)
    cfg = Cfg(vision_config=vision, text_config=LlamaConfig(**text).to_dict(), image_token_id=ids["<image>"],
              scale_factor=scale_factor, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Model(cfg).eval()
    with torch.no_grad():  # large decoder weights (logits far from ties), everything random in the tower
        for name, p in model.named_parameters():
            if "text_model" in name or name.startswith("lm_head"):
                if p.dim() == 2:
                    p.normal_(0, init_range)
            elif p.dim() >= 2:
                p.normal_(0, vision_init)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            else:  # layer norm weights
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tcfg = json.loads(tc_path.read_text())
    if arch == "smolvlm":  # SmolVLMProcessor reads its image tokens from these tokenizer attributes
        tcfg["extra_special_tokens"] = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                                        "global_image_token": "<global-img>",
                                        "end_of_utterance_token": "<end_of_utterance>"}
    tc_path.write_text(json.dumps(tcfg, indent=2))
    ip = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge or 4 * image_size},
                                   max_image_size={"longest_edge": image_size}, do_image_splitting=do_image_splitting,
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=1)
    ip.save_pretrained(out)
    pp = out / "preprocessor_config.json"
    pcfg = json.loads(pp.read_text())
    kind = "SmolVLM" if arch == "smolvlm" else "Idefics3"
    pcfg.update({"image_processor_type": f"{kind}ImageProcessor", "processor_class": f"{kind}Processor"})
    pp.write_text(json.dumps(pcfg, indent=2))
    grid = image_size // patch_size
    seq = image_seq_len if image_seq_len is not None else (grid // scale_factor) ** 2
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": seq, "processor_class": f"{kind}Processor"},
                                                          indent=2))
    template = SMOLVLM2_CHAT_TEMPLATE if arch == "smolvlm" else SMOLVLM_CHAT_TEMPLATE
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    return out
