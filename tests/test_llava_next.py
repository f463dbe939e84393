"""LLaVA-NeXT (anyres): vlmctl build + chat --json == LlavaNextForConditionalGeneration.generate, and the
per-crop ONNX graph + host-side packing == transformers' own image-feature path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from parity import assert_greedy_parity, parity_test, strip_eos
from tiny_llava_anyres import make_llava_next
from tiny_models import make_image

DECODERS = ("mistral", "llama")  # llava-v1.6-mistral and llava-v1.6-vicuna


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """decoder -> (checkpoint, engine dir): one tiny checkpoint and `vlmctl build` per decoder family."""
    out = {}
    for i, decoder in enumerate(DECODERS):
        d = tmp_path_factory.mktemp(f"next-{decoder}")
        ckpt = make_llava_next(d / "ckpt", decoder=decoder, seed=i, num_kv_heads=2 if i == 0 else 4,
                               feature_layer=-2 if i == 0 else [-3, -1], tie=bool(i))
        recipe = write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 2})
        cli("build", recipe, "-o", d / "eng")
        out[decoder] = (ckpt, d / "eng")
    return out


def hf_reference(ckpt, messages, images, max_new_tokens):
    """transformers' own processor (it loads without torchvision) and generate."""
    from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor

    proc = LlavaNextProcessor.from_pretrained(ckpt)
    model = LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(images=images, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()




CASES = [
    # (decoder, image sizes (width, height), prompt): wide, tall, square-ish, very wide, two in one message
    ("mistral", [(40, 30)], "what is in this image?"),
    ("mistral", [(20, 50)], "describe the picture"),
    ("mistral", [(30, 30), (90, 20)], "Tell me a story about a robot."),
    ("llama", [(100, 20)], "hello world!"),
    ("llama", [(64, 64), (25, 60)], "what is in this image?"),
]


@pytest.mark.parametrize("decoder,sizes,prompt", CASES,
                         ids=["mistral-wide", "mistral-tall", "mistral-two-images", "llama-very-wide",
                              "llama-two-images"])
@parity_test('llava_next')
def test_chat_json_matches_transformers_generate(built, tmp_path, capsys, decoder, sizes, prompt):
    ckpt, eng = built[decoder]
    image_args, images = [], []
    for i, size in enumerate(sizes):
        img = make_image(20 + i, size)
        img.save(tmp_path / f"img{i}.png")
        images.append(img)
        image_args += ["--image", tmp_path / f"img{i}.png"]
    got = cli_json("chat", eng, *image_args, "--prompt", prompt, "--temperature", "0", "--max-tokens", "12", "--json",
                   capsys=capsys)
    messages = [{"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": prompt}]}]
    ref_prompt, ref = hf_reference(ckpt, messages, images, 12)
    assert got["prompt_tokens"] == len(ref_prompt)
    assert_greedy_parity(got["token_ids"], ref, eos=2)
    assert got["finish_reason"] == ("stop" if 2 in ref else "length")


