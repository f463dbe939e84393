"""Video preprocessing shared by the families that take videos (Qwen2-VL / Qwen2.5-VL, LLaVA-OneVision).

transformers' video processors (`BaseVideoProcessor` and its subclasses) run on torchvision, which
cannot be installed beside the CPU torch used here, so the steps they take are done here with torch
alone, the way torchvision does them on a CPU:
- the settings come from where `AutoVideoProcessor` reads them: a `video_processor` entry of
  processor_config.json, else video_preprocessor_config.json, else preprocessor_config.json (the
  image processor's file, which hub checkpoints without a video file rely on);
- resizing is `torch.nn.functional.interpolate` on the uint8 frame with antialiasing, which is
  what torchvision's `resize` runs for uint8 bicubic (and, on AVX2 CPUs, bilinear) input;
- rescale and normalize are fused as transformers fuses them (mean and std scaled by
  1 / rescale_factor, then one subtract and one divide in float32);
- `uniform_indices` is transformers' `default_sample_indices_fn`, clamped to the frames a video has.
What each family samples and how its frames become vision inputs stays in its own module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .base import read_json

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# PILImageResampling values the checkpoints write -> torch's interpolate modes (transformers' mapping).
RESAMPLE_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


def video_processor_config(processor_dir: Path) -> dict:
    """The video processor's settings, found where transformers' AutoVideoProcessor finds them."""
    processor_dir = Path(processor_dir)
    nested = processor_dir / "processor_config.json"
    if nested.exists():
        try:
            cfg = json.loads(nested.read_text()).get("video_processor")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{nested}: unreadable ({type(e).__name__})") from None
        if isinstance(cfg, dict):
            return cfg
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (processor_dir / name).exists():
            return read_json(processor_dir / name)
    return {}


class FrameTransform:
    """Resize + rescale + normalize of video frames, with one video processor's settings."""

    def __init__(self, cfg: dict, default_resample: int = 3):
        resample = int(cfg.get("resample", default_resample))
        if resample not in RESAMPLE_MODES:
            raise CheckpointError(f"video processor resample={resample} is not supported "
                                  f"(supported: {sorted(RESAMPLE_MODES)})")
        self.mode = RESAMPLE_MODES[resample]
        self.do_resize = bool(cfg.get("do_resize", True))
        self.do_rescale = bool(cfg.get("do_rescale", True))
        self.do_normalize = bool(cfg.get("do_normalize", True))
        self.rescale_factor = float(cfg.get("rescale_factor", 1 / 255))
        self.mean = list(cfg.get("image_mean") or OPENAI_CLIP_MEAN)
        self.std = list(cfg.get("image_std") or OPENAI_CLIP_STD)

    def resize(self, frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """One RGB uint8 frame [H, W, 3] -> [3, h, w] uint8 at `size` (h, w)."""
        import torch

        x = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None]
        if self.do_resize and tuple(x.shape[-2:]) != tuple(size):
            antialias = self.mode in ("bilinear", "bicubic")
            x = torch.nn.functional.interpolate(x, size=list(size), mode=self.mode, antialias=antialias,
                                                align_corners=False if antialias else None)
        return x[0].numpy()

    def normalize(self, frames: np.ndarray) -> np.ndarray:
        """[n, 3, h, w] uint8 -> float32, rescaled and normalized as transformers fuses the two."""
        import torch

        x = torch.from_numpy(frames)
        if self.do_normalize:
            mean, std = torch.tensor(self.mean), torch.tensor(self.std)
            if self.do_rescale:
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            x = (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
        elif self.do_rescale:
            x = x * self.rescale_factor
        return x.to(torch.float32).numpy()


def uniform_indices(total: int, num_frames: int | None) -> np.ndarray:
    """`num_frames` frames spread evenly over `total` (all of them when fewer or None)."""
    if num_frames is None or num_frames >= total:
        return np.arange(total, dtype=np.int64)
    return np.arange(num_frames, dtype=np.int64) * total // num_frames
