"""Video input for Qwen2-VL and Qwen2.5-VL against transformers, on tiny models and synthetic videos.

- greedy parity: `vlmctl build` + `vlmctl chat --json --video` == `generate` with
  pixel_values_videos / video_grid_thw (/ second_per_grid_ts for 2.5), fp32 on the CPU;
- a video and an image in one message, in both orders, through the engine API;
- vision: ONNX Runtime == the torch wrapper == transformers' `get_video_features` on a whole video
  grid (t > 1, patch counts the export never saw), and the engine's split vision work (chunks of
  temporal patches) gives the same rows;
- M-RoPE positions == `get_rope_index` with video_grid_thw and second_per_grid_ts (fractional
  time steps, temporal extents beyond the spatial ones);
- `serve` with the official client: a `video_url` data URL.

The reference inputs come from tests/video_reference.py (transformers' PyAV reader and image
processor, with the video processor's torchvision glue reimplemented there).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from conftest import cli_json, write_recipe
from test_qwen2_vl import VERSIONS, _hf_class, eos_ids, strip_eos
from tiny_models import make_image, make_qwen2_vl
from tiny_video import frames_of, make_video
from video_reference import qwen_video_inputs

pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")

# The tiny checkpoints' processor range (tiny_models.make_qwen2_vl); videos use it too unless a
# video_preprocessor_config.json says otherwise.
PIXELS = {"min_pixels": 256, "max_pixels": 4096}


def hf_media_inputs(ckpt, messages, images, videos: list[dict], version: str) -> dict:
    """The processor's output for messages with images and videos: each placeholder expanded by its
    grid (grid.prod() // merge**2), mm_token_type_ids 1 for image rows and 2 for video rows."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = AutoImageProcessor.from_pretrained(ckpt)
    text = tok.apply_chat_template(messages, chat_template=(ckpt / "chat_template.jinja").read_text(),
                                   add_generation_prompt=True, tokenize=False)
    inputs: dict = {}
    if images:
        inputs.update(ip(images=images, return_tensors="pt"))
    counts = {"<|image_pad|>": iter([int(g.prod()) // 4 for g in inputs.get("image_grid_thw", [])]),
              "<|video_pad|>": iter([int(v["video_grid_thw"].prod()) // 4 for v in videos])}
    text = re.sub(r"<\|image_pad\|>|<\|video_pad\|>", lambda mt: mt.group(0) * next(counts[mt.group(0)]), text)
    enc = tok(text, return_tensors="pt")
    ids = enc["input_ids"]
    inputs.update(input_ids=ids, attention_mask=enc["attention_mask"])
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == tok.convert_tokens_to_ids("<|image_pad|>")] = 1
    types[ids == tok.convert_tokens_to_ids("<|video_pad|>")] = 2
    inputs["mm_token_type_ids"] = types
    if videos:
        inputs["pixel_values_videos"] = torch.cat([v["pixel_values_videos"] for v in videos])
        inputs["video_grid_thw"] = torch.cat([v["video_grid_thw"] for v in videos])
        if version == "2.5":
            inputs["second_per_grid_ts"] = torch.cat([v["second_per_grid_ts"] for v in videos])
    return inputs


def hf_greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def content(*kinds: str, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": k} for k in kinds] + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=list(VERSIONS))
def built(request, tmp_path_factory):
    """A built engine per version; Qwen2.5-VL's checkpoint has its own video processor file
    (another pixel range and frame rate than its images, and the per-frame share of a whole-video
    pixel budget, `cap_pixels_per_frame`, small enough to shrink every video here)."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    family = request.param
    d = tmp_path_factory.mktemp(f"video-{family}")
    ckpt = make_qwen2_vl(d / "ckpt", version=VERSIONS[family], seed=21)
    video_cfg = dict(PIXELS)
    if family == "qwen2_5_vl":
        video_cfg = {"min_pixels": 128, "max_pixels": 2048, "fps": 1.6, "cap_pixels_per_frame": True,
                     "max_video_tokens": 100}
        (ckpt / "video_preprocessor_config.json").write_text(json.dumps({
            **video_cfg, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
            "video_processor_type": "Qwen2VLVideoProcessor"}))
    recipe = load_recipe(write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 2,
                                                                  "max_batch_size": 3}))
    build(recipe, d / "eng")
    model = _hf_class(VERSIONS[family]).from_pretrained(ckpt, dtype=torch.float32).eval()
    return family, ckpt, d / "eng", model, video_cfg


def reference_video(ckpt, path, video_cfg):
    return qwen_video_inputs(ckpt, path, fps=video_cfg.get("fps", 2.0), min_pixels=video_cfg["min_pixels"],
                             max_pixels=video_cfg["max_pixels"], cap_video_tokens=video_cfg.get("max_video_tokens"))


# (frames, (width, height), fps, codec/container): t > max merged side in the first case, so the text
# after the video starts below the video's last temporal position.
# (transformers' PyAV reader needs a container that records its frame count: mp4, avi.)
VIDEOS = [(20, (48, 32), 4, ".mp4", "libx264"), (9, (30, 70), 3, ".avi", "mpeg4")]


@pytest.mark.parametrize("case", [0, 1], ids=["h264-mp4-20-frames", "mpeg4-avi-9-frames-tall"])
def test_chat_json_video_matches_transformers_generate(built, tmp_path, capsys, case):
    family, ckpt, eng, model, video_cfg = built
    n, size, fps, suffix, codec = VIDEOS[case]
    path = make_video(tmp_path / f"clip{suffix}", frames_of(30 + case, n, size), fps=fps, codec=codec)
    got = cli_json("chat", eng, "--video", path, "--prompt", "describe the picture", "--max-tokens", "12",
                   "--json", capsys=capsys)
    ref_video = reference_video(ckpt, path, video_cfg)
    assert ref_video["video_grid_thw"][0, 0] >= 2  # several temporal patches
    inputs = hf_media_inputs(ckpt, content("video", text="describe the picture"), [], [ref_video], VERSIONS[family])
    ref = hf_greedy(model, inputs, 12)
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert got["token_ids"] == strip_eos(ref, eos_ids(ckpt))
    # The video changes the answer (its rows are not ignored).
    other = reference_video(ckpt, make_video(tmp_path / f"other{suffix}", frames_of(99, n, size), fps=fps,
                                             codec=codec), video_cfg)
    inputs2 = hf_media_inputs(ckpt, content("video", text="describe the picture"), [], [other], VERSIONS[family])
    assert hf_greedy(model, inputs2, 12) != ref


@pytest.mark.parametrize("order", [("image", "video"), ("video", "image")])
def test_video_and_image_in_one_message_through_the_engine(built, tmp_path, order):
    from vlmctl.media.video import load_video
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    family, ckpt, eng_dir, model, video_cfg = built
    path = make_video(tmp_path / "clip.mp4", frames_of(40, 12, (40, 40)), fps=5)
    image = make_image(41, (52, 36))
    messages = content(*order, text="compare the pictures")
    engine = Engine(eng_dir)
    prompt = engine.encode(messages, [image], [load_video(path)])
    ref_video = reference_video(ckpt, path, video_cfg)
    inputs = hf_media_inputs(ckpt, messages, [image], [ref_video], VERSIONS[family])
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert [it.meta.get("video", False) for it in prompt.images] == [k == "video" for k in order]
    assert prompt.images[order.index("video")].meta["frames"] == [int(i) for i in ref_video["frames"]]
    got = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    assert got == strip_eos(hf_greedy(model, inputs, 10), eos_ids(ckpt))


def test_mrope_positions_match_get_rope_index(built, tmp_path):
    """Positions of image + two videos (one with more temporal patches than merged rows) ==
    transformers' get_rope_index, with second_per_grid_ts for Qwen2.5-VL (fractional steps)."""
    from vlmctl.media.video import VideoLimits, load_video
    from vlmctl.models.registry import get_family

    family, ckpt, eng_dir, model, video_cfg = built
    proc = get_family(family).load_processor(eng_dir / "convert" / "processor")
    paths = [make_video(tmp_path / "a.mp4", frames_of(50, 40, (32, 32)), fps=4),
             make_video(tmp_path / "b.mp4", frames_of(51, 10, (64, 24)), fps=3)]
    image = make_image(52, (30, 60))
    messages = [{"role": "system", "content": "be brief"}] + content("video", "image", "video", text="what changed?")
    prompt = proc.encode(messages, [image], videos=[load_video(p) for p in paths],
                         video_limits=VideoLimits(max_videos_per_request=2))
    refs = [reference_video(ckpt, p, video_cfg) for p in paths]
    inputs = hf_media_inputs(ckpt, messages, [image], refs, VERSIONS[family])
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    kw = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if family == "qwen2_5_vl" else {}
    pos, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                            image_grid_thw=inputs["image_grid_thw"],
                                            video_grid_thw=inputs["video_grid_thw"], **kw)
    ours = proc.position_ids(prompt.token_ids, prompt)
    np.testing.assert_array_equal(ours, pos[:, 0].numpy())
    assert int(ours.max()) + 1 - len(prompt.token_ids) == int(delta[0, 0])
    # transformers 5 continues the text after a video at its start + its larger merged side, which is
    # below the video's last temporal position here (the original Qwen code would continue above it).
    rows = np.flatnonzero(inputs["mm_token_type_ids"][0].numpy() == 2)
    first_end = rows[np.flatnonzero(np.diff(rows) > 1)[0]] if (np.diff(rows) > 1).any() else rows[-1]
    assert ours[:, first_end + 1].max() < ours[:, rows[0]:first_end + 1].max()
    if family == "qwen2_5_vl":
        steps = [float(s) * 2 for s in inputs["second_per_grid_ts"]]  # tokens_per_second 2
        assert any(s != int(s) for s in steps)  # truncation of fractional time steps is exercised


def test_vision_onnx_torch_and_transformers_agree_on_video_grids(built, tmp_path):
    """The ONNX graph on a whole video grid (t > 1, never exported with) == the torch wrapper ==
    transformers' get_video_features; the engine's vision work, split into chunks of temporal
    patches on ONNX Runtime, gives the same rows."""
    from vlmctl.export.onnx_vision import ort_session
    from vlmctl.media.video import VideoLimits, load_video
    from vlmctl.models.base import ImageItem
    from vlmctl.models.qwen2_vl import collate_vision, window_index
    from vlmctl.models.registry import get_family
    from vlmctl.runtime.vision import OrtVisionRunner, VisionEncoder

    family, ckpt, eng_dir, model, video_cfg = built
    fam = get_family(family)
    proc = fam.load_processor(eng_dir / "convert" / "processor")
    path = make_video(tmp_path / "long.mp4", frames_of(60, 30, (56, 40)), fps=6)
    ref = reference_video(ckpt, path, video_cfg)
    grid = tuple(int(x) for x in ref["video_grid_thw"][0])
    item = ImageItem(inputs=fam._vision_inputs(ref["pixel_values_videos"].numpy(), grid, proc.geometry),
                     num_tokens=grid[0] * grid[1] * grid[2] // 4)
    feed, _ = collate_vision([item])
    got = ort_session(eng_dir / "export-vision" / "model.onnx", ["CPUExecutionProvider"]).run(None, feed)[0]
    module = fam.build_vision_module(eng_dir / "convert" / "vision", torch.float32)
    with torch.no_grad():
        tw = module(*[torch.from_numpy(v) for v in feed.values()]).numpy()
        hf = fam.hf_video_features(model, ref).numpy()
    if fam.windowed:  # the graph's rows come back in window order
        order, _ = window_index([grid], 2, proc.geometry["window_size"], proc.geometry["patch_size"])
        got, tw = got[np.argsort(order)], tw[np.argsort(order)]
    assert got.shape == hf.shape == (item.num_tokens, model.config.text_config.hidden_size)
    assert np.abs(got - tw).max() < 1e-4 and np.abs(got - hf).max() < 1e-4 and np.abs(hf).max() > 0.1
    # The engine's path: the video split into parts, each its own vision call.
    prompt = proc.encode(content("video", text="hi"), [], videos=[load_video(path)], video_limits=VideoLimits())
    video = prompt.images[0]
    assert video.meta["grid_thw"] == grid and len(video.meta["parts"]) >= 2
    enc = VisionEncoder(OrtVisionRunner(eng_dir / "export-vision" / "model.onnx"), proc, torch.device("cpu"),
                        torch.float32)
    enc.encode(prompt.images)
    assert enc.calls == len(video.meta["parts"])
    assert np.abs(video.features.numpy() - hf).max() < 1e-4


def test_serve_openai_client_video_url(built):
    """A video as a data URL in a `video_url` part, beside text, over real HTTP with the official client."""
    import base64
    import socket
    import threading
    import time

    import uvicorn
    from openai import OpenAI

    from vlmctl.serve import ServerConfig, load_app

    family, ckpt, eng, model, video_cfg = built
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = make_video(Path(d) / "clip.mp4", frames_of(70, 16, (48, 40)), fps=4)
        data = path.read_bytes()
        ref_video = reference_video(ckpt, path, video_cfg)
    app = load_app(eng, ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        client = OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
        url = "data:video/mp4;base64," + base64.b64encode(data).decode()
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "what happens?"}]}]
        r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=10,
                                           messages=messages)
        bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"
                                                                                      + base64.b64encode(b"x" * 64)
                                                                                      .decode()}}]}]
        import openai

        with pytest.raises(openai.BadRequestError, match="video 1: not a readable video container"):
            client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, messages=bad)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    inputs = hf_media_inputs(ckpt, content("video", text="what happens?"), [], [ref_video], VERSIONS[family])
    ref = strip_eos(hf_greedy(model, inputs, 10), eos_ids(ckpt))
    from transformers import AutoTokenizer

    assert r.choices[0].message.content == AutoTokenizer.from_pretrained(ckpt).decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]
