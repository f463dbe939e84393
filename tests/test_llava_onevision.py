"""LLaVA-OneVision: vlmctl build + chat --json == LlavaOnevisionForConditionalGeneration.generate, and the
per-crop ONNX graph + host-side packing (anyres_max downscaling, multi-image single crops) ==
transformers' own image-feature path.

The combined LlavaOnevisionProcessor cannot load without torchvision, so the reference prompt is
built from the tokenizer, the chat template and the PIL image processor, with the placeholder
counts from transformers' own `LlavaOnevisionProcessor.replace_image_token`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from parity import assert_greedy_parity, parity_test, strip_eos
from tiny_llava_anyres import make_llava_onevision
from tiny_models import make_image

CKPTS = {
    # anyres_max_9 with grids up to 4x4 crops: only the largest maps get downscaled
    "gqa-max9": {"seed": 0, "num_kv_heads": 2},
    # anyres_max_2: every grid of 2x2 crops or more gets downscaled; tied embeddings, MHA
    "mha-max2-tied": {"seed": 1, "num_kv_heads": 4, "aspect_ratio": "anyres_max_2", "tie": True},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for key, kwargs in CKPTS.items():
        d = tmp_path_factory.mktemp(f"ov-{key}")
        ckpt = make_llava_onevision(d / "ckpt", **kwargs)
        recipe = write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 2})
        cli("build", recipe, "-o", d / "eng")
        out[key] = (ckpt, d / "eng")
    return out


class Reference:
    """transformers' pieces of the OneVision processor, assembled without its video processor."""

    def __init__(self, ckpt):
        from transformers import (AutoImageProcessor, AutoTokenizer, LlavaOnevisionForConditionalGeneration,
                                  LlavaOnevisionProcessor)

        self.tok = AutoTokenizer.from_pretrained(ckpt)
        self.ip = AutoImageProcessor.from_pretrained(ckpt, backend="pil")
        self.template = (ckpt / "chat_template.jinja").read_text()
        pc = json.loads((ckpt / "processor_config.json").read_text())
        p = object.__new__(LlavaOnevisionProcessor)  # __init__ wants the video processor
        p.image_processor, p.image_token = self.ip, pc["image_token"]
        p.num_image_tokens, p.vision_aspect_ratio = pc["num_image_tokens"], pc["vision_aspect_ratio"]
        p.vision_feature_select_strategy = pc["vision_feature_select_strategy"]
        self.proc = p
        self.model = LlavaOnevisionForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()

    def inputs(self, messages, images):
        text = self.tok.apply_chat_template(messages, chat_template=self.template, add_generation_prompt=True,
                                            tokenize=False)
        # One conversation = one sample: the nested list is what the processor's chat-template path passes.
        pix = self.ip(images=[images], return_tensors="pt")
        for i in range(len(images)):
            text = text.replace("<image>", self.proc.replace_image_token(pix, i).replace("<image>", "\0"), 1)
        inputs = dict(self.tok(text.replace("\0", "<image>"), return_tensors="pt"))
        inputs.update(pix)
        return inputs

    def generate(self, messages, images, max_new_tokens):
        inputs = self.inputs(messages, images)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()




CASES = [
    ("gqa-max9", [(40, 30)], "what is in this image?"),
    ("gqa-max9", [(110, 100)], "describe the picture"),  # 4x4 grid: downscaled map
    ("gqa-max9", [(30, 30), (90, 20)], "Tell me a story about a robot."),  # multi-image: single crops
    ("mha-max2-tied", [(20, 50)], "hello world!"),
    ("mha-max2-tied", [(100, 20), (64, 64)], "what is in this image?"),
]


@pytest.mark.parametrize("key,sizes,prompt", CASES, ids=["max9-wide", "max9-downscaled", "max9-two-images",
                                                         "max2-tall", "max2-two-images"])
@parity_test('llava_onevision')
def test_chat_json_matches_transformers_generate(built, tmp_path, capsys, key, sizes, prompt):
    ckpt, eng = built[key]
    image_args, images = [], []
    for i, size in enumerate(sizes):
        img = make_image(40 + i, size)
        img.save(tmp_path / f"img{i}.png")
        images.append(img)
        image_args += ["--image", tmp_path / f"img{i}.png"]
    got = cli_json("chat", eng, *image_args, "--prompt", prompt, "--temperature", "0", "--max-tokens", "12", "--json",
                   capsys=capsys)
    messages = [{"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": prompt}]}]
    ref_prompt, ref = Reference(ckpt).generate(messages, images, 12)
    assert got["prompt_tokens"] == len(ref_prompt)
    assert_greedy_parity(got["token_ids"], ref, eos=2)
    assert got["finish_reason"] == ("stop" if 2 in ref else "length")


