"""Shared pieces of the "anyres" LLaVA families (LLaVA-NeXT, LLaVA-OneVision).

An anyres image becomes a base crop (the whole image resized) plus a grid of crops of a
resolution picked from `image_grid_pinpoints`. The vision graph (tower + projector, the LLaVA-1.5
wrapper) runs once per crop: its batch axis is crops, so images of any size share one vision call.
Everything after that happens on the host, in `postprocess_features`, exactly as transformers'
`pack_image_features` does it: the grid crops are stitched into one feature map, the padding the
image processor added is cut away (`unpad`), each row of the map gets the learned `image_newline`
vector appended, and the base crop's rows come first. OneVision additionally shrinks large maps
bilinearly (`anyres_max_N`) and treats images of multi-image prompts as a single padded crop; those
differences are hooks the OneVision module overrides.

The number of prompt rows of an image follows from its size alone (`AnyresGeometry.num_tokens`,
computed the way the HF processors count placeholders), so the prompt is expanded before any
vision work. `image_newline` is a vision-part tensor (convert writes it to vision/); the
processor adapter reads it from there for the host-side packing.

Not here: the vision graph itself (llava.LlavaVisionWrapper), decoder weights (decoders.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import CheckpointError, UnsupportedModelError
from .base import VISION, FamilyProcessor, ImageItem, VisionAxis, read_json
from .llava import LlavaFamily, LlavaVisionWrapper

NEWLINE = "image_newline"
# Rows a vision tower adds to the patch rows of a crop (CLIP's class embedding; SigLIP has none).
CLS_ROWS = {"clip_vision_model": 1, "siglip_vision_model": 0}


def select_best_resolution(original_size, possible_resolutions) -> tuple[int, int]:
    """(height, width) of the pinpoint that keeps most of the image and wastes least (transformers' rule)."""
    original_height, original_width = original_size
    best_fit = None
    max_effective_resolution = 0
    min_wasted_resolution = float("inf")
    for height, width in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution
        if effective_resolution > max_effective_resolution or (
                effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution):
            max_effective_resolution = effective_resolution
            min_wasted_resolution = wasted_resolution
            best_fit = (height, width)
    return best_fit


def unpadded_extent(original_size, current_size) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1) of a (current_h, current_w) feature map that the image covers.

    The image processor scaled the image into the pinpoint and centred it with padding; this
    is transformers' `unpad_image`, returned as slice bounds so it serves counting and slicing.
    """
    original_height, original_width = original_size
    current_height, current_width = current_size
    original_aspect_ratio = original_width / original_height
    current_aspect_ratio = current_width / current_height
    if original_aspect_ratio > current_aspect_ratio:
        scale_factor = current_width / original_width
        new_height = int(round(original_height * scale_factor, 7))
        padding = (current_height - new_height) // 2
        return padding, current_height - padding, 0, current_width
    scale_factor = current_height / original_height
    new_width = int(round(original_width * scale_factor, 7))
    padding = (current_width - new_width) // 2
    return 0, current_height, padding, current_width - padding


@dataclass(frozen=True)
class AnyresGeometry:
    """Everything the prompt length and the host-side packing depend on, from the VLM config."""

    crop: int  # crop side in pixels (the vision tower's image_size)
    grid: int  # feature-map side of one crop (image_size // patch_size)
    rows_per_crop: int  # vision rows of one crop (grid**2 after the select strategy)
    pinpoints: tuple[tuple[int, int], ...]
    max_num_patches: int | None = None  # OneVision's anyres_max_N; None: no downscaling

    def grid_shape(self, image_size) -> tuple[int, int]:
        """(crop rows, crop columns) of the grid an image of (height, width) is cut into."""
        height, width = select_best_resolution(image_size, self.pinpoints)
        return height // self.crop, width // self.crop

    def reduced_shape(self, height: int, width: int) -> tuple[int, int] | None:
        """OneVision: the bilinear target of an unpadded (height, width) map, or None when kept."""
        if self.max_num_patches is None:
            return None
        ratio = math.sqrt(height * width / (self.max_num_patches * self.grid ** 2))
        if ratio > 1.1:
            return int(height // ratio), int(width // ratio)
        return None

    def _tokens_for_map(self, height: int, width: int) -> int:
        reduced = self.reduced_shape(height, width)
        if reduced is not None:
            height, width = reduced
        return self.rows_per_crop + height * width + height  # base crop, map, one newline per map row

    def num_tokens(self, image_size) -> int:
        """Prompt rows of one anyres image of (height, width) pixels."""
        gh, gw = self.grid_shape(image_size)
        r0, r1, c0, c1 = unpadded_extent(image_size, (gh * self.grid, gw * self.grid))
        return self._tokens_for_map(r1 - r0, c1 - c0)

    def max_tokens(self) -> int:
        """Upper bound over every image size: unpadding keeps one side of a pinpoint's map whole
        and shortens the other by an even amount, so enumerating those shapes covers all images."""
        best = self.rows_per_crop + 1  # the single-crop form (base + newline)
        for ph, pw in self.pinpoints:
            h, w = ph // self.crop * self.grid, pw // self.crop * self.grid
            shapes = [(h - 2 * k, w) for k in range(h // 2)] + [(h, w - 2 * k) for k in range(w // 2)]
            best = max([best] + [self._tokens_for_map(a, b) for a, b in shapes])
        return best


def read_vision_tensor(vision_dir: Path, name: str):
    """One tensor of the converted vision part (float32 torch tensor), without loading the rest."""
    import torch
    from safetensors import safe_open

    from ..checkpoint import weight_files

    vision_dir = Path(vision_dir)
    if not vision_dir.is_dir():
        raise CheckpointError(f"{vision_dir}: the converted vision part is missing (it holds {name!r})")
    for f in weight_files(vision_dir):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name).to(torch.float32)
    raise CheckpointError(f"{vision_dir}: no tensor {name!r} in the vision part (re-run `vlmctl convert`)")


class AnyresLlavaFamily(LlavaFamily):
    """LLaVA-1.5's conversion and vision wrapper, plus `image_newline` and anyres image handling."""

    config_class: ClassVar[str]
    model_class: ClassVar[str]
    multi_image = True
    # tensorrtllm_backend's stock models know no LLaVA-NeXT (its preprocessing refuses the model type).
    triton_stock = None
    graph_vision = False  # a variable number of crops per image; not measured under CUDA graphs

    def hf_config(self, config_dict: dict):
        import transformers

        return getattr(transformers, self.config_class).from_dict(config_dict)

    def hf_model_class(self):
        import transformers

        return getattr(transformers, self.model_class)

    # ---- tensor names ----------------------------------------------------------------------
    def canonical_key(self, key: str) -> str:
        if key == NEWLINE:  # hub checkpoints saved by transformers 4.x
            return "model." + NEWLINE
        return super().canonical_key(key)

    def split_key(self, key: str) -> tuple[str, str]:
        if key == "model." + NEWLINE:
            return VISION, NEWLINE
        return super().split_key(key)

    def join_key(self, part: str, name: str) -> str:
        if part == VISION and name == NEWLINE:
            return "model." + NEWLINE
        return super().join_key(part, name)

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        """Tower + projector per crop ([crops, 3, S, S] -> [crops, rows, hidden]); image_newline stays on the host."""
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(
            lambda: LlavaVisionWrapper.build(config, config.vision_feature_layer,
                                             config.vision_feature_select_strategy),
            vision_dir, skip=(NEWLINE,))
        wrapper.truncate_unused_layers()
        return wrapper.to(dtype).eval().requires_grad_(False)

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        return ["pixel_values"], ["image_features"], {"pixel_values": {0: "crops"}, "image_features": {0: "crops"}}

    def max_crops(self, config_dict: dict) -> int:
        """Most crops one image becomes: the base crop plus the largest pinpoint's grid."""
        g = self.geometry(config_dict)
        return 1 + max((ph // g.crop) * (pw // g.crop) for ph, pw in g.pinpoints)

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis:
        """The graph's batch axis counts crops: an image needs up to its most crops."""
        g = self.geometry(config_dict)
        per_image = self.max_crops(config_dict)
        return VisionAxis(max_rows=per_image, opt_rows=per_image, trailing={"pixel_values": (3, g.crop, g.crop)})

    def hf_image_features(self, model, inputs: dict[str, Any]):
        """transformers' own path. With `image_sizes` (and for OneVision `batch_num_images`):
        `get_image_features`, i.e. the packed rows of each image (a list). Without: the per-crop
        projector output ([crops, rows, hidden]), computed by the HF model's own tower and
        projector with its feature-layer and select-strategy settings, before packing."""
        import torch

        cfg = model.config
        pv = inputs["pixel_values"]
        if "image_sizes" in inputs:
            kw = {k: inputs[k] for k in ("batch_num_images",) if k in inputs}
            out = model.model.get_image_features(pixel_values=pv, image_sizes=inputs["image_sizes"],
                                                 vision_feature_layer=cfg.vision_feature_layer,
                                                 vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                                 **kw)
            return list(out.pooler_output)
        hs = model.model.vision_tower(pv, output_hidden_states=True, return_dict=True).hidden_states
        layers = [cfg.vision_feature_layer] if isinstance(cfg.vision_feature_layer, int) else cfg.vision_feature_layer
        feats = torch.cat([hs[i] for i in layers], dim=-1)
        if cfg.vision_feature_select_strategy == "default":
            feats = feats[:, 1:]
        return model.model.multi_modal_projector(feats)

    # ---- prompt ----------------------------------------------------------------------------
    def geometry(self, config_dict: dict) -> AnyresGeometry:
        cfg = self.hf_config(config_dict)
        vc = cfg.vision_config
        grid = vc.image_size // vc.patch_size
        if vc.model_type not in CLS_ROWS:
            raise UnsupportedModelError(f"{self.name}: vision tower {vc.model_type!r} is not supported "
                                        f"(supported: {', '.join(CLS_ROWS)})")
        rows = grid * grid + CLS_ROWS[vc.model_type] - (1 if cfg.vision_feature_select_strategy == "default" else 0)
        if rows != grid * grid:
            raise CheckpointError(f"{self.name}: vision_feature_select_strategy "
                                  f"{cfg.vision_feature_select_strategy!r} with a {vc.model_type} tower gives {rows} "
                                  f"rows per crop, which do not form the {grid}x{grid} map the anyres packing needs")
        pinpoints = tuple((int(h), int(w)) for h, w in cfg.image_grid_pinpoints)
        bad = [p for p in pinpoints if p[0] % vc.image_size or p[1] % vc.image_size]
        if bad:
            raise CheckpointError(f"{self.name}: image_grid_pinpoints {bad} are not multiples of the crop size "
                                  f"{vc.image_size}")
        return AnyresGeometry(crop=vc.image_size, grid=grid, rows_per_crop=rows, pinpoints=pinpoints,
                              max_num_patches=self._max_num_patches(cfg))

    def _max_num_patches(self, cfg) -> int | None:
        return None

    def rows_per_image(self, config_dict: dict) -> int:  # LLaVA-1.5's fixed count does not apply
        raise UnsupportedModelError("anyres families count rows per image size: see num_image_tokens")

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        return self.geometry(config_dict).max_tokens()

    def min_image_tokens(self, config_dict: dict) -> int:
        """Every image's rows begin with its base crop's, whatever its size (`AnyresGeometry._tokens_for_map`)."""
        return self.geometry(config_dict).rows_per_crop

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "AnyresProcessorAdapter":
        return AnyresProcessorAdapter(self, Path(processor_dir), vision_dir)


class AnyresProcessorAdapter(FamilyProcessor):
    """Chat template + the family's PIL image processor; expands `<image>` per image size."""

    def __init__(self, family: AnyresLlavaFamily, processor_dir: Path, vision_dir: Path | None):
        import torch

        super().__init__(family, processor_dir)
        self.image_token_id = self.config_token_id("image_token_index", "image_token_id")
        self.placeholder = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.geometry = family.geometry(self.config)
        ip_pinpoints = tuple(tuple(int(v) for v in p)
                             for p in getattr(self.image_processor, "image_grid_pinpoints", None) or ())
        if ip_pinpoints != self.geometry.pinpoints:
            raise CheckpointError(f"{processor_dir}: the image processor's image_grid_pinpoints {list(ip_pinpoints)} "
                                  f"differ from config.json's {list(self.geometry.pinpoints)}")
        crop = self._processor_crop()
        if crop != self.geometry.crop:
            raise CheckpointError(f"{processor_dir}: the image processor makes {crop}-pixel crops but the vision "
                                  f"tower takes {self.geometry.crop}")
        if vision_dir is None:
            raise CheckpointError(f"{family.name}: the processor needs the converted vision part (it holds {NEWLINE})")
        self.newline = read_vision_tensor(Path(vision_dir), NEWLINE)
        self.torch = torch

    def load_image_processor(self):
        from transformers import AutoImageProcessor

        # The PIL backend is transformers' reference implementation of these processors.
        return AutoImageProcessor.from_pretrained(str(self.processor_dir), backend="pil")

    def _processor_crop(self) -> int | None:
        ip = self.image_processor
        for d in (getattr(ip, "crop_size", None) if getattr(ip, "do_center_crop", False) else None,
                  getattr(ip, "size", None)):
            if d:
                d = dict(d) if not isinstance(d, dict) else d
                v = d.get("height") or d.get("shortest_edge")
                if v:
                    return int(v)
        return None

    # ---- the prompt --------------------------------------------------------------------------
    def image_text(self, item: ImageItem) -> str:
        return self.placeholder * item.num_tokens

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        width, height = size
        return self.geometry.num_tokens((height, width))

    def image_item(self, image, content_hash: str) -> ImageItem:
        """Base crop + grid crops of one image, as the image processor makes them."""
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="np")
        h, w = (int(v) for v in out["image_sizes"][0])
        gh, gw = self.geometry.grid_shape((h, w))
        crops = np.ascontiguousarray(out["pixel_values"][0][: gh * gw + 1], dtype=np.float32)
        if crops.shape[0] != gh * gw + 1:
            raise CheckpointError(f"the image processor made {crops.shape[0]} crops for a {gh}x{gw} grid")
        return ImageItem(inputs={"pixel_values": crops}, num_tokens=self.geometry.num_tokens((h, w)),
                         meta={"image_size": (h, w), "grid": (gh, gw)}, content_hash=content_hash)

    # ---- host-side packing (transformers' pack_image_features) -----------------------------
    def postprocess_features(self, features, item: ImageItem):
        torch = self.torch
        feats = features if isinstance(features, torch.Tensor) else \
            torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        newline = self.newline.to(feats.device, feats.dtype)
        if feats.shape[0] == 1:  # a single crop (OneVision's multi-image form): its rows + one newline
            return torch.cat((feats[0], newline[None]), dim=0)
        g = self.geometry.grid
        gh, gw = item.meta["grid"]
        fmap = feats[1:].view(gh, gw, g, g, -1).permute(4, 0, 2, 1, 3).contiguous()
        fmap = fmap.flatten(1, 2).flatten(2, 3)  # [hidden, gh*g, gw*g]
        r0, r1, c0, c1 = unpadded_extent(item.meta["image_size"], tuple(fmap.shape[1:]))
        fmap = fmap[:, r0:r1, c0:c1]
        fmap = self.reduce_map(fmap)
        fmap = torch.cat((fmap, newline[:, None, None].expand(*fmap.shape[:-1], 1)), dim=-1)
        fmap = fmap.flatten(1, 2).transpose(0, 1)
        return torch.cat((feats[0], fmap), dim=0)

    def reduce_map(self, fmap):
        """OneVision's anyres_max downscaling; identity for LLaVA-NeXT."""
        target = self.geometry.reduced_shape(*fmap.shape[1:])
        if target is None:
            return fmap
        return self.torch.nn.functional.interpolate(fmap[None], list(target), mode="bilinear")[0]
