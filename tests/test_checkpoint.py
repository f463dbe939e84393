"""Checkpoint files: sharded writing (the index transformers reads), the lazy reader, and sharded AWQ
output read back by vlmctl's runtime and by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from vlmctl.checkpoint import ShardWriter, TensorReader, iter_tensors, weight_files
from vlmctl.errors import CheckpointError


def _tensors(n=5, rows=64):
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(rows, 16, generator=g) for i in range(n)}


def test_shards_and_their_index(tmp_path):
    tensors = _tensors()
    one = tensors["layer.0.weight"].numel() * 4
    w = ShardWriter(tmp_path / "out", max_bytes=2 * one)  # two tensors per shard
    for k, v in tensors.items():
        w.add(k, v)
    files = w.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * one
    assert index["weight_map"] == {f"layer.{i}.weight": files[i // 2].name for i in range(5)}
    assert not list((tmp_path / "out").glob(".shard-*"))
    assert weight_files(tmp_path / "out") == files
    back = {k: t for k, t, _ in iter_tensors(tmp_path / "out")}
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    reader = TensorReader(tmp_path / "out")
    assert reader.names() == list(tensors) and reader.shape("layer.3.weight") == (64, 16)
    assert torch.equal(reader.get("layer.4.weight"), tensors["layer.4.weight"])
    reader.release()  # closed files reopen on the next access
    assert torch.equal(reader.get("layer.1.weight"), tensors["layer.1.weight"])
    with pytest.raises(CheckpointError, match="missing from the checkpoint"):
        reader.get("nope")


def test_one_shard_is_model_safetensors(tmp_path):
    w = ShardWriter(tmp_path / "out")
    for k, v in _tensors(2).items():
        w.add(k, v)
    assert [f.name for f in w.close()] == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_missing_shard_is_named(tmp_path):
    w = ShardWriter(tmp_path / "out", max_bytes=1)
    for k, v in _tensors(3).items():
        w.add(k, v)
    files = w.close()
    files[1].unlink()
    with pytest.raises(CheckpointError, match=files[1].name):
        weight_files(tmp_path / "out")


def test_sharded_awq_checkpoint_reads_back(tmp_path, monkeypatch):
    """AWQ output written in several shards holds the same tensors as one file, and loads in vlmctl's
    runtime and (as a float model dequantized by the AWQ reference) in transformers' sharded loader."""
    from test_awq_quantize import calib_file, dequantized_state, float_model, heldout_ids, make_tiny_llama, settings
    from vlmctl.checkpoint import load_state_dict
    from vlmctl.quant import awq
    from vlmctl.runtime.decoder import TorchDecoder

    src = make_tiny_llama(tmp_path / "src", layers=2)
    data = calib_file(tmp_path)
    awq.quantize_causal_lm(src, tmp_path / "one", settings(data, samples=2, seq_len=32), base_dir=tmp_path)
    monkeypatch.setattr(awq, "SHARD_BYTES", 64 << 10)
    awq.quantize_causal_lm(src, tmp_path / "many", settings(data, samples=2, seq_len=32), base_dir=tmp_path)
    assert len(weight_files(tmp_path / "many")) > 2
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    one, many = load_state_dict(tmp_path / "one"), load_state_dict(tmp_path / "many")
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    ids = heldout_ids(src)
    got = TorchDecoder.from_hf_dir(tmp_path / "many").logits(ids)
    with torch.no_grad():
        ref = float_model(src, dequantized_state(tmp_path / "many"))(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # transformers' own loader follows the index too (a float copy, written sharded by vlmctl's writer)
    from transformers import LlamaForCausalLM

    w = ShardWriter(tmp_path / "float", max_bytes=64 << 10)
    for k, v in load_state_dict(src).items():
        w.add(k, v)
    w.close()
    (tmp_path / "float" / "config.json").write_text((src / "config.json").read_text())
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, float_model(src)(ids).logits, rtol=0, atol=0)
