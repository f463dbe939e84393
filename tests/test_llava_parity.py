"""Greedy parity with transformers: vlmctl build + vlmctl chat --json == LlavaForConditionalGeneration.generate."""

from __future__ import annotations

import pytest
import torch

from conftest import cli, cli_json, write_recipe
from parity import assert_greedy_parity, parity_test
from tiny_models import make_image, make_llava


def hf_greedy(ckpt, messages, images, max_new_tokens):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()




CASES = [
    # (checkpoint kwargs, image sizes, prompt)
    ({}, [(40, 30)], "what is in this image?"),
    ({"num_kv_heads": 4, "feature_layer": -1, "select_strategy": "full", "seed": 1}, [(64, 64)], "describe the picture"),
    ({"num_kv_heads": 1, "feature_layer": [-3, -1], "seed": 2, "tie": True}, [(20, 50)], "hello world!"),
    ({"num_kv_heads": 2, "feature_layer": -3, "seed": 3}, [(30, 30), (50, 20)], "Tell me a story about a robot."),
]


@pytest.mark.parametrize("kwargs,sizes,prompt", CASES, ids=["gqa-default", "mha-full-last", "mqa-multilayer-tied",
                                                           "two-images-layer-3"])
@parity_test('llava')
def test_chat_json_matches_transformers_generate(tmp_path, capsys, kwargs, sizes, prompt):
    ckpt = make_llava(tmp_path / "ckpt", **kwargs)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": len(sizes),
                                                              "max_batch_size": 2})
    cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys)
    image_args, images = [], []
    for i, size in enumerate(sizes):
        img = make_image(10 + i, size)
        img.save(tmp_path / f"img{i}.png")
        images.append(img)
        image_args += ["--image", tmp_path / f"img{i}.png"]
    got = cli_json("chat", tmp_path / "eng", *image_args, "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", "12", "--json", capsys=capsys)
    messages = [{"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": prompt}]}]
    ref = hf_greedy(ckpt, messages, images, 12)
    assert_greedy_parity(got["token_ids"], ref, eos=2)
    assert got["completion_tokens"] == len(got["token_ids"])
    assert got["finish_reason"] == ("stop" if 2 in ref else "length")


def test_multi_turn_and_batch_matches_single(tiny_llava_engine):
    """A batch of different requests decodes exactly like each request alone (continuous batching)."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(tiny_llava_engine)
    prompts = []
    for i, text in enumerate(["what is in this image?", "hello", "describe the picture in one sentence."]):
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompts.append(eng.encode(msgs, [make_image(i)]))
    p = SamplingParams(max_tokens=8, temperature=0)
    alone = [eng.generate([pr], p)[0].token_ids for pr in prompts]
    together = [c.token_ids for c in eng.generate(prompts, p)]
    assert together == alone
    assert eng.max_running_seen >= 2
