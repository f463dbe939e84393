"""Size limits an image must meet before any family preprocesses it.

Preprocessing cost follows the image's shape, not its byte size: a family that resizes the short
side to the vision tower's input (CLIP's 224 or 336) turns a 6000x1 PNG of ~100 bytes into a
1,344,000x224 float image (gigabytes), and stalls every other prompt on the encode worker while it
does. So width, height and aspect ratio are checked on the decoded image's size, before
`FamilyProcessor.encode`. The aspect-ratio default is Qwen2-VL's own (its resize refuses ratios
above 200). This module checks sizes only; decoding and the decompression-bomb guard are the
loaders' (`runtime.engine.load_image`, `serve.media`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import LimitError

DEFAULT_MAX_SIDE = 16384
DEFAULT_MAX_ASPECT_RATIO = 200.0


@dataclass(frozen=True)
class ImageLimits:
    max_side: int = DEFAULT_MAX_SIDE
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO

    @classmethod
    def with_overrides(cls, *, max_side: int | None = None, max_aspect_ratio: float | None = None) -> "ImageLimits":
        """The defaults with the options a user gave (None keeps a default)."""
        lim = cls()
        if max_side is not None:
            lim = replace(lim, max_side=int(max_side))
        if max_aspect_ratio is not None:
            lim = replace(lim, max_aspect_ratio=float(max_aspect_ratio))
        return lim.validate()

    def validate(self) -> "ImageLimits":
        if self.max_side < 1:
            raise LimitError(f"max image side must be at least 1 (got {self.max_side})")
        if not self.max_aspect_ratio >= 1:
            raise LimitError(f"max image aspect ratio must be at least 1 (got {self.max_aspect_ratio})")
        return self

    def check(self, size: tuple[int, int], what: str = "image") -> None:
        """Raise LimitError when a (width, height) image is beyond the limits."""
        w, h = int(size[0]), int(size[1])
        if w < 1 or h < 1:
            raise LimitError(f"{what}: {w}x{h} pixels is empty")
        if max(w, h) > self.max_side:
            raise LimitError(f"{what}: {w}x{h} pixels; the longest side accepted is {self.max_side}")
        ratio = max(w, h) / min(w, h)
        if ratio > self.max_aspect_ratio:
            raise LimitError(f"{what}: {w}x{h} pixels has aspect ratio {ratio:.0f}:1; at most "
                             f"{self.max_aspect_ratio:g}:1 is accepted")
