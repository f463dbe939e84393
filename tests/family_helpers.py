"""What the per-family parity tests (Gemma 3, Idefics3/SmolVLM, InternVL, Llama 3.2 Vision) share:
messages in transformers' form, greedy references from `generate`, the engine build of their module
fixtures, and the AWQ build-then-chat run with its checks on the two quantized checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import cli, cli_json, write_recipe

# what every family's AWQ test quantizes with: small enough for the tiny decoders' widths
AWQ_SETS = ("quantization.method=awq", "quantization.group_size=32", "quantization.calibration.samples=4",
            "quantization.calibration.seq_len=64")
AWQ_PROMPT = "what is in this image?"


def user(n_images: int, text: str) -> dict:
    """A user message: `n_images` image parts, then the text."""
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}


def text_turn(role: str, text: str) -> dict:
    # structured, as vlmctl hands every message to the template (SmolVLM's reads content[0]['type'])
    return {"role": role, "content": [{"type": "text", "text": text}]}


def with_images(messages: list[dict], images: list) -> list[dict]:
    """The messages with the images attached to their image parts in order (transformers' form)."""
    it = iter(images)
    return [{**m, "content": [dict(p, image=next(it)) if p["type"] == "image" else p for p in m["content"]]}
            for m in messages]


def greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on processor outputs: the new token ids only."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def build_engine(ckpt: Path, d: Path, **limits) -> Path:
    """`vlmctl.pipeline.build` of the checkpoint's recipe (two images a request, batch 4 unless `limits`
    say otherwise) into d/engine, through the library API the module fixtures share."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    limits = {"max_images_per_request": 2, "max_batch_size": 4, **limits}
    build(load_recipe(write_recipe(d / "r.yaml", ckpt, limits=limits)), d / "engine")
    return d / "engine"


def awq_build(ckpt: Path, d: Path, capsys, *sets: str, expect: int = 0):
    """`vlmctl build --set quantization.method=awq ...` (group 32, a short calibration) into d/eng."""
    d.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 2})
    args = ["build", recipe, "-o", d / "eng"]
    for s in AWQ_SETS + sets:
        args += ["--set", s]
    return cli(*args, capsys=capsys, expect=expect)


def chat_with_images(eng: Path, d: Path, images: list, capsys, max_tokens: int) -> dict:
    """`vlmctl chat ENGINE --image ... --prompt AWQ_PROMPT --json` with the images saved under d."""
    args = []
    for i, img in enumerate(images):
        img.save(d / f"a{i}.png")
        args += ["--image", d / f"a{i}.png"]
    return cli_json("chat", eng, *args, "--prompt", AWQ_PROMPT, "--max-tokens", str(max_tokens), "--json",
                    capsys=capsys)


def assert_awq_checkpoints(eng: Path, not_converted: set[str]) -> Path:
    """The quantize stage's decoder checkpoint says AWQ at group 32, and its VLM config leaves exactly
    `not_converted` float. Returns the decoder checkpoint's folder."""
    qdir = eng / "quantize" / "llm"
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "awq" and qcfg["group_size"] == 32
    vlm_cfg = json.loads((eng / "quantize" / "vlm" / "config.json").read_text())
    assert set(vlm_cfg["quantization_config"]["modules_to_not_convert"]) == not_converted
    return qdir
