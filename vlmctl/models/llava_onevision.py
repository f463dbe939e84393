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

Videos (`<video>`), as transformers' LlavaOnevisionVideoProcessor and `get_video_features` make them:
frames sampled evenly (the video processor's `num_frames` or `fps` where its config names one, else
32 frames, LLaVA-OneVision's own video setting), each resized to the crop size (bicubic, no aspect
kept) and run through the same per-crop graph as image crops; on the host each frame's grid x grid
feature map is pooled bilinearly to ceil(grid/2) x ceil(grid/2), the frames' rows follow one another
and one `image_newline` row ends the video: frames * ceil(grid/2)**2 + 1 rows (32 frames of the 7B
checkpoint: 32 * 196 + 1). Images beside a video keep their anyres form (only images count as
"multi-image").
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from ..errors import CheckpointError, InputError, LimitError
from .base import ImageItem, TritonStock, read_json
from .llava_anyres import NEWLINE, AnyresLlavaFamily, AnyresProcessorAdapter, read_vision_tensor
from .video import FrameTransform, uniform_indices, video_processor_config

VIDEO_DEFAULT_FRAMES = 32
VIDEO_DEFAULT_SIZE = {"height": 384, "width": 384}  # LlavaOnevisionVideoProcessor's class default


class LlavaOnevisionFamily(AnyresLlavaFamily):
    name = "llava_onevision"
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    config_class = "LlavaOnevisionConfig"
    model_class = "LlavaOnevisionForConditionalGeneration"
    multi_image = True
    video = True
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

    def load_processor(self, processor_dir):
        return OnevisionProcessorAdapter(self, processor_dir)

    def hf_video_features(self, model, inputs: dict):
        """transformers' own rows of each video ([videos, frames * pooled + 1, hidden]) for
        `pixel_values_videos` [videos, frames, 3, S, S]."""
        cfg = model.config
        out = model.model.get_video_features(pixel_values_videos=inputs["pixel_values_videos"],
                                             vision_feature_layer=cfg.vision_feature_layer,
                                             vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return out.pooler_output


class OnevisionProcessorAdapter(AnyresProcessorAdapter):
    def __init__(self, family, processor_dir):
        super().__init__(family, processor_dir)
        config = read_json(processor_dir / "config.json")
        self.video_token_id = int(config.get("video_token_index", config.get("video_token_id", -1)))
        vcfg = video_processor_config(processor_dir)
        size = dict(vcfg.get("size") or VIDEO_DEFAULT_SIZE)
        if (size.get("height"), size.get("width")) != (self.geometry.crop, self.geometry.crop):
            raise CheckpointError(f"{processor_dir}: the video processor's size {size} is not the vision tower's "
                                  f"{self.geometry.crop}x{self.geometry.crop} input")
        if vcfg.get("num_frames") is not None and vcfg.get("fps") is not None:
            raise CheckpointError(f"{processor_dir}: the video processor sets both num_frames and fps")
        self.video_fps = vcfg.get("fps")
        self.video_frames = vcfg.get("num_frames") or (None if self.video_fps else VIDEO_DEFAULT_FRAMES)
        self.frames = FrameTransform(vcfg)
        self.pooled = math.ceil(self.geometry.grid / 2)

    # ---- videos ----------------------------------------------------------------------------
    def video_items(self, text: str, videos: list, limits) -> tuple[int, list[ImageItem]]:
        from ..media.video import VideoLimits

        if self.video_token_id < 0:
            raise InputError("this llava_onevision checkpoint has no video token, so it takes no videos")
        token = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
        n = text.count(token)
        if n != len(videos):
            raise InputError(f"the prompt has {n} video placeholder(s) but {len(videos)} video(s) were given")
        limits = limits or VideoLimits()
        budget, items = limits.max_pixels, []
        for video in videos:
            item = self.video_item(video, limits, budget)
            budget -= len(item.meta["frames"]) * self.geometry.crop ** 2
            items.append(item)
        return self.video_token_id, items

    def frame_indices(self, total: int, fps: float | None, cap: int, what: str) -> np.ndarray:
        """transformers' `default_sample_indices_fn` (num_frames, or fps seconds' worth), at most `cap`
        frames and never more than the video has (where transformers would refuse)."""
        num = self.video_frames
        if num is None:
            if not fps:
                raise InputError(f"{what}: the container gives no frame rate, which sampling at {self.video_fps:g} "
                                 "frames a second needs")
            num = max(1, int(total / fps * self.video_fps))
        return uniform_indices(total, min(num, cap))

    def video_item(self, video, limits, pixel_budget: int) -> ImageItem:
        S = self.geometry.crop

        def transform(n: int):
            if n * S * S > pixel_budget:
                raise LimitError(f"{video.what}: {n} frames of {S}x{S} pixels after resizing; a request's videos may "
                                 f"take at most {limits.max_pixels} pixels")
            return lambda frame: self.frames.resize(frame, (S, S))

        sampled = video.sample(lambda total, fps: self.frame_indices(total, fps, limits.max_frames, video.what),
                               limits, transform)
        pixels = self.frames.normalize(sampled.frames)  # [n, 3, S, S]
        n = pixels.shape[0]
        # Parts: at most one anyres image's crops per vision call; the last part carries the newline row.
        step = max(1, 1 + max((ph // S) * (pw // S) for ph, pw in self.geometry.pinpoints))
        parts = [ImageItem(inputs={"pixel_values": np.ascontiguousarray(pixels[k:k + step])},
                           num_tokens=min(step, n - k) * self.pooled ** 2 + (1 if k + step >= n else 0),
                           meta={"video_frames": True, "newline": k + step >= n})
                 for k in range(0, n, step)]
        frames = sampled.indices.tolist()
        h = hashlib.sha256(f"{video.content_hash}:{frames}:{S}".encode()).hexdigest()
        return ImageItem(inputs={}, num_tokens=n * self.pooled ** 2 + 1,
                         meta={"video": True, "frames": frames, "parts": parts}, content_hash=f"video:{h}")

    def postprocess_features(self, features, item: ImageItem):
        if not item.meta.get("video_frames"):
            return super().postprocess_features(features, item)
        # transformers' apply_pooling: each frame's map bilinearly to ceil(grid / 2) on a side
        torch = self.torch
        feats = features if isinstance(features, torch.Tensor) else \
            torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        g, hidden = self.geometry.grid, feats.shape[-1]
        fmap = feats.reshape(-1, g, g, hidden).permute(0, 3, 1, 2)
        fmap = torch.nn.functional.interpolate(fmap, size=[self.pooled, self.pooled], mode="bilinear")
        rows = fmap.permute(0, 2, 3, 1).reshape(-1, hidden)
        if item.meta.get("newline"):
            rows = torch.cat((rows, self.newline.to(rows.device, rows.dtype)[None]), dim=0)
        return rows

    def image_items(self, images: list, hashes: list[str]) -> list[ImageItem]:
        if not images:  # text only, or videos only
            return []
        if len(images) == 1:
            return [self.anyres_item(images[0], hashes[0])]
        # One sample with several images: the image processor pads each to a square single crop
        # (nested list = one sample, as the processor's chat-template path passes them).
        out = self.image_processor(images=[list(images)], return_tensors="np")
        items = []
        for i, h in enumerate(hashes):
            crop = np.ascontiguousarray(out["pixel_values"][i][:1], dtype=np.float32)
            # Same pixels, different features than the anyres form: a distinct cache key.
            items.append(ImageItem(inputs={"pixel_values": crop}, num_tokens=self.geometry.rows_per_crop + 1,
                                   meta={"single_crop": True}, content_hash=f"{h}:single-crop"))
        return items
