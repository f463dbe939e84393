"""Conversion: every tensor checked; the decoder stands alone as a HF causal LM."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vlmctl.convert import convert_checkpoint
from vlmctl.errors import CheckpointError


def test_decoder_loads_alone_and_matches_the_vlm(tiny_llava, tmp_path):
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    info = convert_checkpoint(tiny_llava, tmp_path / "w", "float32")
    assert info["family"] == "llava" and info["vision_tensors"] > 0 and info["decoder_tensors"] > 0
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "w" / "llm", dtype=torch.float32).eval()
    vlm = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 20, 33, 40]])
    with torch.no_grad():
        a = lm(input_ids=ids).logits
        b = vlm(input_ids=ids).logits
    assert torch.equal(a, b)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "w" / "llm")("hello")["input_ids"]


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def key(sd, suffix):
    return next(k for k in sd if k.endswith(suffix))


@pytest.mark.parametrize("edit,fragment", [
    (lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(2)), "unexpected tensor 'model.extra.weight'"),
    (lambda sd: sd.pop(key(sd, "model.norm.weight")), "missing from the checkpoint"),
    (lambda sd: sd.__setitem__(key(sd, "lm_head.weight"), torch.zeros(3, 3)), "has shape (3, 3)"),
    (lambda sd: sd.__setitem__(key(sd, "lm_head.weight"), sd[key(sd, "lm_head.weight")].to(torch.int32)),
     "expected floating point"),
])
def test_tensor_checks(tiny_llava, tmp_path, edit, fragment):
    ck = _rewrite(tiny_llava, tmp_path / "ck", edit)
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(ck, tmp_path / "w", "float32")
    assert fragment in str(e.value)


def test_both_tensor_name_layouts(tiny_llava, tmp_path):
    """Hub checkpoints use the legacy names (language_model.model.*); transformers' in-memory names
    (model.language_model.*) must convert to the same bytes."""
    from vlmctl.models.llava import LlavaFamily

    def current(sd):
        for k in list(sd):
            sd[LlavaFamily().canonical_key(k)] = sd.pop(k)

    ck = _rewrite(tiny_llava, tmp_path / "ck", current)
    from safetensors import safe_open

    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.") for n in names)
    convert_checkpoint(ck, tmp_path / "a", "float32")
    convert_checkpoint(tiny_llava, tmp_path / "b", "float32")
    for part in ("vision", "llm"):
        assert (tmp_path / "a" / part / "model.safetensors").read_bytes() == \
            (tmp_path / "b" / part / "model.safetensors").read_bytes()


def test_dtype_cast(tiny_llava, tmp_path):
    from safetensors import safe_open

    convert_checkpoint(tiny_llava, tmp_path / "w", "float16")
    with safe_open(str(tmp_path / "w" / "llm" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    assert json.loads((tmp_path / "w" / "llm" / "config.json").read_text())["torch_dtype"] == "float16"
