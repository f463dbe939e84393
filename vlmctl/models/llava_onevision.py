"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): SigLIP tower -> MLP projector -> Qwen2 decoder.

Images go through the anyres path shared with LLaVA-NeXT (llava_anyres.py) with OneVision's two
differences, both as transformers implements them:
- `vision_aspect_ratio: anyres_max_N`: when the unpadded feature map of the grid crops holds more
  than about N crops' worth of rows (ratio sqrt(h*w / (N*grid**2)) above 1.1) it is bilinearly
  resized to (int(h // ratio), int(w // ratio)) before the newline column is added.
- In a prompt with more than one image (counting every turn), each image is padded to a square
  with the mean colour and becomes a single crop: grid**2 rows plus one `image_newline`. Only a
  prompt's single image gets the anyres grid.
So an image's prompt length is grid**2 + h'*w' + h' alone (h' x w': unpadded, possibly reduced map)
and grid**2 + 1 beside others; the 7B checkpoint (27x27 patches, anyres_max_9) gives at most
729 + 7938 + 162 rows for one image.
Videos (`<video>`) are not supported.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from .base import ImageItem, TritonStock
from .llava_anyres import NEWLINE, AnyresLlavaFamily, AnyresProcessorAdapter, read_vision_tensor


class LlavaOnevisionFamily(AnyresLlavaFamily):
    name = "llava_onevision"
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    config_class = "LlavaOnevisionConfig"
    model_class = "LlavaOnevisionForConditionalGeneration"
    multi_image = True
    # The stock preprocessing runs the checkpoint's own processor on raw images (one per request)
    # and the stock encoder model packs the per-crop rows (unpad, anyres_max, image_newline) itself.
    triton_stock = TritonStock("llava_onevision", client_pixels=False, max_images=1)

    def triton_vision_files(self, vision_dir, dest) -> list[str]:
        """`image_newlines.safetensors` ({"image_newline": [hidden]} in float16), which the stock
        encoder model loads beside the engine for the packing vlmctl does on the host."""
        import torch
        from safetensors.torch import save_file

        newline = read_vision_tensor(vision_dir, NEWLINE).to(torch.float16).contiguous()
        save_file({NEWLINE: newline}, str(dest / "image_newlines.safetensors"))
        return ["image_newlines.safetensors"]

    def _max_num_patches(self, cfg) -> int | None:
        aspect = str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9"))
        digits = aspect.strip("anyres_max_")  # transformers parses it this way
        if not aspect.startswith("anyres_max_") or not digits.isdigit():
            raise CheckpointError(f"{self.name}: vision_aspect_ratio {aspect!r} is not supported (only anyres_max_N)")
        return int(digits)

    def load_processor(self, processor_dir, vision_dir=None):
        return OnevisionProcessorAdapter(self, processor_dir, vision_dir)


class OnevisionProcessorAdapter(AnyresProcessorAdapter):
    def image_items(self, images: list, hashes: list[str]) -> list[ImageItem]:
        if len(images) == 1:
            return [self.image_item(images[0], hashes[0])]
        # One sample with several images: the image processor pads each to a square single crop
        # (nested list = one sample, as the processor's chat-template path passes them).
        out = self.image_processor(images=[[img.convert("RGB") for img in images]], return_tensors="np")
        items = []
        for i, h in enumerate(hashes):
            crop = np.ascontiguousarray(out["pixel_values"][i][:1], dtype=np.float32)
            # Same pixels, different features than the anyres form: a distinct cache key.
            items.append(ImageItem(inputs={"pixel_values": crop}, num_tokens=self.geometry.rows_per_crop + 1,
                                   meta={"single_crop": True}, content_hash=f"{h}:single-crop"))
        return items
