"""Tiny random Gemma 3 (`Gemma3ForConditionalGeneration`) checkpoints, made locally (see tiny_models.py).

Laid out like google/gemma-3-*-it: `model.vision_tower.vision_model.*` (SigLIP without its pooling
head), `model.multi_modal_projector.*`, `model.language_model.*` tensors (lm_head tied to the
embedding), a tokenizer with Gemma's turn and image tokens (`<start_of_image>` is the placeholder
the chat template writes, `<image_soft_token>` the rows it expands to), a preprocessor_config.json
naming the (torchvision) class the hub names, processor_config.json with `image_seq_length`, and
Gemma 3's chat template. The text decoder alternates sliding-window and global layers, and its
window is shorter than the prompts and than one image, so both layer types and the window inside
an image's bidirectional block matter.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import make_tokenizer

GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]

# The chat template of google/gemma-3-4b-it (chat_template.json), verbatim.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def make_gemma3(out: Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 4, mm_tokens: int = 16,
                text_layers: int = 4, pattern: int = 2, sliding_window: int = 12, hidden: int = 64,
                num_kv_heads: int = 2, head_dim: int = 16, query_pre_attn_scalar: int = 24, tie: bool = True,
                text_tie: bool | None = None, pan_and_scan: bool = False, vision_layers: int = 2,
                final_logit_softcapping: float | None = None, init_range: float = 0.3, embed_init: float = 0.1,
                vision_init: float = 0.2) -> Path:
    """A tiny Gemma3ForConditionalGeneration. `tie`: the top-level tie_word_embeddings (`text_tie` the
    text config's, its default when None); `pan_and_scan`: the image processor's do_pan_and_scan."""
    import torch
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              GenerationConfig)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(GEMMA_SPECIALS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                sliding_window=sliding_window, sliding_window_pattern=pattern,
                query_pre_attn_scalar=query_pre_attn_scalar, max_position_embeddings=1024,
                rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=10000.0, rope_local_base_freq=100.0,
                final_logit_softcapping=final_logit_softcapping, rms_norm_eps=1e-6,
                bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, ids["<end_of_turn>"]],
                pad_token_id=tok.pad_token_id)
    if text_tie is not None:
        text["tie_word_embeddings"] = text_tie
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=vision_layers, num_attention_heads=4, image_size=image_size,
                  patch_size=patch_size, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
                       boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                       image_token_index=ids["<image_soft_token>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # large decoder weights (logits far from ties); everything random in the vision part
        for name, p in model.named_parameters():
            if "embed_tokens" in name or name.startswith("lm_head"):
                # scaled by sqrt(hidden) on the way in: a small init keeps the layers' share of the residual
                # stream large (else the tied head mostly predicts the current token)
                p.normal_(0, embed_init)
            elif "language_model" in name and p.dim() == 2:
                p.normal_(0, init_range)
            elif "language_model" in name:  # (1 + w) norms: sandwich norms and the final norm amplify
                big = "post_" in name or name.endswith("language_model.norm.weight")
                p.normal_(1.5 if big else 0.0, 0.5)
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0, 0.5)  # HF initializes it to zeros (images would not matter)
            elif p.dim() >= 2:
                p.normal_(0, vision_init)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
            elif "mm_soft_emb_norm" in name:
                p.normal_(0, 0.3)
            else:  # layer norm weights
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                                               eos_token_id=[tok.eos_token_id, ids["<end_of_turn>"]])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tcfg = json.loads(tc_path.read_text())
    # Gemma3Processor reads these tokenizer attributes (boi_token, image_token, ... and their ids)
    tcfg["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                    "image_token": "<image_soft_token>"}
    tc_path.write_text(json.dumps(tcfg, indent=2))
    ip = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=[0.5, 0.5, 0.5],
                                 image_std=[0.5, 0.5, 0.5], resample=2, do_pan_and_scan=pan_and_scan or None,
                                 pan_and_scan_min_crop_size=8 if pan_and_scan else None,
                                 pan_and_scan_max_num_crops=3 if pan_and_scan else None,
                                 pan_and_scan_min_ratio_to_activate=1.2 if pan_and_scan else None)
    ip.save_pretrained(out)
    pp = out / "preprocessor_config.json"
    pcfg = json.loads(pp.read_text())
    pcfg.update({"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor"})
    pp.write_text(json.dumps(pcfg, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"image_seq_length": mm_tokens,
                                                           "processor_class": "Gemma3Processor"}, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_CHAT_TEMPLATE}, indent=2))
    return out
