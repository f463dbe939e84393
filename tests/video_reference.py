"""The reference side of the video tests: transformers' video preprocessing, assembled without torchvision.

transformers' video processors (Qwen2VLVideoProcessor, LlavaOnevisionVideoProcessor) import
torchvision, which cannot be installed beside the CPU torch used here. So the reference inputs are
built like the image references of tests/test_qwen2_vl.py: transformers' own pieces wherever they
import (its PyAV reader `video_utils.read_video_pyav`, `default_sample_indices_fn`, `VideoMetadata`,
the Qwen2-VL image processor for normalization and the spatial patch layout, the OneVision
processor's `replace_video_token`, the models themselves), and only the glue those processors add
reimplemented here, each piece from the transformers / torchvision source it stands for:
- torchvision's `resize` of a uint8 CPU tensor in bicubic mode (`resize_image`: native uint8
  `interpolate` with antialiasing);
- the video processors' fused rescale + normalize (`_fuse_mean_std_and_rescale_factor`);
- `Qwen2VLVideoProcessor.sample_frames` (fps within min/max frames, whole temporal patches), its
  `resize`'s `cap_pixels_per_frame` bound, and the temporal half of its `patchify` (two consecutive
  frames per temporal patch, the last repeated).
Nothing here imports vlmctl.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def read_video(path: Path, sample_indices_fn):
    """transformers' PyAV reader: (frames [n, H, W, 3] uint8, VideoMetadata with frames_indices)."""
    from transformers.video_utils import read_video_pyav

    return read_video_pyav(str(path), sample_indices_fn=sample_indices_fn)


def tv_resize(frames: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """torchvision `resize(uint8 tensor, size, BICUBIC, antialias=True)` on a CPU -> [n, 3, h, w] uint8."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return torch.nn.functional.interpolate(x, size=list(size), mode="bicubic", align_corners=False, antialias=True)


def fused_normalize(x: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD, rescale: float = 1 / 255) -> torch.Tensor:
    m, s = torch.tensor(mean) * (1.0 / rescale), torch.tensor(std) * (1.0 / rescale)
    return (x.to(torch.float32) - m[:, None, None]) / s[:, None, None]


def qwen_sample_fn(fps: float, min_frames: int = 4, max_frames: int = 768, temporal: int = 2):
    """Qwen2VLVideoProcessor.sample_frames with `fps` (metadata from the reader)."""
    def fn(metadata, **kwargs):
        total = metadata.total_num_frames
        mx = math.floor(min(max_frames, total) / temporal) * temporal
        n = total / metadata.fps * fps
        n = min(max(n, min_frames), mx, total)
        n = math.floor(n / temporal) * temporal
        return torch.arange(0, total, total / n).int()
    return fn


def qwen_video_inputs(ckpt: Path, path: Path, *, fps: float = 2.0, min_pixels: int, max_pixels: int,
                      min_frames: int = 4, max_frames: int = 768, cap_video_tokens: int | None = None) -> dict:
    """pixel_values_videos, video_grid_thw and second_per_grid_ts of one video, as Qwen2VLProcessor
    (Qwen2.5-VL's for second_per_grid_ts) would give them for `path` sampled at `fps`."""
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = AutoImageProcessor.from_pretrained(ckpt)
    T, p, m = ip.temporal_patch_size, ip.patch_size, ip.merge_size
    frames, meta = read_video(path, qwen_sample_fn(fps, min_frames, max_frames, T))
    if cap_video_tokens is not None:  # cap_pixels_per_frame: an even share of 90% of the token budget's pixels
        budget = int(cap_video_tokens * (p * m) ** 2 * 0.9)
        max_pixels = max(min(max_pixels, budget * T // len(frames)), int(min_pixels * 1.05))
    h, w = smart_resize(frames.shape[1], frames.shape[2], p * m, min_pixels, max_pixels)
    resized = tv_resize(frames, (h, w)).permute(0, 2, 3, 1).numpy()  # back to HWC for the image processor
    # The image processor (do_resize=False) normalizes each frame and lays out its patches; its temporal
    # axis repeats the frame, and a video's temporal patch holds two consecutive frames instead.
    per_frame = [ip(images=[f], do_resize=False, return_tensors="np")["pixel_values"] for f in resized]
    if len(per_frame) % T:
        per_frame += [per_frame[-1]] * (T - len(per_frame) % T)
    c = 3
    rows = []
    for k in range(0, len(per_frame), T):
        group = [f.reshape(f.shape[0], c, T, p, p)[:, :, 0] for f in per_frame[k:k + T]]
        rows.append(np.stack(group, 2).reshape(group[0].shape[0], c * T * p * p))
    grid = [len(per_frame) // T, h // p, w // p]
    return {"pixel_values_videos": torch.from_numpy(np.concatenate(rows)), "video_grid_thw": torch.tensor([grid]),
            "second_per_grid_ts": torch.tensor([T / meta.sampled_fps]), "frames": meta.frames_indices}


def onevision_video_inputs(path: Path, size: int, num_frames: int) -> dict:
    """pixel_values_videos [1, frames, 3, size, size] as LlavaOnevisionVideoProcessor gives them."""
    from transformers.video_utils import default_sample_indices_fn

    frames, meta = read_video(path, lambda metadata, **kw: default_sample_indices_fn(metadata, num_frames=num_frames))
    pv = fused_normalize(tv_resize(frames, (size, size)))
    return {"pixel_values_videos": pv[None], "frames": list(meta.frames_indices)}
