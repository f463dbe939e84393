"""`vlmctl export-vision`, `build-vision` and `build-llm` as a user meets them: a work directory whose
recipe.json or an earlier stage's manifest was damaged, an earlier stage's files gone, a vision.opset the
exporter cannot write, a file given for the work directory. Each refusal is one `error:` line with the
README's exit code, nothing on stdout under --json, and the work directory left as it was (no temporaries,
no partial stage directory, the recipe unchanged)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import cli, file_snapshot, one_error_line
from vlmctl.errors import RecipeError, StageError

STAGE_COMMANDS = ("export-vision", "build-vision", "build-llm")


@pytest.fixture(scope="module")
def built(tiny_llava, tmp_path_factory) -> Path:
    """A work directory of the tiny LLaVA with every stage run (float16, embedded backends)."""
    w = tmp_path_factory.mktemp("stages") / "w"
    cli("convert", tiny_llava, "-o", w)
    for stage in STAGE_COMMANDS:
        cli(stage, w)
    return w


@pytest.fixture
def work(built, tmp_path) -> Path:
    """A private copy of the work directory, for tests that damage it."""
    w = tmp_path / "w"
    shutil.copytree(built, w, symlinks=True)
    return w


def _refused(capsys, work: Path, stage: str, expect_code: int, *args: str) -> str:
    """`vlmctl STAGE WORK ARGS --json` fails with one error line, prints nothing on stdout, changes nothing."""
    before = file_snapshot(work)
    code, out, err = cli(stage, work, *args, "--json", capsys=capsys, expect=None)
    line = one_error_line(code, err, expect_code)
    assert out == ""
    assert file_snapshot(work) == before  # no temporaries, no partial stage directory, the recipe as it was
    return line


# ---- recipe.json ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00", b"null", b'"text"'],
                         ids=["not-json", "a-list", "not-utf8", "null", "a-string"])
@pytest.mark.parametrize("stage", STAGE_COMMANDS)
def test_a_damaged_recipe_json_is_an_invalid_recipe(work, capsys, stage, content):
    # It used to be a JSONDecodeError / UnicodeDecodeError traceback (exit 1), and with --set an
    # AttributeError ('list' object has no attribute 'get') from applying the override.
    (work / "recipe.json").write_bytes(content)
    for sets in ([], ["--set", "limits.max_batch_size=2"]):
        line = _refused(capsys, work, stage, RecipeError.exit_code, *sets)
        assert "recipe.json" in line


def test_a_file_given_for_the_work_directory_says_it_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x\n")
    for stage in STAGE_COMMANDS:
        code, out, err = cli(stage, f, "--json", capsys=capsys, expect=None)
        line = one_error_line(code, err, StageError.exit_code)
        assert "is a file" in line and "no such" not in line and out == ""
    assert f.read_text() == "x\n" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ---- an earlier stage's output damaged -----------------------------------------------------------------
def _edit_manifest(path: Path, edit) -> None:
    m = json.loads(path.read_text())
    path.write_text(json.dumps(edit(m)))


@pytest.mark.parametrize("damage", ["a-list", "no-parts", "parts-not-a-mapping"])
@pytest.mark.parametrize("stage", STAGE_COMMANDS)
def test_a_damaged_convert_manifest_names_the_stage_to_rerun(work, capsys, stage, damage):
    # A manifest that is JSON but not an object, or has no `parts`, used to be a TypeError / KeyError traceback.
    path = work / "convert" / "manifest.json"
    if damage == "a-list":
        path.write_text("[1]")
    elif damage == "no-parts":
        _edit_manifest(path, lambda m: {k: v for k, v in m.items() if k != "parts"})
    else:
        _edit_manifest(path, lambda m: {**m, "parts": "llm vision"})
    line = _refused(capsys, work, stage, StageError.exit_code)
    assert "convert" in line


def test_a_damaged_export_vision_manifest_names_the_stage_to_rerun(work, capsys):
    (work / "export-vision" / "manifest.json").write_text("[]")
    assert "export-vision" in _refused(capsys, work, "build-vision", StageError.exit_code)


@pytest.mark.parametrize("stage", STAGE_COMMANDS)
def test_a_family_json_that_is_not_an_object_is_a_damaged_convert(work, capsys, stage):
    # It used to be an AttributeError traceback ('list' object has no attribute 'get').
    (work / "convert" / "family.json").write_text("[]")
    assert "vlmctl convert" in _refused(capsys, work, stage, StageError.exit_code)


@pytest.mark.parametrize("stage", ["build-vision", "build-llm"])
def test_convert_files_gone_is_a_stale_input_not_a_checkpoint_problem(work, capsys, stage):
    # convert/vision/ deleted: these stages read its config before comparing their inputs, and said exit 3
    # ("the VLM config is missing", a checkpoint problem) instead of naming the stage to re-run (exit 7).
    shutil.rmtree(work / "convert" / "vision")
    line = _refused(capsys, work, stage, StageError.exit_code)
    assert "convert" in line and "vlmctl convert" in line


# ---- --set vision.opset ----------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [21, 99])
def test_an_opset_the_exporter_cannot_write_is_an_invalid_recipe(work, capsys, opset):
    # It used to be a RuntimeError traceback from torch.onnx.export (exit 1), with the exporter's Torch IR
    # graph on stdout under --json.
    line = _refused(capsys, work, "export-vision", RecipeError.exit_code, "--set", f"vision.opset={opset}", "--force")
    assert f"vision.opset {opset}" in line
