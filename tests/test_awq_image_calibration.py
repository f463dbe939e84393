"""Image-text calibration: a JSONL with images runs the VLM front end, so the decoder is calibrated
on embeddings that contain the image features."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import make_image


def _jsonl(tmp_path, n_images=3):
    recs = []
    for i in range(n_images):
        make_image(40 + i, (30 + 7 * i, 28)).save(tmp_path / f"c{i}.png")
        recs.append({"image": f"c{i}.png", "text": f"describe picture number {i} in one sentence."})
    recs.append({"text": "a text-only record about the weather and the sea."})
    p = tmp_path / "calib.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return p


def test_embeddings_carry_the_image_features(tiny_llava, tmp_path):
    from PIL import Image

    from vlmctl.convert import convert_checkpoint
    from vlmctl.models.llava import LlavaFamily
    from vlmctl.quant.awq import embedding_weight
    from vlmctl.quant.vlm_calibration import calibration_files, image_text_embeddings, read_image_text_records

    ws = tmp_path / "ws"
    convert_checkpoint(tiny_llava, ws, "float32")
    data = _jsonl(tmp_path, n_images=1)
    records = read_image_text_records(str(data))
    assert records is not None and records[0]["images"] == [tmp_path / "c0.png"]
    assert calibration_files(str(data)) == [data, tmp_path / "c0.png"]
    x = image_text_embeddings(ws, records[:1], samples=1, seq_len=20)
    assert x.shape == (1, 20, 64)

    fam = LlavaFamily()
    proc = fam.load_processor(ws / "processor")
    prompt = proc.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": records[0]["text"]}]}],
                         [Image.open(tmp_path / "c0.png").convert("RGB")])
    module = fam.build_vision_module(ws / "vision", torch.float32)
    with torch.no_grad():
        feats = module(torch.from_numpy(prompt.images[0].inputs["pixel_values"]))[0]
    ids = torch.tensor(prompt.token_ids)
    mask = ids == prompt.image_placeholder_id
    emb = embedding_weight(ws / "llm").float()
    expected = emb[ids.clamp(max=emb.shape[0] - 1)]
    expected[mask] = feats
    torch.testing.assert_close(x[0], expected[:20])
    assert mask[:20].sum() >= 8  # the block holds image rows (the prompt starts with a few text tokens)


def test_quantize_a_vlm_with_image_text_calibration(tiny_llava, tmp_path, capsys):
    from conftest import cli_json

    data = _jsonl(tmp_path)
    res = cli_json("quantize", tiny_llava, "-o", tmp_path / "q", "--group-size", "32", "--calib-data", data,
                   "--calib-samples", "2", "--calib-seq-len", "24", "--dtype", "float32", "--json", capsys=capsys)
    assert res["calibration"]["image_text"] is True and res["calibration"]["samples"] == 2
    assert (tmp_path / "q" / "vlm" / "model.safetensors").exists()


def test_image_records_need_a_vlm(tmp_path):
    from test_awq_quantize import make_tiny_llama, settings

    from vlmctl.errors import InputError
    from vlmctl.quant.awq import quantize_causal_lm

    src = make_tiny_llama(tmp_path / "src", layers=1)
    data = _jsonl(tmp_path)
    with pytest.raises(InputError, match="need a VLM"):
        quantize_causal_lm(src, tmp_path / "out", settings(data))
