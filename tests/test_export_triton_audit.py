"""`vlmctl export-triton` as a user meets it: what it refuses to overwrite, what it says of an engine
directory that is incomplete, damaged or malformed (one `error:` line, the README's exit code, nothing
written), the paths it writes for a server mount, and `--json`. The engine and the interpreters are
test_triton_repo's: the tiny LLaVA engine with a TensorRT-LLM decoder stage, and a "TensorRT-LLM 1.2"
interpreter whose `tensorrt` is a recording stand-in (no TensorRT, no Triton server here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_triton_repo import PY_ENV, cli, pythons, trtllm_engine  # noqa: F401 (module fixtures)
from vlmctl.errors import EngineError, InputError, OptionError


def _one_error(code: int, err: str, expect_code: int, *needles: str) -> str:
    """The command failed with `expect_code` and exactly one `error:` line (the last), no traceback."""
    assert code == expect_code, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), err
    assert not any(line.startswith("error: ") for line in lines[:-1]), err
    for needle in needles:
        assert needle in lines[-1], err
    return lines[-1]


@pytest.fixture
def env(pythons, monkeypatch):  # noqa: F811
    monkeypatch.setenv(PY_ENV, str(pythons["trt"]))


@pytest.fixture
def engine(trtllm_engine, tmp_path) -> Path:  # noqa: F811
    """A private copy of the exported engine, for tests that damage or move it."""
    eng = tmp_path / "engines" / "llava"
    shutil.copytree(trtllm_engine, eng, symlinks=True)
    return eng


def _same_size(path: Path, text: str) -> None:
    """Overwrite `path` with `text` padded with spaces to the file's size (the manifest's size check passes)."""
    size = path.stat().st_size
    assert len(text) <= size
    path.write_text(text + " " * (size - len(text)))


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- what --force may replace ---------------------------------------------------------------------
def test_force_never_replaces_a_directory_that_holds_the_engine(engine, env, tmp_path):
    before = _snapshot(engine)
    parent = engine.parent  # engines/, which holds engines/llava
    for force in ([], ["--force"]):
        code, _, err = cli("export-triton", engine, "-o", parent, *force)
        _one_error(code, err, InputError.exit_code, "engine directory")
        assert "--force" not in err  # the way out is another -o, not --force
    assert _snapshot(engine) == before  # the engine is untouched
    assert sorted(p.name for p in parent.iterdir()) == ["llava"]  # no repository, no temporaries


def test_force_replaces_only_a_repository_export_triton_wrote(trtllm_engine, env, tmp_path):  # noqa: F811
    # A directory of the user's: refused, kept as it was.
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    code, _, err = cli("export-triton", trtllm_engine, "-o", mine, "--force")
    _one_error(code, err, InputError.exit_code, str(mine), "vlmctl-triton.json")
    assert _snapshot(mine) == {"notes.txt": b"keep me\n"}
    # A file: refused with and without --force, kept, and no stray temporary beside it.
    afile = tmp_path / "afile"
    afile.write_text("data\n")
    for force in ([], ["--force"]):
        code, _, err = cli("export-triton", trtllm_engine, "-o", afile, *force)
        _one_error(code, err, InputError.exit_code, "not a directory")
    assert afile.read_text() == "data\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "models"]
    # A repository export-triton wrote: replaced by --force.
    repo = tmp_path / "repo"
    cli("export-triton", trtllm_engine, "-o", repo, expect=0)
    (repo / "stale.txt").write_text("from before\n")
    cli("export-triton", trtllm_engine, "-o", repo, "--force", "--streaming", expect=0)
    assert not (repo / "stale.txt").exists() and (repo / "vlmctl-triton.json").is_file()
    assert json.loads((repo / "vlmctl-triton.json").read_text())["streaming"] is True
    # ... but not when the stock files it would copy lie inside it (replacing it would delete them).
    stock = repo / "all_models"
    for f in ("inflight_batcher_llm/preprocessing/1/model.py", "inflight_batcher_llm/postprocessing/1/model.py",
              "multimodal/multimodal_encoders/1/model.py", "multimodal/multimodal_encoders/1/multimodal_utils.py"):
        (stock / f).parent.mkdir(parents=True, exist_ok=True)
        (stock / f).write_text(f"# stand-in for {f}\n")
    before = _snapshot(repo)
    code, _, err = cli("export-triton", trtllm_engine, "-o", repo, "--force", "--stock-models", stock)
    _one_error(code, err, InputError.exit_code, "--stock-models")
    assert _snapshot(repo) == before


# ---- the engine directory -------------------------------------------------------------------------
@pytest.mark.parametrize("damage,needle", [
    (lambda e: shutil.rmtree(e / "build-vision"), "incomplete engine"),          # a stage removed
    (lambda e: (e / "convert" / "processor" / "tokenizer.json").unlink(), "convert/processor/tokenizer.json"),
    (lambda e: (e / "export-vision" / "model.onnx").write_bytes(b"\0" * 100), "export-vision/model.onnx"),
], ids=["stage-missing", "tokenizer-missing", "onnx-cut"])
def test_an_incomplete_or_damaged_engine_is_refused(engine, env, tmp_path, damage, needle):
    damage(engine)
    out = tmp_path / "repo"
    code, _, err = cli("export-triton", engine, "-o", out)
    _one_error(code, err, EngineError.exit_code, needle)
    assert not out.exists() and not list(tmp_path.glob(".repo.*"))


@pytest.mark.parametrize("rel", ["export-vision/io.json", "build-llm/config.json", "build-llm/engine/config.json"])
def test_engine_json_that_is_not_an_object_is_one_error_line(engine, env, tmp_path, rel):
    _same_size(engine / rel, "[]")
    out = tmp_path / "repo"
    code, _, err = cli("export-triton", engine, "-o", out)
    _one_error(code, err, EngineError.exit_code, rel)
    assert not out.exists()


def test_an_unreadable_onnx_graph_is_one_error_line(engine, env, tmp_path):
    onnx = engine / "export-vision" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[:64] = b"\xff" * 64  # same size: the manifest's size check passes, protobuf does not
    onnx.write_bytes(bytes(data))
    out = tmp_path / "repo"
    code, _, err = cli("export-triton", engine, "-o", out)
    _one_error(code, err, EngineError.exit_code, "model.onnx", "export-vision")
    assert not out.exists() and not list(tmp_path.glob(".repo.*"))


# ---- options ----------------------------------------------------------------------------------------
def test_a_mount_at_the_servers_root_writes_plain_absolute_paths(engine, env, tmp_path):
    root = tmp_path  # the host directory the server sees as /
    code, out, err = cli("export-triton", engine, "-o", tmp_path / "repo", "--mount", f"{root}=/", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["paths_on_server"] == {"engine": "/engines/llava/build-llm/engine",
                                      "processor": "/engines/llava/convert/processor",
                                      "vision": "/repo/multimodal_encoders/1/vision"}
    assert "--model_repo=/repo" in res["launch"]


def test_an_out_of_range_kv_cache_fraction_option_is_not_told_to_pass_itself(trtllm_engine, env,  # noqa: F811
                                                                             tmp_path):
    code, _, err = cli("export-triton", trtllm_engine, "-o", tmp_path / "r", "--kv-cache-fraction", "0.95")
    line = _one_error(code, err, OptionError.exit_code, "0.95", "below 0.9")
    assert "pass --kv-cache-fraction" not in line


def test_json_mode_prints_one_json_object_and_nothing_else(trtllm_engine, env, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("export-triton", trtllm_engine, "-o", "repo", "--json")
    assert code == 0, err
    res = json.loads(out)  # the whole of stdout
    assert isinstance(res, dict) and res["family"] == "llava" and out.count("\n") == 1
    assert err == ""  # no progress lines in --json mode
    # every path in the result absolute, the repository's too (it was -o as typed)
    assert res["repository"] == str((tmp_path / "repo").resolve()) and Path(res["engine_dir"]).is_absolute()
