"""Issue 9, build and checkpoint items: ONNX validation relative to the features' magnitude (10), which
tie flag wins for lm_head in every family (11), image-text calibration in the quantize cache key and
TensorRT-LLM's group sizes at recipe load (13), `eval ppl` on the whole-VLM AWQ checkpoint (15)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import cli, cli_json, write_recipe
from tiny_models import make_image, make_internvl, make_llava, make_qwen2_vl
from tiny_llava_anyres import make_llava_next, make_llava_onevision


# ---- item 10 ------------------------------------------------------------------------------------
def test_onnx_validation_is_relative_to_the_features_magnitude(tmp_path, capsys):
    """A projector whose outputs are in the thousands (real ones reach the tens): float32 rounding alone
    puts the absolute difference above 1e-4; the export is still correct and must pass."""
    from safetensors.torch import load_file, save_file

    ckpt = make_llava(tmp_path / "ckpt", seed=4)
    f = ckpt / "model.safetensors"
    state = load_file(str(f))
    for k in list(state):
        if "multi_modal_projector.linear_2" in k:
            state[k] = state[k] * 3000.0
    save_file(state, str(f), metadata={"format": "pt"})
    recipe = write_recipe(tmp_path / "r.yaml", ckpt)
    res = cli_json("build", recipe, "-o", tmp_path / "eng", "--until", "export-vision", "--json", capsys=capsys)
    info = {s["name"]: s for s in res["stages"]}["export-vision"]["info"]
    assert info["feature_scale"] > 100
    assert info["max_abs_error"] > 1e-4  # what the old absolute rule rejected
    assert info["max_rel_error"] <= 1e-4 and info["cosine"] > 0.9999
    assert math.isclose(info["max_rel_error"], info["max_abs_error"] / info["feature_scale"], rel_tol=1e-9)
    # an absolute bound can still be asked for, and then it holds
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", "--until", "export-vision", "--set",
                       "vision.max_abs_error=1e-6", capsys=capsys, expect=7)
    assert "max abs error" in err and "limit 1e-06" in err


# ---- item 11 ------------------------------------------------------------------------------------
MAKERS = {
    "llava": lambda p: make_llava(p, seed=5),
    "llava-next": lambda p: make_llava_next(p, seed=5),
    "llava-onevision": lambda p: make_llava_onevision(p, seed=5),
    "qwen2-vl": lambda p: make_qwen2_vl(p, version="2", seed=5),
    "qwen2.5-vl": lambda p: make_qwen2_vl(p, version="2.5", seed=5),
    "internvl": lambda p: make_internvl(p, seed=5),
}


def _variant(src, dst, *, top: bool, text: bool, keep_lm_head: bool):
    """A copy of an untied checkpoint with the tie flags set and lm_head kept or dropped."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = top
    cfg["text_config"]["tie_word_embeddings"] = text
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        state = load_file(str(f))
        if not keep_lm_head:
            state = {k: v for k, v in state.items() if "lm_head" not in k}
        save_file(state, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", list(MAKERS))
def test_tied_and_untied_lm_head_follow_transformers(family, tmp_path):
    """transformers is the oracle: whether it ties lm_head (the top-level flag, after the config class's
    own back-compat rule) and its whole-VLM logits on text. Each variant converts, and the converted
    decoder gives the same logits; when transformers would have to invent an lm_head (untied, none
    stored), convert refuses instead. Variants: InternVL's default config (top true, text false, no
    lm_head stored), InternVL3-8B's (top true, text false, its own lm_head), untied, and a text config
    that says true under a top-level false (some config classes lift it, some do not)."""
    from transformers import AutoModelForImageTextToText

    from vlmctl.convert import convert_checkpoint
    from vlmctl.errors import CheckpointError
    from vlmctl.runtime.decoder import TorchDecoder

    base = MAKERS[family](tmp_path / "base")
    ids = torch.tensor([[3, 17, 42, 9, 28, 11, 5, 30]])
    variants = {"top-ties-text-not": dict(top=True, text=False, keep_lm_head=False),
                "own-lm-head-wins": dict(top=True, text=False, keep_lm_head=True),
                "untied": dict(top=False, text=False, keep_lm_head=True),
                "text-ties-top-not": dict(top=False, text=True, keep_lm_head=False)}
    outcomes = {}
    for name, v in variants.items():
        ck = _variant(base, tmp_path / name, **v)
        ref_model = AutoModelForImageTextToText.from_pretrained(str(ck), dtype=torch.float32).eval()
        tied_ref = ref_model.get_output_embeddings().weight is ref_model.get_input_embeddings().weight
        ws = tmp_path / f"{name}-ws"
        if not v["keep_lm_head"] and not tied_ref:
            with pytest.raises(CheckpointError, match="lm_head"):
                convert_checkpoint(ck, ws, "float32")
            outcomes[name] = "refused"
            continue
        with torch.no_grad():
            ref = ref_model(input_ids=ids).logits
        convert_checkpoint(ck, ws, "float32")
        text_cfg = json.loads((ws / "llm" / "config.json").read_text())
        assert text_cfg["tie_word_embeddings"] == tied_ref, (name, text_cfg["tie_word_embeddings"], tied_ref)
        dec = TorchDecoder.from_hf_dir(ws / "llm", dtype="float32", max_seq=16)
        with torch.no_grad():
            got = dec.logits(ids)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"{family} {name}")
        outcomes[name] = "tied" if tied_ref else "untied"
    # the cases the issue names: top-level true ties; a stored lm_head stays its own
    assert outcomes["top-ties-text-not"] == "tied" and outcomes["own-lm-head-wins"] == "untied"
    assert outcomes["untied"] == "untied"


