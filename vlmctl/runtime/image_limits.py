"""Size limits an image must meet before any family preprocesses it.

Preprocessing cost follows the image's shape, not its byte size: a family that resizes the short
side to the vision tower's input (CLIP's 224 or 336) turns a 6000x1 PNG of ~100 bytes into a
1,344,000x224 float image (gigabytes), and stalls every other prompt on the encode worker while it
does. So width, height, pixel count and aspect ratio are checked before `FamilyProcessor.encode`,
and the server checks them on the image header too, before a pixel is decoded (`serve.media`): a
16384x10900 all-zero PNG is ~170 KB on the wire but ~180 Mpx decoded (over 1 GB of memory), under
both the side limit and Pillow's own bomb error (which only warns below 2x its `MAX_IMAGE_PIXELS`).
The aspect-ratio default is Qwen2-VL's own (its resize refuses ratios above 200). `decode_image` is
the one decoder of untrusted image files (`runtime.engine.load_image`, `serve.media`): the limits on
the header, then the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import InputError, LimitError
from ..media.images import flatten_to_rgb

DEFAULT_MAX_SIDE = 16384
DEFAULT_MAX_ASPECT_RATIO = 200.0
# 8192x8192 = 67,108,864 pixels (64 Mi). Real inputs stay well below it: phone photos are 12-50 Mpx,
# and the largest dynamic-resolution families take ~12-16 Mpx before they resize. It is also below
# Pillow's MAX_IMAGE_PIXELS (89.5 Mpx), above which Pillow only warns up to 2x that.
DEFAULT_MAX_PIXELS = 8192 * 8192


@dataclass(frozen=True)
class ImageLimits:
    max_side: int = DEFAULT_MAX_SIDE
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    max_pixels: int = DEFAULT_MAX_PIXELS  # width x height

    @classmethod
    def with_overrides(cls, *, max_side: int | None = None, max_aspect_ratio: float | None = None,
                       max_pixels: int | None = None) -> "ImageLimits":
        """The defaults with the options a user gave (None keeps a default)."""
        lim = cls()
        if max_side is not None:
            lim = replace(lim, max_side=int(max_side))
        if max_aspect_ratio is not None:
            lim = replace(lim, max_aspect_ratio=float(max_aspect_ratio))
        if max_pixels is not None:
            lim = replace(lim, max_pixels=int(max_pixels))
        return lim.validate()

    def validate(self) -> "ImageLimits":
        if self.max_side < 1:
            raise LimitError(f"max image side must be at least 1 (got {self.max_side})")
        if not self.max_aspect_ratio >= 1:
            raise LimitError(f"max image aspect ratio must be at least 1 (got {self.max_aspect_ratio})")
        if self.max_pixels < 1:
            raise LimitError(f"max image pixels must be at least 1 (got {self.max_pixels})")
        return self

    def check(self, size: tuple[int, int], what: str = "image") -> None:
        """Raise LimitError when a (width, height) image is beyond the limits."""
        w, h = int(size[0]), int(size[1])
        if w < 1 or h < 1:
            raise LimitError(f"{what}: {w}x{h} pixels is empty")
        if max(w, h) > self.max_side:
            raise LimitError(f"{what}: {w}x{h} pixels; the longest side accepted is {self.max_side}")
        if w * h > self.max_pixels:
            raise LimitError(f"{what}: {w}x{h} is {w * h:,} pixels; at most {self.max_pixels:,} pixels are accepted")
        ratio = max(w, h) / min(w, h)
        if ratio > self.max_aspect_ratio:
            raise LimitError(f"{what}: {w}x{h} pixels has aspect ratio {ratio:.0f}:1; at most "
                             f"{self.max_aspect_ratio:g}:1 is accepted")


def decode_image(fp, what: str, limits: ImageLimits | None = None, unreadable: str = "not a readable image"):
    """A file path or binary file object -> RGB PIL image. `limits` (default: ImageLimits()) are checked
    on the header's size before any pixel is decoded, and again after, should a format's frame outgrow
    what its header said; undecodable data, and Pillow's decompression-bomb refusal, are InputErrors."""
    from PIL import Image, UnidentifiedImageError

    limits = limits or ImageLimits()
    try:
        img = Image.open(fp)  # lazy: reads the header only
        limits.check(img.size, what)
        img.load()
        limits.check(img.size, what)
        return flatten_to_rgb(img)
    # Pillow raises the error above 2x its MAX_IMAGE_PIXELS and only warns above 1x; the warning is an
    # exception only where warnings are errors. Either way `limits` decided first for what reached load().
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InputError(f"{what}: image is too large ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise InputError(f"{what}: {unreadable} ({type(e).__name__})") from None
