"""LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP vision tower -> MLP projector -> Llama decoder.

Everything vlmctl knows about LLaVA-1.5 lives here: tensor names (current and legacy), the
feature layer and select strategy, the image-token count, and the chat-template handling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .base import FamilyProcessor, ImageItem, TritonStock, VLMFamily, read_json

# Legacy (transformers 4.x, as on the hub) -> current transformers names.
_LEGACY_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


class LlavaVisionWrapper:
    """Factory for the export module (kept as a function to import torch lazily)."""

    @staticmethod
    def build(config, feature_layer, select_strategy):
        import torch
        from torch import nn
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        class Wrapper(nn.Module):
            def __init__(self):
                super().__init__()
                self.vision_tower = AutoModel.from_config(config.vision_config)
                self.multi_modal_projector = LlavaMultiModalProjector(config)
                self.feature_layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
                self.select_strategy = select_strategy

            def truncate_unused_layers(self) -> None:
                # Layers after the deepest selected hidden state never affect the output.
                layers = getattr(self.vision_tower, "vision_model", self.vision_tower).encoder.layers
                n = len(layers)
                idx = [(i if i >= 0 else n + 1 + i) for i in self.feature_layers]
                keep = max(max(idx), 1)  # hidden_states needs one layer to exist at all
                del layers[keep:]
                self.feature_layers = idx

            def forward(self, pixel_values):
                out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
                feats = [out.hidden_states[i] for i in self.feature_layers]
                if self.select_strategy == "default":
                    feats = [f[:, 1:] for f in feats]
                return self.multi_modal_projector(torch.cat(feats, dim=-1) if len(feats) > 1 else feats[0])

        return Wrapper()


class LlavaFamily(VLMFamily):
    name = "llava"
    architectures = ("LlavaForConditionalGeneration",)
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
    multi_image = True
    legacy_prefixes = _LEGACY_PREFIXES
    # The stock preprocessing leaves LLaVA-1.5's images to the client (CLIP pixels as `image_input`)
    # and puts the image rows first ("USER:\n" + rows + text + " ASSISTANT:"); with max_num_images > 1
    # it splits the text at `<image>` markers instead. Its encoder model runs tower + projector, as
    # vlmctl's graph does (the hidden state of vision_feature_layer without the CLS row).
    triton_stock = TritonStock("llava", client_pixels=True)
    graph_vision = True  # CLIP/SigLIP tower + projector on fixed-size images

    def hf_config(self, config_dict: dict):
        from transformers import LlavaConfig

        return LlavaConfig.from_dict(config_dict)

    def hf_model_class(self):
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration

    def text_config_dict(self, config_dict: dict) -> dict:
        return self.standalone_text_config(config_dict)

    def vision_module_names(self) -> list[str]:
        return ["vision_tower", "multi_modal_projector"]

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(
            lambda: LlavaVisionWrapper.build(config, config.vision_feature_layer,
                                             config.vision_feature_select_strategy),
            vision_dir)
        wrapper.truncate_unused_layers()
        return wrapper.to(dtype).eval().requires_grad_(False)

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        import torch

        vc = self.hf_config(vision_config).vision_config
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(batch, 3, vc.image_size, vc.image_size, generator=g).to(dtype)}

    def hf_image_features(self, model, inputs: dict[str, Any]):
        import torch

        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             vision_feature_layer=model.config.vision_feature_layer,
                                             vision_feature_select_strategy=model.config.vision_feature_select_strategy)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.stack(list(feats))

    # ---- prompt ----------------------------------------------------------------------------
    def rows_per_image(self, config_dict: dict) -> int:
        """Every image's feature rows: the tower's patches (and its CLS row under the "full" strategy)."""
        cfg = self.hf_config(config_dict)
        vc = cfg.vision_config
        n = (vc.image_size // vc.patch_size) ** 2 + 1
        return n - 1 if cfg.vision_feature_select_strategy == "default" else n

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        return self.rows_per_image(config_dict)

    def min_image_tokens(self, config_dict: dict) -> int:
        return self.rows_per_image(config_dict)

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "LlavaProcessorAdapter":
        return LlavaProcessorAdapter(self, Path(processor_dir))


class LlavaProcessorAdapter(FamilyProcessor):
    """Chat template + CLIP image processor, expanding `<image>` as LlavaProcessor does."""

    def __init__(self, family: LlavaFamily, processor_dir: Path):
        super().__init__(family, processor_dir)
        self.image_token_id = self.config_token_id("image_token_index", "image_token_id")
        self.placeholder = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.rows = family.rows_per_image(self.config)

    def image_item(self, image, content_hash: str) -> ImageItem:
        pv = self.image_processor(images=[image.convert("RGB")], return_tensors="np")["pixel_values"]
        return ImageItem(inputs={"pixel_values": np.ascontiguousarray(pv, dtype=np.float32)}, num_tokens=self.rows,
                         content_hash=content_hash)

    def image_text(self, item: ImageItem) -> str:
        return self.placeholder * item.num_tokens

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        return self.rows