# ---- item 13 ------------------------------------------------------------------------------------
def test_changing_a_calibration_image_reruns_quantize(tiny_llava, tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    make_image(40, (30, 28)).save(calib / "c0.png")
    (calib / "data.jsonl").write_text(json.dumps({"image": "c0.png", "text": "describe the picture."}) + "\n"
                                      + json.dumps({"text": "a text-only record about the sea."}) + "\n")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava, quantization={
        "method": "awq", "group_size": 32, "calibration": {"data": "calib/data.jsonl", "samples": 1,
                                                            "seq_len": 24}})
    eng = tmp_path / "eng"

    def quantize_cached():
        res = cli_json("build", recipe, "-o", eng, "--until", "quantize", "--json", capsys=capsys)
        return {s["name"]: s for s in res["stages"]}["quantize"]["cached"]

    assert quantize_cached() is False
    assert quantize_cached() is True
    make_image(41, (30, 28)).save(calib / "c0.png")  # same name, other pixels
    assert quantize_cached() is False
    assert quantize_cached() is True


@pytest.mark.parametrize("group,ok", [(32, False), (64, True), (128, True)])
def test_trtllm_group_size_is_refused_at_recipe_load(tiny_llava, tmp_path, capsys, group, ok):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava, decoder={"backend": "trtllm"}, dtype="float16",
                          quantization={"method": "awq", "group_size": group})
    from vlmctl.recipe import load_recipe

    if ok:
        assert load_recipe(recipe).quantization.group_size == group
        return
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", "--dry-run", capsys=capsys, expect=2)
    assert "quantization.group_size 32" in err and "TensorRT-LLM" in err and "64 or 128" in err
    code, _, err = cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys, expect=2)
    assert not (tmp_path / "eng" / "quantize").exists() and not (tmp_path / "eng" / "convert").exists()


# ---- item 15 ------------------------------------------------------------------------------------
def test_eval_ppl_reads_the_whole_vlm_awq_checkpoint(tiny_llava, tmp_path, capsys):
    data = tmp_path / "eval.txt"
    data.write_text(" ".join(f"the quick brown fox {i} jumps over the lazy dog." for i in range(60)))
    out = tmp_path / "q"
    cli("quantize", tiny_llava, "-o", out, "--group-size", "32", "--calib-samples", "2", "--calib-seq-len", "32",
        "--dtype", "float32", capsys=capsys)
    vlm = cli_json("eval", "ppl", out / "vlm", "--data", data, "--seq-len", "32", "--samples", "3", "--json",
                   capsys=capsys)
    llm = cli_json("eval", "ppl", out / "llm", "--data", data, "--seq-len", "32", "--samples", "3", "--json",
                   capsys=capsys)
    assert vlm["quantization"] == "awq" and vlm["samples"] == 3
    assert vlm["perplexity"] == pytest.approx(llm["perplexity"], rel=1e-5)  # the same decoder, read two ways
    f = cli_json("eval", "ppl", tiny_llava, "--data", data, "--seq-len", "32", "--samples", "3", "--json",
                 capsys=capsys)  # a float whole-VLM checkpoint too
    assert f["quantization"] == "none" and f["perplexity"] != vlm["perplexity"]
    code, _, err = cli("eval", "ppl", out / "vlm", "--data", tmp_path / "missing.txt", capsys=capsys, expect=5)
    assert "no such evaluation file" in err and "calibration" not in err
