"""`vlmctl quantize --awq` and `vlmctl eval ppl` end to end on tiny models; calibration and
perplexity helpers; the whole-VLM checkpoint and the AWQ engine on a tiny LLaVA."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import cli, cli_json, write_recipe
from test_awq_quantize import calib_file, make_tiny_llama
from tiny_models import make_image


# ---- calibration & perplexity ----------------------------------------------------------------
def _tok(tmp_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path / "m", layers=1))


def test_calibration_blocks_txt_and_jsonl(tmp_path):
    from vlmctl.quant.calibration import load_calibration

    tok = _tok(tmp_path)
    txt = calib_file(tmp_path)
    a = load_calibration(str(txt), tok, 4, 32)
    assert a.shape == (4, 32) and a.dtype == torch.long
    assert torch.equal(a, load_calibration(str(txt), tok, 4, 32))  # deterministic (seeded shuffle)
    assert not torch.equal(a, load_calibration(str(txt), tok, 4, 32, seed=1))
    lines = [ln for ln in txt.read_text().splitlines() if ln]
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": ln, "id": i}) for i, ln in enumerate(lines)) + "\n")
    assert torch.equal(a, load_calibration(str(jl), tok, 4, 32))  # same records, same blocks
    rel = load_calibration("calib.txt", tok, 4, 32, base_dir=tmp_path)  # relative to the recipe
    assert torch.equal(a, rel)


def test_calibration_short_data_and_errors(tmp_path):
    from vlmctl.errors import BackendUnavailableError, InputError
    from vlmctl.quant.calibration import load_calibration

    tok = _tok(tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    with pytest.raises(InputError, match="need at least one block"):
        load_calibration(str(short), tok, 4, 64)
    one_long = tmp_path / "long.txt"
    one_long.write_text("the quick brown fox jumps over the lazy dog " * 30 + "\n")
    assert load_calibration(str(one_long), tok, 100, 32).shape[1] == 32  # long records used when needed
    assert load_calibration(None, tok, 2, 32).shape == (2, 32)  # built-in text
    with pytest.raises(InputError, match="no such calibration file"):
        load_calibration(str(tmp_path / "missing.txt"), tok, 4, 32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"image": "a.png", "text": "x"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: image-text"):
        load_calibration(str(bad), tok, 1, 16)
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: invalid JSON"):
        load_calibration(str(bad), tok, 1, 16)
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="datasets"):
            load_calibration("some-org/some-dataset", tok, 1, 16)


def test_perplexity_protocol():
    from vlmctl.measure.perplexity import perplexity

    vocab = 7
    ids = torch.arange(100) % vocab
    uniform = lambda x: torch.zeros(*x.shape, vocab)  # noqa: E731
    assert perplexity(uniform, ids, seq_len=10, samples=5) == pytest.approx(vocab)

    def perfect(x):  # always predicts the next id of the cycle with certainty
        return torch.nn.functional.one_hot((x + 1) % vocab, vocab).float() * 100

    assert perplexity(perfect, ids, seq_len=10) == pytest.approx(1.0)


# ---- CLI on a causal LM ---------------------------------------------------------------------
def test_quantize_and_eval_cli(tmp_path, capsys):
    src = make_tiny_llama(tmp_path / "src")
    data = calib_file(tmp_path)
    out = tmp_path / "awq"
    res = cli_json("quantize", "--awq", src, "-o", out, "--group-size", "32", "--calib-data", data,
                   "--calib-samples", "4", "--calib-seq-len", "32", "--json", capsys=capsys)
    assert res["group_size"] == 32 and res["layers"] == 2 and res["output"] == str(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["version"] == "gemm"
    assert not list(tmp_path.glob(".awq.tmp-*"))

    f = cli_json("eval", "ppl", src, "--data", data, "--seq-len", "32", "--samples", "3", "--json", capsys=capsys)
    q = cli_json("eval", "ppl", out, "--data", data, "--seq-len", "32", "--samples", "3", "--json", capsys=capsys)
    assert f["quantization"] == "none" and q["quantization"] == "awq" and f["samples"] == 3
    assert math.isfinite(q["perplexity"]) and q["perplexity"] != f["perplexity"]
    _, o, _ = cli("eval", "ppl", out, "--data", data, "--seq-len", "32", "--samples", "3", capsys=capsys)
    assert o.startswith("perplexity: ")
    # a VLMCTL_* kernel setting with a bad value (this one is read when the W4A16 kernels' module is imported,
    # which loading an AWQ model does) is a setting like an option: one line naming it, exit code 2
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "VLMCTL_W4A16_DEQUANT_MIN_M": "lots"}
    proc = subprocess.run([sys.executable, "-m", "vlmctl", "eval", "ppl", str(out), "--data", str(data),
                           "--seq-len", "32", "--samples", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] == \
        ["error: VLMCTL_W4A16_DEQUANT_MIN_M='lots': expected an integer"], proc.stderr

    code, _, err = cli("quantize", src, "-o", out, capsys=capsys, expect=None)  # exists
    assert code == 5 and "already exists" in err and "Traceback" not in err
    code, _, err = cli("quantize", src, "-o", tmp_path / "g", "--group-size", "48", "--calib-data", data,
                       "--calib-samples", "2", "--calib-seq-len", "32", capsys=capsys, expect=None)
    assert code == 5 and "group size 48" in err and "valid group sizes for this model: 8, 16, 32, 64, 128" in err
    assert not (tmp_path / "g").exists()
    code, _, err = cli("quantize", src, "-o", tmp_path / "x", "--impl", "nope", capsys=capsys, expect=None)
    assert code == 2 and "quantization.impl" in err


# ---- VLM ------------------------------------------------------------------------------------------
def test_vlm_checkpoint_from_a_llava_checkpoint(tiny_llava, tmp_path, capsys):
    """A VLM checkpoint in, the decoder quantized (llm/) and a whole-VLM AWQ checkpoint (vlm/) out:
    vision tensors byte for byte, VLM tensor names, vision modules not converted."""
    from safetensors import safe_open
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from vlmctl.checkpoint import iter_tensors, load_state_dict
    from vlmctl.models.llava import LlavaFamily

    out = tmp_path / "q"
    cli("quantize", tiny_llava, "-o", out, "--group-size", "32", "--calib-samples", "2", "--calib-seq-len", "32",
        "--dtype", "float32", capsys=capsys)
    assert (out / "llm" / "config.json").exists() and (out / "vlm" / "config.json").exists()
    assert not (out / ".convert").exists()
    cfg = json.loads((out / "vlm" / "config.json").read_text())
    assert cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["quantization_config"]["modules_to_not_convert"] == ["vision_tower", "multi_modal_projector"]
    assert (out / "vlm" / "tokenizer.json").exists()
    vlm = load_state_dict(out / "vlm")
    fam = LlavaFamily()
    src = {fam.canonical_key(k): t for k, t, _ in iter_tensors(tiny_llava)}
    with torch.device("meta"):
        expected = LlavaForConditionalGeneration(LlavaConfig.from_dict(json.loads((tiny_llava / "config.json")
                                                                                  .read_text()))).state_dict()
    for name, t in vlm.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "qzeros", "scales"):
            assert base + ".weight" in expected and base.startswith("model.language_model.layers."), name
        else:
            assert name in expected, name
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            assert torch.equal(t, src[name]), name  # untouched
    with safe_open(str(out / "vlm" / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys() if "vision_tower" in k)


def test_awq_engine_matches_transformers_and_keeps_vision(tiny_llava, tiny_llava_engine, tmp_path, capsys):
    """`vlmctl build --set quantization.method=awq` + `vlmctl chat`: greedy tokens equal transformers
    on the dequantized decoder; the vision artifacts equal the unquantized build's."""
    import shutil

    from tiny_llava_anyres import dequantized_reference
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from vlmctl.models.llava import LlavaFamily

    eng = tmp_path / "eng"
    shutil.copytree(tiny_llava_engine, eng)  # convert and vision stages are cache hits
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava, limits={"max_batch_size": 8})  # as the session engine
    cli("build", recipe, "-o", eng, "--set", "quantization.method=awq", "--set", "quantization.group_size=32",
        "--set", "quantization.calibration.samples=4", "--set", "quantization.calibration.seq_len=32", capsys=capsys)
    manifest = json.loads((eng / "build-llm" / "manifest.json").read_text())
    assert manifest["info"]["quantization"] == "awq"
    for stage in ("convert", "export-vision", "build-vision"):
        a = json.loads((eng / stage / "manifest.json").read_text())["parts"]
        b = json.loads((tiny_llava_engine / stage / "manifest.json").read_text())["parts"]
        assert {k: v for k, v in a.items() if k != "llm"} == {k: v for k, v in b.items() if k != "llm"}, stage

    img = make_image(5, (40, 30))
    img.save(tmp_path / "img.png")
    prompt = "what is in this image?"
    got = cli_json("chat", eng, "--image", tmp_path / "img.png", "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", "12", "--json", capsys=capsys)
    model = dequantized_reference(LlavaForConditionalGeneration, tiny_llava, eng / "quantize" / "llm", LlavaFamily())
    proc = AutoProcessor.from_pretrained(tiny_llava)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    inputs = proc(images=[img], text=proc.apply_chat_template(messages, add_generation_prompt=True),
                  return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    ref = ref[: ref.index(2)] if 2 in ref else ref
    assert got["token_ids"] == ref
    # `vlmctl eval ppl` accepts the engine directory (its build-llm layout)
    data = calib_file(tmp_path)
    e = cli_json("eval", "ppl", eng, "--data", data, "--seq-len", "32", "--samples", "2", "--json", capsys=capsys)
    assert e["kind"] == "engine" and e["quantization"] == "awq" and math.isfinite(e["perplexity"])


def test_quantize_a_work_directory(tiny_llava, tmp_path, capsys):
    """`vlmctl quantize WORKDIR` runs the work directory's quantize stage: the recipe there gains the
    options, the output has a manifest and is a cache hit the second time, -o is refused, and the
    next build-llm builds on the quantized decoder. A conversion workspace (its convert/) is quantized
    the same way into -o."""
    wd = tmp_path / "w"
    cli("convert", tiny_llava, "-o", wd, "--set", "dtype=float32", capsys=capsys)
    args = ("--group-size", "32", "--calib-samples", "2", "--calib-seq-len", "32", "--json")
    first = cli_json("quantize", wd, *args, capsys=capsys)
    assert first["name"] == "quantize" and not first["cached"] and first["threads"] >= 1
    assert {"llm/config.json", "vlm/config.json"} <= set(first["outputs"])
    manifest = json.loads((wd / "quantize" / "manifest.json").read_text())
    assert manifest["settings"]["group_size"] == 32 and manifest["info"]["vlm"]["vision_tensors"] > 0
    recipe = json.loads((wd / "recipe.json").read_text())
    assert recipe["quantization"]["method"] == "awq" and recipe["quantization"]["group_size"] == 32
    assert cli_json("quantize", wd, *args, capsys=capsys)["cached"]
    code, _, err = cli("quantize", wd, "-o", tmp_path / "elsewhere", capsys=capsys, expect=None)
    assert code == 2 and "work directory" in err and not (tmp_path / "elsewhere").exists()  # the command line
    llm = cli_json("build-llm", wd, "--json", capsys=capsys)
    cfg = json.loads((wd / "build-llm" / "config.json").read_text())
    assert cfg["decoder"]["quantization"]["method"] == "awq" and llm["info"]["quantization"] == "awq"
    # the workspace itself (no recipe.json there) goes into -o, published whole
    ws = cli_json("quantize", wd / "convert", "-o", tmp_path / "q", *args, capsys=capsys)
    assert ws["output"] == str(tmp_path / "q") and (tmp_path / "q" / "vlm" / "config.json").exists()
    assert not list(tmp_path.glob(".q.*"))


def test_eval_command_line_mistakes_have_readmes_exit_codes(tiny_llava_engine, tmp_path, capsys):
    from conftest import cli

    data = tmp_path / "t.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    code, _, err = cli("eval", "ppl", tmp_path / "nothere", "--data", data, capsys=capsys, expect=None)
    assert code == 3 and "no such model directory" in err  # a missing directory is a checkpoint problem
    # a window longer than the model's positions: one line (it was an IndexError from the rotary table)
    code, _, err = cli("eval", "ppl", tiny_llava_engine, "--data", data, "--seq-len", "100000", "--samples", "1",
                       capsys=capsys, expect=None)
    assert code == 2 and "--seq-len 100000: longer than this model's" in err and "Traceback" not in err, err


def test_eval_dtype_other_than_the_engines_is_refused(tiny_llava_engine, tiny_llava, tmp_path, capsys):
    """--dtype is for Hugging Face directories: an engine runs in the dtype it was built in, so another --dtype
    is one line and exit 2 (it was ignored without a word); the engine's own dtype is accepted."""
    data = tmp_path / "t.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ("--data", data, "--seq-len", "32", "--samples", "2")
    code, out, err = cli("eval", "ppl", tiny_llava_engine, *args, "--dtype", "float16", capsys=capsys, expect=2)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err and "perplexity" not in out, err
    assert errors[0] == (f"error: --dtype float16: {tiny_llava_engine} is an engine built in float32; --dtype applies "
                         "to Hugging Face directories only (drop it, or rebuild the engine with --set dtype=...)")
    same = cli_json("eval", "ppl", tiny_llava_engine, *args, "--dtype", "float32", "--json", capsys=capsys)
    default = cli_json("eval", "ppl", tiny_llava_engine, *args, "--json", capsys=capsys)
    assert same["kind"] == "engine" and same["perplexity"] == default["perplexity"]
    hf = cli_json("eval", "ppl", tiny_llava, *args, "--dtype", "bfloat16", "--json", capsys=capsys)  # HF: honored
    assert hf["kind"] == "hf-vlm" and math.isfinite(hf["perplexity"])
