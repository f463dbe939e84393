"""`vlmctl convert` and `vlmctl quantize` as a user meets them: output paths that would destroy or pollute the
source checkpoint, a malformed shard index, an empty --calib-data. Each refusal is one `error:` line with the
README's exit code, and leaves the source as it was and nothing new beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import cli, file_snapshot, one_error_line
from vlmctl.errors import CheckpointError, InputError, OptionError

SMALL = ("--group-size", "32", "--calib-samples", "2", "--calib-seq-len", "16")


def _tree(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))


# ---- output paths that hold the source -----------------------------------------------------------------
@pytest.mark.parametrize("stage_dir", ["convert", "quantize/model"])
def test_convert_refuses_a_source_inside_a_stage_directory_of_the_output(tiny_llava, tmp_path, capsys, stage_dir):
    # `vlmctl convert ./convert -o .` used to publish the stage over the source: the checkpoint was deleted.
    src = tmp_path / stage_dir
    src.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_llava, src)
    before, tree = file_snapshot(src), _tree(tmp_path)
    for json_ in ([], ["--json"]):
        code, out, err = cli("convert", src, "-o", tmp_path, *json_, capsys=capsys, expect=None)
        line = one_error_line(code, err, OptionError.exit_code)
        assert str(src) in line and out == ""
    assert file_snapshot(src) == before and _tree(tmp_path) == tree  # the checkpoint intact, nothing written


def test_quantize_refuses_an_output_that_holds_or_lies_in_the_source(tiny_llava, tmp_path, capsys):
    src = tmp_path / "models" / "llava"
    shutil.copytree(tiny_llava, src)
    before, tree = file_snapshot(src), _tree(tmp_path)
    # -o the source's parent with --force used to replace that directory: the source checkpoint was deleted
    code, _, err = cli("quantize", src, "-o", src.parent, "--force", *SMALL, capsys=capsys, expect=None)
    assert "holds the source" in one_error_line(code, err, InputError.exit_code)
    # -o inside the source used to write the quantized checkpoint among the source's files
    code, out, err = cli("quantize", src, "-o", src / "awq", *SMALL, "--json", capsys=capsys, expect=None)
    assert "inside the source" in one_error_line(code, err, InputError.exit_code) and out == ""
    assert file_snapshot(src) == before and _tree(tmp_path) == tree


def test_quantize_force_onto_a_file_is_refused_and_leaves_nothing(tiny_llava, tmp_path, capsys):
    # used to replace the file and leave its `.out.old-HOST-PID` trash file beside the output
    target = tmp_path / "out"
    target.write_text("mine\n")
    for force in ([], ["--force"]):
        code, _, err = cli("quantize", tiny_llava, "-o", target, *force, *SMALL, capsys=capsys, expect=None)
        assert "is a file" in one_error_line(code, err, InputError.exit_code)
    assert _tree(tmp_path) == ["out"] and target.read_text() == "mine\n"


# ---- a malformed shard index ---------------------------------------------------------------------------
@pytest.mark.parametrize("index", [b"[1]", b'{"weight_map": ["model.safetensors"]}', b'{"weight_map": {"a": 1}}',
                                   b'{"metadata": {}}', b"\x89PNG\r\n\x1a\n\x00\x00"])
def test_convert_malformed_shard_index_is_a_checkpoint_error(tiny_llava, tmp_path, capsys, index):
    # each was a TypeError / AttributeError / UnicodeDecodeError traceback (exit 1)
    src = tmp_path / "src"
    shutil.copytree(tiny_llava, src)
    (src / "model.safetensors.index.json").write_bytes(index)
    for json_ in ([], ["--json"]):
        code, out, err = cli("convert", src, "-o", tmp_path / "w", *json_, capsys=capsys, expect=None)
        line = one_error_line(code, err, CheckpointError.exit_code)
        assert "model.safetensors.index.json: invalid index" in line and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no work directory left


def test_a_valid_index_still_reads(tiny_llava, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_llava, src)
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    code, out, err = cli("convert", src, "-o", tmp_path / "w", "--json", capsys=capsys, expect=None)
    assert code == 0, err
    assert json.loads(out)["name"] == "convert"


# ---- config.json that is JSON but not an object ------------------------------------------------------------
@pytest.mark.parametrize("config", [b"[1, 2]", b'"llava"', b"null"])
def test_a_config_that_is_not_an_object_is_a_checkpoint_error(tiny_llava, tmp_path, capsys, config):
    # each was an AttributeError traceback (exit 1) from convert and from quantize
    src = tmp_path / "src"
    shutil.copytree(tiny_llava, src)
    (src / "config.json").write_bytes(config)
    for args in (("convert", src, "-o", tmp_path / "w"), ("quantize", src, "-o", tmp_path / "q", *SMALL)):
        code, out, err = cli(*args, capsys=capsys, expect=None)
        assert "config.json: not a JSON object" in one_error_line(code, err, CheckpointError.exit_code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---- calibration data ----------------------------------------------------------------------------------
def test_quantize_empty_calib_data_names_the_option(tiny_llava, tmp_path, capsys):
    # was "error: : is a directory; expected a .txt or .jsonl file" ("" is the current directory)
    code, out, err = cli("quantize", tiny_llava, "-o", tmp_path / "q", *SMALL, "--calib-data", "", "--json",
                         capsys=capsys, expect=None)
    assert "calibration data is an empty name" in one_error_line(code, err, InputError.exit_code) and out == ""
    assert list(tmp_path.iterdir()) == []
