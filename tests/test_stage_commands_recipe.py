"""Stage commands and the work directory's recipe: a failed command leaves recipe.json as it was (A), a
stage refuses out-of-date inputs (B), `build --until` says what it built (C), command-line paths are
relative to the current directory (D), quantize checks the group size before converting (E), and
quantize's command-line mistakes have README's exit codes (F). `verify` and `chat` on an engine that
`build --until` left incomplete name the stages still to run (C). All through the real CLI, in-process,
on copies of the session's tiny engine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import cli, cli_json, write_recipe


@pytest.fixture()
def eng(tiny_llava_engine, tmp_path) -> Path:
    dst = tmp_path / "eng"
    shutil.copytree(tiny_llava_engine, dst)  # copy2 keeps modification times: every stage stays cached
    return dst


def recipe_of(engine: Path) -> Path:
    return engine.parent / "tiny.yaml"  # conftest writes it beside the session engine


def one_error(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def manifests(engine: Path) -> dict:
    return {s: (engine / s / "manifest.json").read_text() for s in ("convert", "export-vision", "build-vision",
                                                                    "build-llm")}


# ---- A: the recipe changes only when the command succeeds ---------------------------------------
def test_failed_commands_leave_the_saved_recipe_as_it_was(eng, tiny_llava_engine, tmp_path, capsys):
    before = (eng / "recipe.json").read_bytes()

    # convert of a missing source into an existing engine; then build-llm still uses the engine's recipe
    code, _, err = cli("convert", tmp_path / "nonexistent", "-o", eng, capsys=capsys, expect=3)
    assert (eng / "recipe.json").read_bytes() == before
    assert cli_json("build-llm", eng, "--json", capsys=capsys)["cached"]

    # quantize that fails (a group size that does not divide 64): no quantization.method awq saved
    code, _, err = cli("quantize", eng, "--group-size", "48", "--calib-data", tmp_path / "nonexist.txt",
                       capsys=capsys, expect=5)
    assert "group size 48" in one_error(err)
    assert (eng / "recipe.json").read_bytes() == before
    assert cli_json("build-llm", eng, "--json", capsys=capsys)["cached"]

    # a stage command whose stage fails its validation
    cli("export-vision", eng, "--set", "vision.max_rel_error=1e-30", capsys=capsys, expect=7)
    assert (eng / "recipe.json").read_bytes() == before

    # a build that fails part-way
    cli("build", recipe_of(tiny_llava_engine), "-o", eng, "--set", "vision.max_rel_error=1e-30", capsys=capsys,
        expect=7)
    assert (eng / "recipe.json").read_bytes() == before

    # a stage command refused for a backend that is not there (vision.backend tensorrt without TensorRT)
    from vlmctl.backends.tensorrt import tensorrt_available

    if not tensorrt_available():
        code, _, err = cli("build-vision", eng, "--set", "vision.backend=tensorrt", capsys=capsys, expect=6)
        assert (eng / "recipe.json").read_bytes() == before


def test_a_failed_convert_leaves_nothing_in_a_new_directory(tiny_llava, tmp_path, capsys):
    cli("convert", tmp_path / "nonexistent", "-o", tmp_path / "new", capsys=capsys, expect=3)
    assert not (tmp_path / "new").exists()
    ck = tmp_path / "ck"  # fails in the stage itself, after the work directory was made
    shutil.copytree(tiny_llava, ck)
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    cli("convert", ck, "-o", tmp_path / "w", capsys=capsys, expect=3)
    assert not (tmp_path / "w").exists()


def test_a_build_that_fails_late_in_a_new_directory_can_be_resumed(tiny_llava_engine, tmp_path, capsys):
    """A new directory's build that stops at build-llm (TensorRT-LLM is not installed) keeps its finished stages
    and saves the recipe they were built with, so that the stage command takes over from there, as
    docs/tensorrt-llm.md says: the same command stops the same way, and with another backend it builds."""
    from vlmctl.backends.trtllm import trtllm_available

    if trtllm_available():
        pytest.skip("TensorRT-LLM is installed: build-llm would not stop here")
    out = tmp_path / "t"
    cli("build", recipe_of(tiny_llava_engine), "-o", out, "--set", "decoder.backend=trtllm", "--set", "dtype=float16",
        capsys=capsys, expect=6)
    saved = json.loads((out / "recipe.json").read_text())
    assert saved["decoder"]["backend"] == "trtllm" and saved["dtype"] == "float16"
    assert not (out / "build-llm").exists()
    _, _, err = cli("build-llm", out, capsys=capsys, expect=6)
    assert "no recipe.json" not in err
    before = manifests_of(out, ("convert", "export-vision", "build-vision"))
    assert not cli_json("build-llm", out, "--set", "decoder.backend=torch", "--json", capsys=capsys)["cached"]
    assert manifests_of(out, ("convert", "export-vision", "build-vision")) == before  # reused, not rebuilt
    cli("verify", out, capsys=capsys)


def test_a_stage_command_on_a_missing_directory_says_so(tmp_path, capsys):
    _, _, err = cli("export-vision", tmp_path / "nowhere", capsys=capsys, expect=7)
    assert "no such work directory" in one_error(err) and "vlmctl build RECIPE -o" in err


def manifests_of(engine: Path, stages) -> dict:
    return {s: (engine / s / "manifest.json").read_text() for s in stages}


# ---- B: a stage refuses inputs that are out of date for its recipe -------------------------------
def test_stage_commands_refuse_stale_inputs(eng, tiny_llava_engine, capsys):
    before, recipe = manifests(eng), (eng / "recipe.json").read_bytes()
    code, _, err = cli("build-llm", eng, "--set", "dtype=bfloat16", capsys=capsys, expect=7)
    line = one_error(err)
    assert "convert's output was made with dtype float32; this recipe asks for bfloat16" in line
    assert "run `vlmctl convert` (or `vlmctl build`) first" in line
    code, _, err = cli("build-vision", eng, "--set", "vision.opset=19", capsys=capsys, expect=7)
    assert "export-vision's output was made with vision.opset 18; this recipe asks for 19" in one_error(err)
    assert "`vlmctl export-vision`" in err
    assert manifests(eng) == before and (eng / "recipe.json").read_bytes() == recipe  # nothing was built

    # `build --dry-run` agrees: convert re-runs for bfloat16
    plan = cli_json("build", recipe_of(tiny_llava_engine), "-o", eng, "--set", "dtype=bfloat16", "--dry-run", "--json",
                    capsys=capsys)["plan"]
    assert plan[0] == {"stage": "convert", "runs": True, "reason": "its settings or inputs changed"}
    # a setting of the stage itself is its own business: build-llm re-runs, nothing upstream is stale
    res = cli_json("build-llm", eng, "--set", "limits.max_batch_size=3", "--json", capsys=capsys)
    assert not res["cached"]
    assert json.loads((eng / "recipe.json").read_text())["limits"]["max_batch_size"] == 3

    # an engine whose source checkpoint is gone: convert is judged by its settings alone
    saved = json.loads((eng / "recipe.json").read_text())
    saved["source"] = str(eng.parent / "moved-away")
    (eng / "recipe.json").write_text(json.dumps(saved))
    assert cli_json("build-llm", eng, "--set", "limits.max_batch_size=2", "--json", capsys=capsys)["name"]
    code, _, err = cli("build-llm", eng, "--set", "dtype=float16", capsys=capsys, expect=7)
    assert "dtype float32; this recipe asks for float16" in one_error(err)


# ---- C: --until says what it built ---------------------------------------------------------------
def test_build_until_says_the_engine_is_not_complete(eng, tiny_llava_engine, capsys):
    recipe = recipe_of(tiny_llava_engine)
    _, _, err = cli("build", recipe, "-o", eng, "--until", "convert", capsys=capsys)
    assert "engine ready" not in err and "vlmctl chat" not in err
    assert "built up to convert" in err and "not an engine yet" in err and "export-vision" in err
    res = cli_json("build", recipe, "-o", eng, "--until", "build-vision", "--json", capsys=capsys)
    assert res["complete"] is False and res["next_stage"] == "build-llm"
    res = cli_json("build", recipe, "-o", eng, "--json", capsys=capsys)
    assert res["complete"] is True and "next_stage" not in res
    _, _, err = cli("build", recipe, "-o", eng, capsys=capsys)
    assert "engine ready" in err


@pytest.fixture(scope="module")
def until_convert(tiny_llava_engine, tmp_path_factory) -> Path:
    """A work directory made by `vlmctl build RECIPE --until convert` (only convert/ and recipe.json)."""
    out = tmp_path_factory.mktemp("until") / "part"
    cli("build", recipe_of(tiny_llava_engine), "-o", out, "--until", "convert")
    return out


def test_verify_names_every_stage_still_to_run(until_convert, eng, capsys):
    """verify lists every stage an engine still lacks, export-vision too (it was left out, and an engine
    without export-vision/ passed), and names the next stage as `build --until` does."""
    code, out, err = cli("verify", until_convert, "--json", capsys=capsys, expect=8)
    report = json.loads(out)
    assert [p for s in report["stages"] for p in s["problems"]] == [
        f"{s}/ is missing (the stage has not run here)" for s in ("export-vision", "build-vision", "build-llm")]
    missing = [s["stage"] for s in report["stages"] if s["missing"]]
    assert missing == ["export-vision", "build-vision", "build-llm"]  # quantization.method none: no quantize
    assert report["complete"] is False and report["next_stage"] == "export-vision" and not report["ok"]
    line = one_error(err)
    assert "incomplete engine (built up to convert; missing export-vision, build-vision, build-llm)" in line
    assert f"the next stage is export-vision (`vlmctl export-vision {until_convert}`" in line
    _, out, err = cli("verify", until_convert, capsys=capsys, expect=8)
    assert "export-vision: not run" in out and "export-vision/ is missing" in err

    shutil.rmtree(eng / "export-vision")  # a stage gone from the middle of a finished engine (verify passed it)
    code, out, err = cli("verify", eng, "--json", capsys=capsys, expect=None)
    assert code == 8 and "incomplete engine (missing export-vision)" in one_error(err)
    assert json.loads(out)["next_stage"] == "export-vision"
    # a recipe that quantizes needs quantize/ as well
    saved = json.loads((eng / "recipe.json").read_text())
    saved["quantization"]["method"] = "awq"
    (eng / "recipe.json").write_text(json.dumps(saved))
    report = json.loads(cli("verify", eng, "--json", capsys=capsys, expect=8)[1])
    assert [s["stage"] for s in report["stages"] if s["missing"]] == ["quantize", "export-vision"]


def test_chat_on_an_incomplete_engine_names_the_next_stage(until_convert, eng, capsys):
    _, _, err = cli("chat", until_convert, "--prompt", "hi", "--json", capsys=capsys, expect=8)
    line = one_error(err)
    assert "damaged" not in line and "incomplete engine (built up to convert;" in line
    assert f"the next stage is export-vision (`vlmctl export-vision {until_convert}`" in line
    shutil.rmtree(eng / "build-llm")  # what `build --until build-vision` leaves
    _, _, err = cli("chat", eng, "--prompt", "hi", "--json", capsys=capsys, expect=8)
    line = one_error(err)
    assert "incomplete engine (built up to build-vision; missing build-llm)" in line
    assert f"the next stage is build-llm (`vlmctl build-llm {eng}`" in line


# ---- D: paths typed on the command line are relative to the current directory -------------------
def test_calib_data_is_relative_to_the_current_directory(eng, tmp_path, capsys, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    (here / "text.txt").write_text("a red square on a blue background, a cat, a dog.\n"
                                   "hello world! how are you? I am fine, thank you.\n" * 4)
    monkeypatch.chdir(here)  # the engine's recipe lives elsewhere (its base_dir is the session's directory)
    res = cli_json("quantize", eng, "--group-size", "32", "--calib-data", "text.txt", "--calib-samples", "2",
                   "--calib-seq-len", "16", "--json", capsys=capsys)
    assert res["name"] == "quantize" and not res["cached"]
    saved = json.loads((eng / "recipe.json").read_text())["quantization"]
    assert saved["method"] == "awq" and saved["calibration"]["data"] == str(here / "text.txt")
    assert "calibration" in json.loads((eng / "quantize" / "manifest.json").read_text())["inputs"]
    # B again: build-llm on a quantize made for another group size is refused, then builds on the right one
    code, _, err = cli("build-llm", eng, "--set", "quantization.group_size=64", capsys=capsys, expect=7)
    assert "quantize's output was made with quantization.group_size 32; this recipe asks for 64" in one_error(err)
    assert cli_json("build-llm", eng, "--json", capsys=capsys)["info"]["quantization"] == "awq"


def test_set_source_is_relative_to_the_current_directory(tiny_llava, tmp_path, capsys, monkeypatch):
    (tmp_path / "recipes").mkdir()
    recipe = write_recipe(tmp_path / "recipes" / "r.yaml", Path("nowhere"))  # relative to recipes/
    shutil.copytree(tiny_llava, tmp_path / "build" / "ck")
    monkeypatch.chdir(tmp_path)
    plan = cli_json("build", "recipes/r.yaml", "-o", "eng", "--set", "source=build/ck", "--dry-run", "--json",
                    capsys=capsys)
    assert Path(plan["recipe"]["source"]) == Path.cwd() / "build" / "ck"
    assert [p["runs"] for p in plan["plan"]] == [True, False, True, True, True]
    # a path that is not there: the absolute path tried, no hub hint
    for typed in ("build/missing", "./missing"):
        code, _, err = cli("build", recipe, "-o", "eng", "--set", f"source={typed}", "--dry-run", capsys=capsys,
                           expect=3)
        line = one_error(err)
        assert f"no such directory: {os.path.abspath(Path.cwd() / typed)}" in line and "hf download" not in line
    # in the recipe file, a relative source stays relative to the file
    code, _, err = cli("build", recipe, "-o", "eng", "--dry-run", capsys=capsys, expect=3)
    assert f"no such directory: {(tmp_path / 'recipes' / 'nowhere').resolve()}" in one_error(err)


# ---- E: the group size is checked against the config before converting ---------------------------
def test_quantize_checks_the_group_size_before_converting(tiny_llava, tmp_path, capsys, monkeypatch):
    import vlmctl.convert

    def no_conversion(*a, **k):
        raise AssertionError("converted before checking the group size")

    monkeypatch.setattr(vlmctl.convert, "convert_checkpoint", no_conversion)
    code, _, err = cli("quantize", tiny_llava, "-o", tmp_path / "q", "--group-size", "48", capsys=capsys, expect=5)
    line = one_error(err)
    assert "group size 48 does not divide the 64 input features of model.layers.0.self_attn.q_proj" in line
    assert "valid group sizes for this model: 8, 16, 32, 64" in line
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.*"))


# ---- F: quantize's command-line mistakes -----------------------------------------------------------
def test_quantize_command_line_mistakes_have_readmes_exit_codes(tiny_llava, eng, tmp_path, capsys):
    code, _, err = cli("quantize", tiny_llava, capsys=capsys, expect=2)  # no -o: a bad command line
    assert "-o/--output is required" in one_error(err)
    code, _, err = cli("quantize", eng, "-o", tmp_path / "qx", capsys=capsys, expect=2)  # -o with a work dir
    assert "drop -o" in one_error(err) and not (tmp_path / "qx").exists()
    code, _, err = cli("quantize", tmp_path / "nonexistent", "-o", tmp_path / "q", capsys=capsys, expect=3)
    assert "no such directory" in one_error(err)
    (tmp_path / "file").write_text("x")
    cli("quantize", tmp_path / "file", "-o", tmp_path / "q", capsys=capsys, expect=3)
    assert not (tmp_path / "q").exists()


# ---- the output may not be the source ---------------------------------------------------------------
def test_build_and_convert_refuse_an_output_in_the_source(tiny_llava, tmp_path, capsys):
    src = tmp_path / "ck"
    shutil.copytree(tiny_llava, src)
    before = sorted(p.name for p in src.iterdir())
    recipe = write_recipe(tmp_path / "r.yaml", src)
    for args in (("build", recipe, "-o", src), ("build", recipe, "-o", src / "engine"), ("convert", src, "-o", src)):
        code, _, err = cli(*args, capsys=capsys, expect=None)
        assert code == 2 and "is the source checkpoint" in one_error(err), err
    assert sorted(p.name for p in src.iterdir()) == before  # nothing written among the checkpoint's files


def test_a_bad_set_on_a_stage_command_is_named_as_an_override(eng, capsys):
    code, _, err = cli("export-vision", eng, "--set", "vision.opset=10", capsys=capsys, expect=2)
    assert "(with --set overrides): vision.opset" in one_error(err), err
