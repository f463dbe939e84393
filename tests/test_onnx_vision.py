"""The exported vision graph: ONNX Runtime == the torch wrapper == transformers' own image-feature path."""

from __future__ import annotations

import numpy as np
import torch

from vlmctl.models.registry import get_family


def test_onnx_matches_torch_and_hf_at_unseen_batch(tiny_llava_engine, tiny_llava):
    import onnxruntime as ort
    from transformers import LlavaForConditionalGeneration

    fam = get_family("llava")
    vision_dir = tiny_llava_engine / "convert" / "vision"
    module = fam.build_vision_module(vision_dir, torch.float32)
    cfg = __import__("json").loads((vision_dir / "config.json").read_text())
    for batch in (1, 5):  # export used 2, validation 3
        inputs = fam.example_vision_inputs(cfg, batch, torch.float32, seed=batch)
        sess = ort.InferenceSession(str(tiny_llava_engine / "export-vision" / "model.onnx"),
                                    providers=["CPUExecutionProvider"])
        got = sess.run(None, {"pixel_values": inputs["pixel_values"].numpy()})[0]
        with torch.no_grad():
            ref = module(inputs["pixel_values"]).numpy()
            hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
            hf_feats = fam.hf_image_features(hf, inputs).numpy()
        assert got.shape == ref.shape == hf_feats.shape
        assert np.max(np.abs(got - ref)) <= 1e-4
        assert np.max(np.abs(hf_feats - ref)) <= 1e-5


def test_validation_failure_is_a_stage_error(tiny_llava, tmp_path, capsys):
    from conftest import cli, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    code, _, err = cli("build", recipe, "-o", tmp_path / "e", "--until", "export-vision",
                       "--set", "vision.min_cosine=1.0", "--set", "vision.max_abs_error=1e-12", capsys=capsys,
                       expect=7)
    assert "ONNX Runtime output differs from torch" in err
    assert not (tmp_path / "e" / "export-vision").exists()
