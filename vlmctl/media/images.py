"""Images as the vision towers take them: RGB, with transparency composited the way transformers' image
processors composite it (shared by the runtime's decoding and AWQ's image calibration)."""

from __future__ import annotations


def flatten_to_rgb(image):
    """An RGB image as transformers' image processors make one (`image_transforms.convert_to_rgb`): transparency
    (an alpha band, or a palette / tRNS transparent colour) composited onto white. `convert("RGB")` alone would
    drop the alpha band and show the model what the transparent pixels hide."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