def test_prompt_expansion_matches_processor(built):
    """The family's token count per image size equals LlavaNextProcessor's, over many sizes and aspect ratios."""
    from transformers import LlavaNextProcessor

    from vlmctl.models.llava_next import LlavaNextFamily

    ckpt, eng = built["mistral"]
    proc = LlavaNextProcessor.from_pretrained(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    fam = LlavaNextFamily()
    mine = fam.load_processor(eng / "convert" / "processor", eng / "convert" / "vision")
    bound = mine.max_image_tokens()
    assert bound == fam.max_image_tokens(cfg)
    counts = []
    for h in (5, 17, 28, 29, 40, 56, 57, 83, 200, 1000):
        for w in (3, 28, 30, 55, 90, 300):
            n = proc._get_number_of_features(h, w, 28, 28) - 1  # -1: "default" drops the CLS row
            assert mine.num_image_tokens((w, h)) == n, (h, w)
            counts.append(n)
    assert max(counts) <= bound
    assert max(counts) == bound  # a square image on the 2x2 pinpoint reaches it
    assert min(counts) >= fam.min_image_tokens(cfg) == 16  # the base crop's 4x4 rows begin every image


def test_onnx_and_host_packing_match_hf_image_features(built):
    """ONNX Runtime per crop (at a crop batch never used in export) + postprocess_features == HF
    get_image_features; and the per-crop graph output == HF's tower + projector."""
    from transformers import LlavaNextForConditionalGeneration

    from vlmctl.export.onnx_vision import EXPORT_BATCH, ort_session
    from vlmctl.models.llava_next import LlavaNextFamily

    ckpt, eng = built["llama"]  # the multi-layer feature selection
    manifest = json.loads((eng / "export-vision" / "manifest.json").read_text())
    assert manifest["info"]["validate_batch"] != EXPORT_BATCH and manifest["info"]["max_abs_error"] < 1e-4

    fam = LlavaNextFamily()
    proc = fam.load_processor(eng / "convert" / "processor", eng / "convert" / "vision")
    model = LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    sess = ort_session(eng / "export-vision" / "model.onnx", ["CPUExecutionProvider"])
    images = [make_image(30, (90, 33)), make_image(31, (33, 90)), make_image(32, (57, 57))]
    prompt = proc.encode([{"role": "user", "content": [{"type": "image"}] * 3}], images)
    feed, sizes = proc.collate(prompt.images)
    assert feed["pixel_values"].shape[0] not in (EXPORT_BATCH,) and sum(sizes) == feed["pixel_values"].shape[0]
    out = sess.run(None, feed)[0]

    hf_in = proc.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        ref_rows = fam.hf_image_features(model, {"pixel_values": hf_in["pixel_values"],
                                                 "image_sizes": hf_in["image_sizes"]})
        ref_crops = fam.hf_image_features(model, {"pixel_values": torch.from_numpy(feed["pixel_values"])})
    assert np.abs(out - ref_crops.numpy()).max() < 1e-4
    for item, chunk, ref in zip(prompt.images, np.split(out, np.cumsum(sizes)[:-1]), ref_rows):
        rows = proc.postprocess_features(chunk, item)
        assert rows.shape == tuple(ref.shape) == (item.num_tokens, ref.shape[-1])
        assert np.abs(rows - ref.numpy()).max() < 1e-4


def test_tensor_names_round_trip(built):
    """Every tensor of the HF model splits into vision/decoder and joins back to its name (AWQ's VLM
    checkpoint); transformers-4.x hub names map to the current ones."""
    from safetensors import safe_open

    from vlmctl.models.base import VISION
    from vlmctl.models.llava_next import LlavaNextFamily

    ckpt, _ = built["mistral"]
    fam = LlavaNextFamily()
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert "image_newline" in keys  # transformers saves the hub's (4.x) names
    for k in keys:
        canon = fam.canonical_key(k)
        part, name = fam.split_key(canon)
        assert fam.join_key(part, name) == canon
        assert (part == VISION) == name.startswith(("vision_tower.", "multi_modal_projector.", "image_newline"))
    assert fam.canonical_key("image_newline") == "model.image_newline"
    assert fam.canonical_key("language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert fam.canonical_key("vision_tower.vision_model.post_layernorm.bias") == \
        "model.vision_tower.vision_model.post_layernorm.bias"


def test_awq_build_matches_transformers_on_dequantized_weights(built, tmp_path, capsys):
    """`vlmctl build --set quantization.method=awq`: the engine's greedy tokens equal transformers'
    on the same (dequantized) decoder weights, with the vision part untouched."""
    import shutil

    from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor

    from tiny_llava_anyres import dequantized_reference
    from vlmctl.models.llava_next import LlavaNextFamily

    ckpt, eng = built["mistral"]
    awq_eng = tmp_path / "eng-awq"
    shutil.copytree(eng, awq_eng)  # convert and export-vision are cache hits
    cli("build", eng.parent / "r.yaml", "-o", awq_eng, "--set", "quantization.method=awq",
        "--set", "quantization.group_size=32", "--set", "quantization.calibration.samples=8",
        "--set", "quantization.calibration.seq_len=64", capsys=capsys)
    assert json.loads((awq_eng / "build-llm" / "manifest.json").read_text())["info"]["quantization"] != "none"
    images, prompt = [make_image(70, (40, 30)), make_image(71, (25, 60))], "what is in this image?"
    for i, img in enumerate(images):
        img.save(tmp_path / f"img{i}.png")
    got = cli_json("chat", awq_eng, "--image", tmp_path / "img0.png", "--image", tmp_path / "img1.png",
                   "--prompt", prompt, "--temperature", "0", "--max-tokens", "12", "--json", capsys=capsys)
    model = dequantized_reference(LlavaNextForConditionalGeneration, ckpt, awq_eng / "quantize" / "llm",
                                  LlavaNextFamily())
    proc = LlavaNextProcessor.from_pretrained(ckpt)
    messages = [{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": prompt}]}]
    inputs = proc(images=images, text=proc.apply_chat_template(messages, add_generation_prompt=True),
                  return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert got["token_ids"] == strip_eos(ref, 2)
    vlm_cfg = json.loads((awq_eng / "quantize" / "vlm" / "config.json").read_text())
    assert set(vlm_cfg["quantization_config"]["modules_to_not_convert"]) >= {"vision_tower", "multi_modal_projector"}


def test_tensorrt_profile_counts_crops(built):
    """The vision engine's batch axis is crops: its profile admits every image of a full batch at the
    largest grid (2x2 crops + base here), not just one row per image."""
    from vlmctl.models.llava_next import LlavaNextFamily

    ckpt, _ = built["mistral"]
    cfg = json.loads((ckpt / "config.json").read_text())
    fam = LlavaNextFamily()
    assert fam.max_crops(cfg) == 5
    from vlmctl.export.tensorrt import vision_profile

    lo, opt, hi = vision_profile(fam.vision_axis(cfg, ckpt), max_batch_size=2, max_images_per_request=2)["pixel_values"]
    assert lo == (1, 3, 28, 28) and opt == (5, 3, 28, 28) and hi == (20, 3, 28, 28)
    assert fam.onnx_io(cfg)[2]["pixel_values"] == {0: "crops"}
