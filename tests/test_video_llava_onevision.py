"""Video input for LLaVA-OneVision against transformers, on tiny models and synthetic videos.

- greedy parity: `vlmctl build` + `vlmctl chat --json --video` == `generate` with
  pixel_values_videos (frames sampled evenly, resized to the crop, each frame's features pooled to
  ceil(grid/2) on a side, one image_newline after the video), with the video processor's settings
  from the image processor's file and from a video_preprocessor_config.json of its own;
- an image and a video in one message through the engine API (the image keeps its anyres form);
- vision: ONNX Runtime per frame + the host's pooling and newline == transformers'
  `get_video_features`, also when the engine splits the frames over several vision calls.

The reference prompt uses the processor's own `replace_video_token` (the combined processor cannot be
built without torchvision); its frames come from tests/video_reference.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from test_llava_onevision import Reference, strip_eos
from tiny_llava_anyres import make_llava_onevision
from tiny_models import make_image
from tiny_video import frames_of, make_video
from video_reference import onevision_video_inputs

pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")

SIZE = 28  # the tiny tower's crop


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two engines: the video processor read from the image processor's file (32 frames by default),
    and from its own video_preprocessor_config.json (6 frames)."""
    out = {}
    for key, video_cfg in (("default", None), ("six-frames", {"num_frames": 6})):
        d = tmp_path_factory.mktemp(f"ov-video-{key}")
        ckpt = make_llava_onevision(d / "ckpt", seed=3, num_kv_heads=2)
        if video_cfg is not None:
            (ckpt / "video_preprocessor_config.json").write_text(json.dumps({
                **video_cfg, "size": {"height": SIZE, "width": SIZE}, "resample": 3, "do_sample_frames": True,
                "video_processor_type": "LlavaOnevisionVideoProcessor"}))
        recipe = write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 2})
        cli("build", recipe, "-o", d / "eng")
        out[key] = (ckpt, d / "eng", Reference(ckpt), video_cfg["num_frames"] if video_cfg else 32)
    return out


def reference_inputs(ref: Reference, messages, images, videos: list[dict]) -> dict:
    """Reference.inputs plus videos: each `<video>` replaced by the processor's own count."""
    text = ref.tok.apply_chat_template(messages, chat_template=ref.template, add_generation_prompt=True,
                                       tokenize=False)
    inputs: dict = {}
    if images:
        pix = ref.ip(images=[images], return_tensors="pt")
        for i in range(len(images)):
            text = text.replace("<image>", ref.proc.replace_image_token(pix, i).replace("<image>", "\0"), 1)
        inputs.update(pix)
    ref.proc.video_token = "<video>"
    for i, v in enumerate(videos):
        text = text.replace("<video>", ref.proc.replace_video_token(v, 0).replace("<video>", "\1"), 1)
    inputs.update(ref.tok(text.replace("\0", "<image>").replace("\1", "<video>"), return_tensors="pt"))
    if videos:
        inputs["pixel_values_videos"] = torch.cat([v["pixel_values_videos"] for v in videos])
    return inputs


