"""Whole-model cross-check against AutoAWQ 0.2.9 (skips when `autoawq` is not importable).

Both quantizers get the same tiny Llama (float32, outlier channels) and the same calibration
tokens, both in float32 (vlmctl on the CPU with its exact search; AutoAWQ with vlmctl's fix for
its CPU weight-backup bug), so any difference is the implementation, not rounding: the packed
checkpoints must agree group for group.
The CLI's `--impl autoawq` path is exercised end to end as well.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_awq_quantize import GROUP, calib_file, dequantized_state, float_model, heldout_ids, make_tiny_llama, settings


def _need_autoawq():
    from vlmctl.quant.autoawq_impl import import_autoawq

    try:
        import_autoawq()
    except Exception as e:
        pytest.skip(f"autoawq is not importable here ({e})")


@pytest.mark.parametrize("duo", [True, False], ids=["duo", "x-only"])
def test_same_checkpoint_as_autoawq_in_float32(tmp_path, monkeypatch, duo):
    from vlmctl.checkpoint import load_state_dict
    from vlmctl.quant.autoawq_impl import quantize_with_autoawq
    from vlmctl.quant.awq import quantize_causal_lm
    from vlmctl.quant.calibration import load_calibration
    from vlmctl.formats.awq_gemm import dequantize_gemm
    from transformers import AutoTokenizer

    _need_autoawq()
    monkeypatch.setenv("VLMCTL_AWQ_EXACT", "1")  # float32 searches, not bf16 deltas
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # AutoAWQ would move to a GPU
    src = make_tiny_llama(tmp_path / "src")
    s = settings(calib_file(tmp_path), samples=4, seq_len=64, duo_scaling=duo)
    ids = load_calibration(s.calibration.data, AutoTokenizer.from_pretrained(src), 4, 64, tmp_path)
    quantize_causal_lm(src, tmp_path / "vlmctl", s, calib_ids=ids, device="cpu")
    quantize_with_autoawq(src, tmp_path / "autoawq", s.model_copy(update={"impl": "autoawq"}), calib_ids=ids,
                          dtype="float32")

    ours, theirs = load_state_dict(tmp_path / "vlmctl"), load_state_dict(tmp_path / "autoawq")
    qweights = [k for k in ours if k.endswith(".qweight")]
    assert len(qweights) == 14 and set(qweights) <= set(theirs)
    for k in qweights:
        base = k[: -len(".qweight")]
        # the group scales agree to fp16 rounding (vlmctl rounds codes and zero points against the
        # stored fp16 scale, AutoAWQ its zero points against the float32 one) ...
        torch.testing.assert_close(ours[base + ".scales"].float(), theirs[base + ".scales"].float(),
                                   rtol=2e-3, atol=1e-6, msg=base)
        a = dequantize_gemm(ours[k], ours[base + ".qzeros"], ours[base + ".scales"], 4, GROUP)
        b = dequantize_gemm(theirs[k], theirs[base + ".qzeros"], theirs[base + ".scales"], 4, GROUP)
        steps = (a - b).abs() / ours[base + ".scales"].float().t().repeat_interleave(GROUP, 1)
        # ... so the weights are the same up to a rounding tie (one step) in a few elements
        assert steps.max() < 1.01 and (steps > 0.5).float().mean() < 0.01, (base, steps.max().item())

    # and the two models compute the same thing on held-out text
    x = heldout_ids(src)
    with torch.no_grad():
        a = float_model(src, dequantized_state(tmp_path / "vlmctl"))(x).logits
        b = float_model(src, dequantized_state(tmp_path / "autoawq"))(x).logits
        ref = float_model(src)(x).logits
    assert (a - b).pow(2).mean() < 0.2 * (a - ref).pow(2).mean()  # far closer to each other than to float


def test_cli_impl_autoawq(tmp_path, capsys):
    from conftest import cli_json
    from vlmctl.runtime.decoder import TorchDecoder

    _need_autoawq()
    src = make_tiny_llama(tmp_path / "src")
    data = calib_file(tmp_path)
    out = cli_json("quantize", "--awq", src, "-o", tmp_path / "q", "--impl", "autoawq", "--group-size", GROUP,
                   "--calib-data", data, "--calib-samples", 2, "--calib-seq-len", 32, "--json", capsys=capsys)
    assert out["impl"] == "autoawq" and out["backend"] == "autoawq" and out["autoawq_cpu_backup_fix"] is True
    q = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "awq" and q["group_size"] == GROUP and str(q["version"]).lower() == "gemm"
    logits = TorchDecoder.from_hf_dir(tmp_path / "q").logits(heldout_ids(src))
    assert torch.isfinite(logits).all()


def test_cli_impl_autoawq_on_shapes_it_cannot_take_is_one_line(tmp_path, capsys):
    """AutoAWQ's clip search asserts that a linear's outputs come in 64s: one KV head of 32 dims fails it,
    which is one error line (exit 4, naming the way out), not AutoAWQ's traceback."""
    from conftest import cli

    _need_autoawq()
    src = make_tiny_llama(tmp_path / "src", kv_heads=1)
    code, _, err = cli("quantize", "--awq", src, "-o", tmp_path / "q", "--impl", "autoawq", "--group-size", GROUP,
                       "--calib-data", calib_file(tmp_path), "--calib-samples", 2, "--calib-seq-len", 32,
                       capsys=capsys, expect=None)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 4 and len(lines) == 1 and "quantization.impl: vlmctl" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "q").exists()
