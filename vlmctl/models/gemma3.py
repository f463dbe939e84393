"""Gemma 3 (`Gemma3ForConditionalGeneration`: gemma-3-4b/12b/27b-it): SigLIP -> Gemma 3 projector -> Gemma 3 decoder.

The tower (SigLIP, no pooling head) turns a square image (896 px on the hub) into a patch grid;
the projector average-pools it to `mm_tokens_per_image` rows (256 on the hub), normalizes them with
Gemma's (1 + w) RMSNorm and projects them to the decoder's width. The image processor resizes
every image to the tower's square (no aspect ratio kept), so every image is `mm_tokens_per_image`
rows. In the prompt the chat template writes `<start_of_image>` per image; Gemma3Processor
replaces it by `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
`<end_of_image>\\n\\n`. The rendered prompt starts with the template's BOS, so it is tokenized
without adding another (what Gemma3Processor.apply_chat_template does).

Pan-and-scan (extra crops of wide or tall images) is not offered: transformers 5's Gemma3Processor
passes its own image settings (`Gemma3Processor.images_kwargs`: pan-and-scan off) over whatever
preprocessor_config.json says and turns it on only when a caller asks per call; vlmctl passes the
same settings, so a checkpoint config that enables it changes nothing here either.

The decoder (models/decoders.py, "gemma3_text") is where Gemma differs from Llama; all of it goes
to the runtime through the DecoderSpec. The VLM adds one thing: during prefill the rows of one image
attend to each other in both directions (transformers' token_type_ids mask), which this family
declares as `image_attention = "bidirectional"`. Not applied, as transformers does not apply them in
Gemma3ForConditionalGeneration: the text config's final_logit_softcapping and attn_logit_softcapping.

Everything vlmctl knows about Gemma 3 as a VLM lives here: tensor names (current and the hub's),
the vision graph, the image-token count, and the placeholder expansion. Preprocessing is
transformers' own PIL image processor (Gemma3ImageProcessorPil).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError, UnsupportedModelError
from ..formats.awq_gemm import without_quantization
from .base import FamilyProcessor, ImageItem, VLMFamily, read_json

_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# The hub's (transformers 4.x) tensor names -> transformers 5's module names.
_LEGACY_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("model.vision_tower.vision_model.", "model.vision_tower."),
)
DEFAULT_IMAGE_SEQ_LENGTH = 256  # Gemma3Processor's default image_seq_length


class Gemma3VisionWrapper:
    """Factory for the export module (a function so torch is imported lazily)."""

    @staticmethod
    def build(config):
        from torch import nn
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        class Wrapper(nn.Module):
            """get_image_features as a plain module: pixel_values [B, 3, S, S] -> [B, mm_tokens, hidden]."""

            def __init__(self):
                super().__init__()
                self.vision_tower = AutoModel.from_config(config.vision_config)
                self.multi_modal_projector = Gemma3MultiModalProjector(config)

            def forward(self, pixel_values):
                # SiglipVisionModel.forward's last hidden state, without the output-capturing hooks
                vt = self.vision_tower
                x = vt.embeddings(pixel_values.to(vt.embeddings.patch_embedding.weight.dtype))
                x = vt.post_layernorm(vt.encoder(inputs_embeds=x).last_hidden_state)
                return self.multi_modal_projector(x)

        return Wrapper()


class Gemma3Family(VLMFamily):
    name = "gemma3"
    architectures = ("Gemma3ForConditionalGeneration",)
    vision_prefixes = _VISION_PREFIXES
    multi_image = True
    image_attention = "bidirectional"
    supports_trtllm = False
    trtllm_refusal = ("its image rows attend to each other (bidirectional), but TensorRT-LLM's prompt-table engine "
                      "attends causally among them, which would change the answers")

    def hf_config(self, config_dict: dict):
        from transformers import Gemma3Config

        cfg = Gemma3Config.from_dict(without_quantization(config_dict))
        if getattr(cfg.text_config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is an embedding model, not a "
                                        "generator")
        vc = cfg.vision_config
        side = int(vc.image_size) // int(vc.patch_size)
        per_side = int(round(cfg.mm_tokens_per_image ** 0.5))
        if per_side * per_side != cfg.mm_tokens_per_image or side % per_side:
            raise UnsupportedModelError(f"Gemma 3: mm_tokens_per_image {cfg.mm_tokens_per_image} does not pool the "
                                        f"{side}x{side} patch grid evenly")
        return cfg

    def hf_model_class(self):
        from transformers import Gemma3ForConditionalGeneration

        return Gemma3ForConditionalGeneration

    def canonical_key(self, key: str) -> str:
        for old, new in _LEGACY_PREFIXES:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    def text_config_dict(self, config_dict: dict) -> dict:
        text = self.standalone_text_config(config_dict)
        text["tie_word_embeddings"] = self.ties_lm_head(config_dict)  # the VLM's top-level flag decides
        # Gemma3ForConditionalGeneration computes plain logits (only Gemma3ForCausalLM softcaps): the
        # standalone decoder must compute what the VLM computes
        text["final_logit_softcapping"] = None
        return text

    def vision_module_names(self) -> list[str]:
        return ["vision_tower", "multi_modal_projector"]

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(lambda: Gemma3VisionWrapper.build(config), vision_dir)
        return wrapper.to(dtype).eval().requires_grad_(False)

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        import torch

        vc = self.hf_config(vision_config).vision_config
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(batch, vc.num_channels, vc.image_size, vc.image_size,
                                            generator=g).to(dtype)}

    def hf_image_features(self, model, inputs: dict[str, Any]):
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"])
        return out.pooler_output if hasattr(out, "pooler_output") else out

    # ---- prompt ----------------------------------------------------------------------------
    def rows_per_image(self, config_dict: dict) -> int:
        """Feature rows of every image, whatever its size."""
        return int(self.hf_config(config_dict).mm_tokens_per_image)

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        return self.rows_per_image(config_dict)

    def min_image_tokens(self, config_dict: dict) -> int:  # every image: pan-and-scan is not offered
        return self.rows_per_image(config_dict)

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "Gemma3ProcessorAdapter":
        return Gemma3ProcessorAdapter(self, Path(processor_dir))


def load_image_processor(processor_dir: Path):
    """transformers' PIL image processor with the engine's saved settings (the hub names the
    torchvision class, which would only fall back to this one with a warning)."""
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil.from_pretrained(str(processor_dir))


def processor_image_settings() -> dict:
    """The image settings Gemma3Processor passes over the image processor's own (pan-and-scan off)."""
    from transformers.models.gemma3 import processing_gemma3 as hf

    # a class attribute of the processor from transformers ~5.20 on; before, the defaults of its kwargs class
    settings = getattr(hf.Gemma3Processor, "images_kwargs", None)
    if settings is None:
        settings = hf.Gemma3ProcessorKwargs._defaults["images_kwargs"]
    settings = dict(settings)
    if settings.get("do_pan_and_scan"):
        raise UnsupportedModelError("this transformers' Gemma3Processor turns pan-and-scan on, which vlmctl's "
                                    "Gemma 3 prompt layout does not implement")
    return settings


