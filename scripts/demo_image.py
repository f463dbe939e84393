"""Draw the demo's test image (a red disc and a yellow square on a blue sky over green grass)."""

import sys

from PIL import Image, ImageDraw


def main(path: str) -> None:
    img = Image.new("RGB", (320, 240), (70, 130, 220))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 170, 320, 240], fill=(40, 160, 60))
    d.ellipse([40, 40, 120, 120], fill=(220, 30, 30))
    d.rectangle([190, 110, 270, 190], fill=(240, 220, 40))
    img.save(path)


if __name__ == "__main__":
    main(sys.argv[1])