def test_multi_turn_images_count_as_one_sample(built):
    """An image in each of two turns makes a multi-image prompt (single crops), as in transformers."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt, eng_dir = built["gqa-max9"]
    images = [make_image(50, (40, 30)), make_image(51, (30, 70))]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in this image?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and here?"}]},
    ]
    eng = Engine(eng_dir)
    prompt = eng.encode(messages, images)
    ref_prompt, ref = Reference(ckpt).generate(messages, images, 10)
    assert prompt.token_ids == ref_prompt
    got = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    assert got == strip_eos(ref, 2)


def test_prompt_expansion_matches_processor(built):
    """The family's token count per image size equals transformers' processor, over many sizes."""
    from transformers import AutoImageProcessor, LlavaOnevisionProcessor

    from vlmctl.models.llava_onevision import LlavaOnevisionFamily

    fam = LlavaOnevisionFamily()
    for key in CKPTS:
        ckpt, eng = built[key]
        cfg = json.loads((ckpt / "config.json").read_text())
        p = object.__new__(LlavaOnevisionProcessor)
        p.image_processor = AutoImageProcessor.from_pretrained(ckpt, backend="pil")
        p.num_image_tokens, p.vision_aspect_ratio = 16, cfg["vision_aspect_ratio"]
        mine = fam.load_processor(eng / "convert" / "processor", eng / "convert" / "vision")
        bound = mine.max_image_tokens()
        counts = []
        for h in (5, 17, 28, 29, 40, 56, 57, 83, 100, 200, 1000):
            for w in (3, 28, 30, 55, 90, 110, 300):
                n = p._get_number_of_features(h, w, 28, 28)
                assert mine.num_image_tokens((w, h)) == n, (key, h, w)
                counts.append(n)
        assert max(counts) <= bound
        assert min(counts) >= fam.min_image_tokens(cfg) == 16  # the base crop's 4x4 rows begin every image


def test_onnx_and_host_packing_match_hf_image_features(built):
    """ONNX Runtime per crop (crop batches never used in export) + postprocess_features == HF
    get_image_features, for a single anyres image (downscaled) and for a multi-image sample."""
    from vlmctl.export.onnx_vision import EXPORT_BATCH, ort_session
    from vlmctl.models.llava_onevision import LlavaOnevisionFamily

    ckpt, eng = built["mha-max2-tied"]
    manifest = json.loads((eng / "export-vision" / "manifest.json").read_text())
    assert manifest["info"]["validate_batch"] != EXPORT_BATCH and manifest["info"]["max_abs_error"] < 1e-4
    fam = LlavaOnevisionFamily()
    proc = fam.load_processor(eng / "convert" / "processor", eng / "convert" / "vision")
    ref = Reference(ckpt)
    sess = ort_session(eng / "export-vision" / "model.onnx", ["CPUExecutionProvider"])
    for images in ([make_image(60, (110, 100))], [make_image(61, (90, 33)), make_image(62, (33, 90)),
                                                   make_image(63, (57, 57))]):
        prompt = proc.encode([{"role": "user", "content": [{"type": "image"}] * len(images)}], images)
        feed, sizes = proc.collate(prompt.images)
        assert feed["pixel_values"].shape[0] != EXPORT_BATCH
        out = sess.run(None, feed)[0]
        pix = ref.ip(images=[images], return_tensors="pt")
        with torch.no_grad():
            ref_rows = fam.hf_image_features(ref.model, dict(pix))
            ref_crops = fam.hf_image_features(ref.model, {"pixel_values": torch.from_numpy(feed["pixel_values"])})
        assert np.abs(out - ref_crops.numpy()).max() < 1e-4
        for item, chunk, r in zip(prompt.images, np.split(out, np.cumsum(sizes)[:-1]), ref_rows):
            rows = proc.postprocess_features(chunk, item)
            assert rows.shape == tuple(r.shape) == (item.num_tokens, r.shape[-1])
            assert np.abs(rows - r.numpy()).max() < 1e-4


def test_awq_build_matches_transformers_on_dequantized_weights(built, tmp_path, capsys):
    """`vlmctl build --set quantization.method=awq` on the Qwen2 decoder (q/k/v biases): greedy tokens
    equal transformers' on the same dequantized weights."""
    import shutil

    from transformers import LlavaOnevisionForConditionalGeneration

    from tiny_llava_anyres import dequantized_reference
    from vlmctl.models.llava_onevision import LlavaOnevisionFamily

    ckpt, eng = built["gqa-max9"]
    awq_eng = tmp_path / "eng-awq"
    shutil.copytree(eng, awq_eng)  # convert and export-vision are cache hits
    cli("build", eng.parent / "r.yaml", "-o", awq_eng, "--set", "quantization.method=awq",
        "--set", "quantization.group_size=32", "--set", "quantization.calibration.samples=8",
        "--set", "quantization.calibration.seq_len=64", capsys=capsys)
    assert json.loads((awq_eng / "build-llm" / "manifest.json").read_text())["info"]["quantization"] != "none"
    image, prompt = make_image(72, (110, 100)), "describe the picture"
    image.save(tmp_path / "img.png")
    got = cli_json("chat", awq_eng, "--image", tmp_path / "img.png", "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", "12", "--json", capsys=capsys)
    ref = Reference(ckpt)
    ref.model = dequantized_reference(LlavaOnevisionForConditionalGeneration, ckpt, awq_eng / "quantize" / "llm",
                                      LlavaOnevisionFamily())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    _, ref_ids = ref.generate(messages, [image], 12)
    assert got["token_ids"] == strip_eos(ref_ids, 2)
    vlm_cfg = json.loads((awq_eng / "quantize" / "vlm" / "config.json").read_text())
    assert set(vlm_cfg["quantization_config"]["modules_to_not_convert"]) >= {"vision_tower", "multi_modal_projector"}