class Gemma3ProcessorAdapter(FamilyProcessor):
    """Chat template + Gemma 3's PIL image processor, expanding `<start_of_image>` as Gemma3Processor does."""

    def __init__(self, family: Gemma3Family, processor_dir: Path):
        super().__init__(family, processor_dir)
        cfg = family.hf_config(self.config)
        self.image_settings = processor_image_settings()
        tok = self.tokenizer
        self.image_token_id = int(cfg.image_token_index)
        names = {}
        for what, tid in (("begin-of-image", cfg.boi_token_index), ("end-of-image", cfg.eoi_token_index),
                          ("image", cfg.image_token_index)):
            t = tok.convert_ids_to_tokens(int(tid))
            if t is None or tok.convert_tokens_to_ids(t) != int(tid):
                raise CheckpointError(f"{processor_dir}: the tokenizer has no {what} token of id {tid}")
            names[what] = t
        self.boi, self.eoi, self.image_token = names["begin-of-image"], names["end-of-image"], names["image"]
        self.placeholder = self.boi  # the chat template writes `<start_of_image>` per image
        proc_cfg = self.processor_dir / "processor_config.json"
        seq = read_json(proc_cfg).get("image_seq_length") if proc_cfg.exists() else None
        self.image_seq_length = int(seq) if seq is not None else DEFAULT_IMAGE_SEQ_LENGTH
        if self.image_seq_length != cfg.mm_tokens_per_image:
            raise CheckpointError(f"{processor_dir}: the processor's image_seq_length {self.image_seq_length} "
                                  f"disagrees with mm_tokens_per_image {cfg.mm_tokens_per_image}")
        size = self.image_processor.size or {}
        tower = int(cfg.vision_config.image_size)
        if (size.get("height"), size.get("width")) != (tower, tower):
            raise CheckpointError(f"{processor_dir}: the image processor resizes to {dict(size)}, but the vision "
                                  f"tower takes {tower}x{tower} images")
        # Gemma3Processor.full_image_sequence
        self.full_image_sequence = f"\n\n{self.boi}{self.image_token * self.image_seq_length}{self.eoi}\n\n"

    def load_image_processor(self):
        return load_image_processor(self.processor_dir)

    def preprocess(self, image) -> np.ndarray:
        """One image -> pixel_values [1, 3, S, S]."""
        try:
            out = self.image_processor(images=[image], return_tensors="np", **self.image_settings)
        except (ValueError, OSError, ZeroDivisionError) as e:  # degenerate sizes, unreadable pixel data
            raise InputError(f"the image processor rejected a {image.size[0]}x{image.size[1]} image: {e}") from None
        pv = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if pv.shape[0] != 1:
            raise InputError(f"the image processor made {pv.shape[0]} inputs of one image")
        return pv

    def image_item(self, image, content_hash: str) -> ImageItem:
        pv = self.preprocess(image.convert("RGB"))
        return ImageItem(inputs={"pixel_values": pv}, num_tokens=self.image_seq_length, content_hash=content_hash)

    def image_text(self, item: ImageItem) -> str:
        return self.full_image_sequence  # Gemma3Processor.replace_image_token

    def tokenize(self, text: str) -> list[int]:
        # the template writes the BOS itself; Gemma3Processor then tokenizes without special tokens
        bos = self.tokenizer.bos_token
        return list(self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        return self.image_seq_length
