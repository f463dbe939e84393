"""InternVL in Hugging Face format (`InternVLForConditionalGeneration`, e.g. OpenGVLab/InternVL3-2B-hf).

InternViT tower -> pixel shuffle (2x2 neighbours folded into channels) -> LayerNorm+MLP projector
-> Qwen2 decoder. An image is cut into up to `max_patches` tiles of the tower's input size on
the grid whose aspect ratio is closest to the image's, plus a thumbnail of the whole image when
there is more than one tile; every tile becomes `image_seq_length` feature rows.

Everything vlmctl knows about InternVL lives here: tensor names, the feature layer, the pixel
shuffle, the tile and token counts, and how `<IMG_CONTEXT>` expands. The tiling itself is
transformers' own PIL image processor (GotOcr2ImageProcessorPil), called with the
`crop_to_patches=True` default that InternVLProcessor passes; the combined InternVLProcessor
is not used because it refuses to load without torchvision (its video processor).

The vision ONNX graph takes tiles on its dynamic batch axis: [tiles, 3, H, W] ->
[tiles, image_seq_length, decoder hidden]; an image's rows are its tiles' rows in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError, UnsupportedModelError
from .base import FamilyProcessor, ImageItem, VisionAxis, VLMFamily, read_json

# transformers 4.x layout (before the `model.` base-model refactor) -> current names.
_LEGACY_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

# InternVLProcessor's own image defaults (its class attribute `images_kwargs`); they override the
# image processor's saved `crop_to_patches: false`.
PROCESSOR_IMAGE_KWARGS = {"crop_to_patches": True}
# GotOcr2 image processor default when the checkpoint's preprocessor_config.json is not at hand.
DEFAULT_MAX_PATCHES = 12

# Placeholder tokens: names of the tokenizer attributes (extra_special_tokens) and their defaults.
_SPECIAL = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>"}


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


class InternVLVisionWrapper:
    """Factory for the export module (a function so torch is imported lazily)."""

    @staticmethod
    def build(config):
        from torch import nn
        from transformers import AutoModel
        from transformers.models.internvl.modeling_internvl import InternVLModel, InternVLMultiModalProjector

        class Wrapper(nn.Module):
            """InternVLModel.get_image_features as a plain module: pixel_values -> projected rows."""

            def __init__(self):
                super().__init__()
                self.vision_tower = AutoModel.from_config(config.vision_config)
                self.multi_modal_projector = InternVLMultiModalProjector(config)
                self.feature_layer = int(config.vision_feature_layer)
                self.downsample_ratio = config.downsample_ratio
                # Tiles always have the tower's input size, where transformers uses the position
                # table as is, except under tracing, where it "interpolates" it to the same size
                # (an identity bicubic Resize in the graph). Take the eager path for that size.
                emb = self.vision_tower.embeddings
                native, resize = tuple(emb.image_size), emb.interpolate_pos_encoding

                def position_table(embeddings, height, width):
                    if (int(height), int(width)) == native:
                        return emb.position_embeddings
                    return resize(embeddings, height, width)

                emb.interpolate_pos_encoding = position_table

            def truncate_unused_layers(self) -> None:
                # Layers after the selected hidden state never affect the output. hidden_states[i]
                # is the output of layer i (0 = embeddings), so keeping i layers makes it the
                # encoder's output. -1 means last_hidden_state (after the final norm): keep all.
                if self.feature_layer == -1:
                    return
                layers = self.vision_tower.encoder.layer
                n = len(layers)
                idx = self.feature_layer if self.feature_layer >= 0 else n + 1 + self.feature_layer
                if not 0 <= idx <= n:
                    raise CheckpointError(f"vision_feature_layer {self.feature_layer} is out of range for a "
                                          f"{n}-layer vision tower")
                del layers[idx:]
                self.feature_layer = idx

            def forward(self, pixel_values):
                vt = self.vision_tower
                # InternVLVisionModel.forward without the output-capturing hooks (they do not trace).
                hidden = vt.encoder(vt.embeddings(pixel_values)).last_hidden_state
                if self.feature_layer == -1:
                    hidden = vt.layernorm(hidden)  # Identity when use_mean_pooling
                feats = hidden[:, 1:, :]  # select strategy "default": drop the CLS row
                side = int(feats.shape[1] ** 0.5)
                batch = feats.shape[0]
                feats = feats.reshape(batch, side, side, -1)
                feats = InternVLModel.pixel_shuffle(self, feats, scale_factor=self.downsample_ratio)
                feats = feats.reshape(batch, -1, feats.shape[-1])
                return self.multi_modal_projector(feats)

        return Wrapper()


class InternVLFamily(VLMFamily):
    name = "internvl"
    architectures = ("InternVLForConditionalGeneration",)
    vision_prefixes = _VISION_PREFIXES
    multi_image = True
    legacy_prefixes = _LEGACY_PREFIXES

    def hf_config(self, config_dict: dict):
        from transformers import InternVLConfig

        cfg = InternVLConfig.from_dict(config_dict)
        self._check(cfg)
        return cfg

    @staticmethod
    def _check(cfg) -> None:
        # Other settings make transformers' own get_image_features fail (non-square grid,
        # list indexing of hidden states), so they are refused at convert time.
        if cfg.vision_feature_select_strategy != "default":
            raise UnsupportedModelError(f"InternVL: vision_feature_select_strategy "
                                        f"{cfg.vision_feature_select_strategy!r} is not supported (only 'default')")
        if not isinstance(cfg.vision_feature_layer, int):
            raise UnsupportedModelError(f"InternVL: vision_feature_layer must be one layer index "
                                        f"(got {cfg.vision_feature_layer!r})")
        vc = cfg.vision_config
        (h, w), (ph, pw) = _pair(vc.image_size), _pair(vc.patch_size)
        grid = h // ph
        if h != w or ph != pw or grid * ph != h:
            raise UnsupportedModelError(f"InternVL: the vision tower needs square tiles split into a square patch "
                                        f"grid (image_size {vc.image_size}, patch_size {vc.patch_size})")
        scaled = grid * cfg.downsample_ratio
        if abs(scaled - round(scaled)) > 1e-9:
            raise UnsupportedModelError(f"InternVL: downsample_ratio {cfg.downsample_ratio} does not divide the "
                                        f"{grid}x{grid} patch grid")

    def hf_model_class(self):
        from transformers import InternVLForConditionalGeneration

        return InternVLForConditionalGeneration

    def text_config_dict(self, config_dict: dict) -> dict:
        text = self.standalone_text_config(config_dict)
        # transformers' rule (VLMFamily.ties_lm_head); convert unties when the checkpoint has its own lm_head
        # (InternVL3-8B: top-level default true, text config false, lm_head present).
        text["tie_word_embeddings"] = self.ties_lm_head(config_dict)
        return text

    def vision_module_names(self) -> list[str]:
        return ["vision_tower", "multi_modal_projector"]

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(lambda: InternVLVisionWrapper.build(config), vision_dir)
        wrapper.truncate_unused_layers()
        return wrapper.to(dtype).eval().requires_grad_(False)

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        return ["pixel_values"], ["image_features"], {"pixel_values": {0: "tiles"}, "image_features": {0: "tiles"}}

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        import torch

        vc = self.hf_config(vision_config).vision_config
        h, w = _pair(vc.image_size)
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(batch, vc.num_channels, h, w, generator=g).to(dtype)}

    def hf_image_features(self, model, inputs: dict[str, Any]):
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             vision_feature_layer=model.config.vision_feature_layer,
                                             vision_feature_select_strategy=model.config.vision_feature_select_strategy)
        return out.pooler_output if hasattr(out, "pooler_output") else out

    # ---- prompt ----------------------------------------------------------------------------
    def rows_per_crop(self, config_dict: dict) -> int:
        """Feature rows of one tile (the processor's image_seq_length)."""
        cfg = self.hf_config(config_dict)
        vc = cfg.vision_config
        grid = _pair(vc.image_size)[0] // _pair(vc.patch_size)[0]
        return int(round(grid * cfg.downsample_ratio)) ** 2

    def max_tiles(self, max_patches: int = DEFAULT_MAX_PATCHES, min_patches: int = 1,
                  crop_to_patches: bool = True) -> int:
        """Most tiles one image becomes: the grid plus the thumbnail (when the grid has > 1 tile)."""
        if not crop_to_patches or max_patches <= 1:
            return 1
        return max_patches + 1

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        # Without the engine's processor settings: InternVL checkpoints use the GotOcr2 default (12).
        patches = _processor_max_patches(processor_dir) if processor_dir is not None else DEFAULT_MAX_PATCHES
        return self.max_tiles(patches) * self.rows_per_crop(config_dict)

    def min_image_tokens(self, config_dict: dict) -> int:
        """An image is one tile at least."""
        return self.rows_per_crop(config_dict)

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis:
        """The graph's batch axis counts tiles: an image needs up to its most tiles."""
        vc = self.hf_config(config_dict).vision_config
        h, w = _pair(vc.image_size)
        per_image = self.max_tiles(_processor_max_patches(processor_dir))
        return VisionAxis(max_rows=per_image, opt_rows=per_image, trailing={"pixel_values": (vc.num_channels, h, w)})

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "InternVLProcessorAdapter":
        return InternVLProcessorAdapter(self, Path(processor_dir))


def _processor_max_patches(processor_dir: Path) -> int:
    """The engine's max_patches from its saved image-processor settings (GotOcr2's default otherwise)."""
    import json

    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        p = Path(processor_dir) / name
        if p.exists():
            cfg = json.loads(p.read_text())
            cfg = cfg.get(key, {}) if key else cfg
            if isinstance(cfg, dict) and "max_patches" in cfg:
                return int(cfg["max_patches"])
    return DEFAULT_MAX_PATCHES


class InternVLProcessorAdapter(FamilyProcessor):
    """Chat template + GotOcr2 image processor, expanding `<IMG_CONTEXT>` as InternVLProcessor does:
    `<img>` + `<IMG_CONTEXT>` x (image_seq_length x tiles) + `</img>`, then tokenizing the result."""

    def __init__(self, family: InternVLFamily, processor_dir: Path):
        super().__init__(family, processor_dir)
        self.image_token_id = self.config_token_id("image_token_id")
        tokens = {attr: getattr(self.tokenizer, attr, None) or default for attr, default in _SPECIAL.items()}
        for attr, tok in tokens.items():
            self.require_token(tok, f" ({attr})")
        self.placeholder = tokens["context_image_token"]
        self.start_token = tokens["start_image_token"]
        self.end_token = tokens["end_image_token"]
        if self.tokenizer.convert_tokens_to_ids(self.placeholder) != self.image_token_id:
            raise CheckpointError(f"{processor_dir}: the tokenizer's {self.placeholder!r} is not config.json's "
                                  f"image_token_id {self.image_token_id}")
        self.rows_per_tile = family.rows_per_crop(self.config)
        proc_cfg = self.processor_dir / "processor_config.json"
        seq = read_json(proc_cfg).get("image_seq_length") if proc_cfg.exists() else None
        if seq is not None and int(seq) != self.rows_per_tile:
            raise CheckpointError(f"{proc_cfg}: image_seq_length {seq} disagrees with the vision config "
                                  f"({self.rows_per_tile} rows per tile)")
        self.image_kwargs = dict(PROCESSOR_IMAGE_KWARGS)

    def num_tiles(self, width: int, height: int) -> int:
        return int(self.image_processor.get_number_of_image_patches(height, width, self.image_kwargs))

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        return self.num_tiles(*size) * self.rows_per_tile

    def preprocess(self, image) -> np.ndarray:
        """One image -> pixel_values [tiles, 3, H, W] (grid tiles row-major, then the thumbnail)."""
        out = self.image_processor(images=[image], return_tensors="np", **self.image_kwargs)
        pv = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if int(np.asarray(out["num_patches"]).reshape(-1)[0]) != pv.shape[0]:
            raise InputError("the image processor returned an inconsistent number of tiles")
        return pv

    def image_item(self, image, content_hash: str) -> ImageItem:
        pv = self.preprocess(image)
        return ImageItem(inputs={"pixel_values": pv}, num_tokens=pv.shape[0] * self.rows_per_tile,
                         meta={"tiles": pv.shape[0]}, content_hash=content_hash)

    def image_text(self, item: ImageItem) -> str:
        return self.start_token + self.placeholder * item.num_tokens + self.end_token