def generate(ref: Reference, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = ref.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def user(*kinds, text):
    return [{"role": "user", "content": [{"type": k} for k in kinds] + [{"type": "text", "text": text}]}]


@pytest.mark.parametrize("key,frames,codec,suffix", [("default", 12, "libx264", ".mp4"),
                                                     ("six-frames", 20, "mpeg4", ".avi")],
                         ids=["all-12-frames-mp4", "6-of-20-frames-avi"])
def test_chat_json_video_matches_transformers_generate(built, tmp_path, capsys, key, frames, codec, suffix):
    ckpt, eng, ref, num_frames = built[key]
    path = make_video(tmp_path / f"clip{suffix}", frames_of(10, frames, (40, 30)), fps=5, codec=codec)
    got = cli_json("chat", eng, "--video", path, "--prompt", "what is in this image?", "--max-tokens", "12",
                   "--json", capsys=capsys)
    video = onevision_video_inputs(path, SIZE, min(num_frames, frames))
    inputs = reference_inputs(ref, user("video", text="what is in this image?"), [], [video])
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert (inputs["input_ids"] == ref.model.config.video_token_id).sum() == min(num_frames, frames) * 4 + 1
    ids = generate(ref, inputs, 12)
    assert got["token_ids"] == strip_eos(ids)
    other = onevision_video_inputs(make_video(tmp_path / f"o{suffix}", frames_of(11, frames, (40, 30)), fps=5,
                                              codec=codec), SIZE, min(num_frames, frames))
    assert generate(ref, reference_inputs(ref, user("video", text="what is in this image?"), [], [other]), 12) != ids


def test_image_and_video_in_one_message_through_the_engine(built, tmp_path):
    from vlmctl.media.video import load_video
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt, eng_dir, ref, num_frames = built["six-frames"]
    path = make_video(tmp_path / "clip.mp4", frames_of(20, 15, (32, 48)), fps=6)
    image = make_image(21, (110, 100))  # a 4x4 grid, downscaled: the image keeps its anyres form
    messages = user("video", "image", text="describe the picture")
    engine = Engine(eng_dir)
    prompt = engine.encode(messages, [image], [load_video(path)])
    inputs = reference_inputs(ref, messages, [image], [onevision_video_inputs(path, SIZE, num_frames)])
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert [it.meta.get("video", False) for it in prompt.images] == [False, True]  # the template puts images first
    assert "grid" in prompt.images[0].meta
    got = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    assert got == strip_eos(generate(ref, inputs, 10))


def test_onnx_frames_and_host_pooling_match_hf_video_features(built, tmp_path):
    from vlmctl.export.onnx_vision import EXPORT_BATCH, ort_session
    from vlmctl.media.video import VideoLimits, load_video
    from vlmctl.models.llava_onevision import LlavaOnevisionFamily
    from vlmctl.runtime.vision import OrtVisionRunner, VisionEncoder

    ckpt, eng_dir, ref, num_frames = built["default"]
    fam = LlavaOnevisionFamily()
    proc = fam.load_processor(eng_dir / "convert" / "processor")
    path = make_video(tmp_path / "long.mp4", frames_of(30, 45, (64, 36)), fps=8)
    video = onevision_video_inputs(path, SIZE, 32)
    with torch.no_grad():
        hf = fam.hf_video_features(ref.model, video)[0].numpy()
    assert hf.shape == (32 * 4 + 1, ref.model.config.text_config.hidden_size)
    # One vision call over every frame (a batch the export never used), pooled on the host.
    frames = video["pixel_values_videos"][0].numpy()
    assert frames.shape[0] != EXPORT_BATCH
    out = ort_session(eng_dir / "export-vision" / "model.onnx", ["CPUExecutionProvider"]).run(
        None, {"pixel_values": frames})[0]
    prompt = proc.encode(user("video", text="hi"), [], videos=[load_video(path)], video_limits=VideoLimits())
    item = prompt.images[0]
    whole = proc.postprocess_features(out, type(item)(inputs={}, num_tokens=item.num_tokens,
                                                      meta={"video_frames": True, "newline": True}))
    assert np.abs(whole.numpy() - hf).max() < 1e-4 and np.abs(hf).max() > 0.1
    # The engine's path: frames split over several calls (at most one anyres image's crops each).
    assert item.meta["frames"] == list(video["frames"]) and len(item.meta["parts"]) >= 2
    enc = VisionEncoder(OrtVisionRunner(eng_dir / "export-vision" / "model.onnx"), proc, torch.device("cpu"),
                        torch.float32)
    enc.encode(prompt.images)
    assert np.abs(item.features.numpy() - hf).max() < 1e-4


def test_text_only_prompt(built):
    """A prompt without images or videos (the image processor is not called on an empty list)."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt, eng_dir, ref, _ = built["default"]
    engine = Engine(eng_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello world!"}]}]
    prompt = engine.encode(messages, [])
    inputs = reference_inputs(ref, messages, [], [])
    assert prompt.token_ids == inputs["input_ids"][0].tolist() and not prompt.images
    got = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    assert got == strip_eos(generate(ref, inputs, 8))
