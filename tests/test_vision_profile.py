"""TensorRT optimization-profile shapes of the vision graph: the arithmetic in export/tensorrt.py over
a family's per-image `VisionAxis`, and, for the patch-axis family (Qwen2-VL), bounds checked against
what the checkpoint's own image processor makes of real images. The crop and tile families' profiles
are checked in their own test modules (llava_next, internvl, idefics3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vlmctl.export.tensorrt import profile_shapes, vision_profile
from vlmctl.models.base import VisionAxis


def test_profile_of_an_axis_batched_across_requests():
    axis = VisionAxis(max_rows=5, opt_rows=5, trailing={"pixel_values": (3, 28, 28)})
    prof = vision_profile(axis, max_batch_size=4, max_images_per_request=2)
    assert prof == {"pixel_values": ((1, 3, 28, 28), (5, 3, 28, 28), (40, 3, 28, 28))}  # 4 requests x 2 images x 5
    # a text-only engine (0 images per request) still builds a profile for one image per sequence
    assert vision_profile(axis, 3, 0)["pixel_values"][2] == (15, 3, 28, 28)


def test_profile_of_an_axis_of_one_request():
    axis = VisionAxis(max_rows=64, opt_rows=16, min_rows=4, across_requests=False,
                      trailing={"pixel_values": (48,), "vision_pos_ids": (2,), "attention_segments": ()})
    prof = vision_profile(axis, max_batch_size=8, max_images_per_request=3)  # the batch size does not count
    assert prof == {"pixel_values": ((4, 48), (16, 48), (192, 48)), "vision_pos_ids": ((4, 2), (16, 2), (192, 2)),
                    "attention_segments": ((4,), (16,), (192,))}
    # opt and min never pass max (a tiny max_rows)
    small = VisionAxis(max_rows=2, opt_rows=9, min_rows=4, across_requests=False, trailing={"x": (1,)})
    assert vision_profile(small, 1, 1) == {"x": ((2, 1), (2, 1), (2, 1))}


def test_profile_of_tiles_beside_per_image_inputs():
    """A tile axis (every image max_rows tiles) beside inputs with one row per image (Llama 3.2 Vision's
    aspect-ratio ids and masks): the same range, counted in images."""
    from vlmctl.errors import StageError

    axis = VisionAxis(max_rows=4, opt_rows=16, min_rows=4, per_image=("ratio_ids", "ratio_mask"),
                      trailing={"pixel_values": (3, 16, 16), "ratio_ids": (), "ratio_mask": (4,)})
    assert vision_profile(axis, max_batch_size=4, max_images_per_request=2) == {
        "pixel_values": ((4, 3, 16, 16), (16, 3, 16, 16), (32, 3, 16, 16)),
        "ratio_ids": ((1,), (4,), (8,)), "ratio_mask": ((1, 4), (4, 4), (8, 4))}
    # fewer images than the tuning point: opt is every image there is
    assert vision_profile(axis, 1, 2)["ratio_ids"] == ((1,), (2,), (2,))
    bad = VisionAxis(max_rows=4, opt_rows=6, min_rows=4, per_image=("ratio_ids",), trailing={"ratio_ids": ()})
    with pytest.raises(StageError, match="whole images"):
        vision_profile(bad, 4, 2)


def test_default_profile_is_a_batch_of_images():
    assert profile_shapes({"pixel_values": (-1, 3, 336, 336)}, 7) == {
        "pixel_values": ((1, 3, 336, 336), (4, 3, 336, 336), (7, 3, 336, 336))}
    from vlmctl.errors import StageError

    with pytest.raises(StageError, match="dynamic non-batch axis"):
        profile_shapes({"patches": (-1, -1)}, 4)


def test_families_whose_axis_is_a_batch_of_images_give_none(tiny_llava):
    from vlmctl.models.registry import get_family

    cfg = json.loads((tiny_llava / "config.json").read_text())
    assert get_family("llava").vision_axis(cfg, tiny_llava) is None


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen_patch_axis_covers_the_processors_largest_image(tmp_path, version):
    """Every image the checkpoint's image processor makes (any size, within its max_pixels) fits one
    image's range; a request's images fit the profile's maximum; rows come in whole merge units."""
    from transformers import AutoImageProcessor

    from tiny_models import make_image, make_qwen2_vl
    from vlmctl.models.registry import get_family

    ckpt = make_qwen2_vl(tmp_path / "ck", version=version, max_pixels=4096)
    cfg = json.loads((ckpt / "config.json").read_text())
    fam = get_family("qwen2_vl" if version == "2" else "qwen2_5_vl")
    axis = fam.vision_axis(cfg, ckpt)
    ip = AutoImageProcessor.from_pretrained(ckpt)
    merge = ip.merge_size
    patches = []
    for w, h in [(8, 8), (64, 64), (200, 30), (30, 200), (64, 65), (1000, 1000), (17, 333)]:
        out = ip(images=[make_image(1, (w, h))], return_tensors="np")
        patches.append(int(np.prod(out["image_grid_thw"][0])))
    assert max(patches) <= axis.max_rows and axis.max_rows % merge ** 2 == 0
    assert axis.min_rows == merge ** 2 and not axis.across_requests
    names = fam.onnx_io(cfg)[0]
    assert list(axis.trailing) == names
    prof = vision_profile(axis, max_batch_size=4, max_images_per_request=2)
    assert prof["pixel_values"][2][0] == 2 * axis.max_rows  # two images of one request
    assert prof["pixel_values"][0][1:] == (ip.temporal_patch_size * ip.patch_size ** 2 * 3,)


def test_qwen_profile_covers_the_largest_video_part(tmp_path):
    """A video's vision work runs in parts, each its own call (one temporal patch at least): where the
    video processor allows larger frames than the image processor, the profile's maximum is the
    largest part the processor makes, not the images' bound."""
    pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")
    from tiny_models import make_qwen2_vl
    from tiny_video import frames_of, make_video
    from vlmctl.media.video import VideoLimits, load_video
    from vlmctl.models.registry import get_family

    ckpt = make_qwen2_vl(tmp_path / "ck", version="2", max_pixels=1024)  # images: at most 64 patches
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 256, "max_pixels": 8192, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
        "video_processor_type": "Qwen2VLVideoProcessor"}))
    cfg = json.loads((ckpt / "config.json").read_text())
    fam = get_family("qwen2_vl")
    axis = fam.vision_axis(cfg, ckpt)
    proc = fam.load_processor(ckpt)
    video = make_video(tmp_path / "v.mp4", frames_of(3, 6, (96, 96)), fps=4)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}]
    item = proc.encode(messages, [], videos=[load_video(video)], video_limits=VideoLimits()).images[0]
    largest = max(part.inputs["pixel_values"].shape[0] for part in proc.vision_parts(item))
    hi = vision_profile(axis, max_batch_size=4, max_images_per_request=2)["pixel_values"][2][0]
    assert largest > 2 * axis.max_rows  # two images' bound alone would refuse this part
    assert largest <= hi == axis.part_rows
