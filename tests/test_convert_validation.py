"""`vlmctl convert` refuses a checkpoint that transformers cannot load: a config.json it rejects, a
tokenizer or processor it cannot read. Exit 3, one `error:` line naming the file at fault, no
traceback, and no convert stage left in the work directory (so no engine is ever built from it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli, write_recipe


def _edit_config(edit):
    def apply(ck: Path) -> None:
        cfg = json.loads((ck / "config.json").read_text())
        edit(cfg)
        (ck / "config.json").write_text(json.dumps(cfg, indent=2))
    return apply


def _remove_processor_config(ck: Path) -> None:
    removed = [p for p in (ck / "processor_config.json", ck / "preprocessor_config.json") if p.exists()]
    assert removed, "the tiny checkpoint should have an image-processor config"
    for p in removed:
        p.unlink()


# case -> (breakage, the file the error line names, a fragment of what was refused)
BREAKAGES = {
    # 66 is no multiple of the tiny decoder's 4 heads
    "hidden-size": (_edit_config(lambda c: c["text_config"].__setitem__("hidden_size", 66)), "config.json",
                    "hidden size (66) is not a multiple"),
    "layers-not-int": (_edit_config(lambda c: c["text_config"].__setitem__("num_hidden_layers", "x")), "config.json",
                       "num_hidden_layers"),
    "tokenizer-empty": (lambda ck: (ck / "tokenizer.json").write_text("{}"), "tokenizer.json", "tokenizer"),
    "processor-config-removed": (_remove_processor_config, "", "preprocessor_config.json"),
}


def _broken_copy(tiny_llava: Path, tmp_path: Path, case: str) -> tuple[Path, str, str]:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_llava, ck)
    breakage, file, fragment = BREAKAGES[case]
    breakage(ck)
    return ck, str(ck / file) if file else str(ck), fragment


def _assert_one_error_line(out: str, err: str, path: str, fragment: str) -> str:
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and len(lines) <= 2, err[-3000:]  # at most a progress line besides it
    assert f"error: {path}:" in errors[0], errors[0]
    assert fragment in errors[0], errors[0]
    return errors[0]


def _assert_no_convert_stage(work: Path) -> None:
    assert not (work / "convert").exists(), sorted(p.name for p in work.iterdir())
    if work.exists():  # nor a half-written one
        assert not [p.name for p in work.iterdir() if p.name.startswith(".convert")]


@pytest.mark.parametrize("case", list(BREAKAGES))
def test_convert_refuses_what_transformers_cannot_load(tiny_llava, tmp_path, capsys, case):
    ck, path, fragment = _broken_copy(tiny_llava, tmp_path, case)
    work = tmp_path / "work"
    _, out, err = cli("convert", ck, "-o", work, "--dtype", "float32", capsys=capsys, expect=3)
    _assert_one_error_line(out, err, path, fragment)
    _assert_no_convert_stage(work)


@pytest.mark.parametrize("case", ["tokenizer-empty", "processor-config-removed"])
def test_build_stops_at_convert(tiny_llava, tmp_path, capsys, case):
    """The engine would load these with the same processor code and fail at chat; build fails first."""
    ck, path, fragment = _broken_copy(tiny_llava, tmp_path, case)
    recipe = write_recipe(tmp_path / "r.yaml", ck)
    work = tmp_path / "engine"
    _, out, err = cli("build", recipe, "-o", work, capsys=capsys, expect=3)
    _assert_one_error_line(out, err, path, fragment)
    _assert_no_convert_stage(work)
    assert not (work / "build-llm").exists()


def test_intact_checkpoint_still_converts(tiny_llava, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_llava, ck)
    work = tmp_path / "work"
    cli("convert", ck, "-o", work, "--dtype", "float32", capsys=capsys, expect=0)
    assert (work / "convert" / "manifest.json").is_file()
    assert (work / "convert" / "processor" / "tokenizer.json").is_file()


def test_whole_vlm_decoder_reader_names_config(tiny_llava, tmp_path):
    """`eval ppl` and quantize read a whole VLM's decoder through the same config check."""
    from vlmctl.convert import read_vlm_decoder
    from vlmctl.errors import CheckpointError

    ck, path, fragment = _broken_copy(tiny_llava, tmp_path, "hidden-size")
    with pytest.raises(CheckpointError) as e:
        read_vlm_decoder(ck)
    assert str(e.value).startswith(f"{path}:") and fragment in str(e.value)
