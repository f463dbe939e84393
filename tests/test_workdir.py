"""The work-directory contract: what `classify` calls each kind of directory, the engine-directory
check, and atomic publication (what every stage and `vlmctl quantize -o` write through)."""

from __future__ import annotations

import json
import socket

import pytest

from vlmctl.errors import CheckpointError, EngineError, InputError
from vlmctl.formats.artifacts import atomic_dir
from vlmctl.formats.workdir import (CHECKPOINT, QUANTIZED, WORKDIR, WORKSPACE, EngineDir, WorkDir, Workspace,
                                    classify)


def _touch(path, text="{}"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_classify_every_kind(tmp_path):
    _touch(tmp_path / "w" / "recipe.json")  # `vlmctl convert -o` / `build -o` write this first
    _touch(tmp_path / "e" / "convert" / "family.json", '{"family": "llava"}')  # a copied engine without its recipe
    _touch(tmp_path / "e" / "build-llm" / "config.json")
    _touch(tmp_path / "ws" / "family.json", '{"family": "llava"}')
    (tmp_path / "ws" / "llm").mkdir()
    _touch(tmp_path / "ck" / "config.json")
    _touch(tmp_path / "q" / "llm" / "config.json")  # quantize -o's output
    _touch(tmp_path / "q" / "vlm" / "config.json")
    got = {d: classify(tmp_path / d) for d in ("w", "e", "ws", "ck", "q")}
    assert got == {"w": WORKDIR, "e": WORKDIR, "ws": WORKSPACE, "ck": CHECKPOINT, "q": QUANTIZED}
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither"):
        classify(tmp_path / "empty")
    with pytest.raises(InputError, match="no such directory"):
        classify(tmp_path / "nope")
    with pytest.raises(InputError, match="no such directory"):
        classify(tmp_path / "ck" / "config.json")


def test_paths_and_the_family_record(tmp_path):
    wd = WorkDir(tmp_path)
    assert wd.convert.processor == tmp_path / "convert" / "processor"
    assert wd.quantize.llm == tmp_path / "quantize" / "llm" and wd.onnx == tmp_path / "export-vision" / "model.onnx"
    assert wd.vision_engine.parent == wd.build_vision and wd.llm_config == tmp_path / "build-llm" / "config.json"
    with pytest.raises(Exception, match="stage 'convert' has not run"):
        wd.family_name()
    Workspace(tmp_path / "convert").root.mkdir()
    Workspace(tmp_path / "convert").write_family({"family": "qwen2_vl", "dtype": "float32"})
    assert wd.family_name() == "qwen2_vl"
    _touch(wd.convert.family_file, "not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        wd.family_name()


def test_engine_dir_opens_only_an_engine(tmp_path):
    with pytest.raises(EngineError, match="not a vlmctl engine directory"):
        EngineDir.open(tmp_path / "nope")
    _touch(tmp_path / "convert" / "family.json", '{"family": "llava"}')
    with pytest.raises(EngineError, match="not a vlmctl engine directory"):
        EngineDir.open(tmp_path)  # convert ran, build-llm did not
    _touch(tmp_path / "build-llm" / "config.json")
    ed = EngineDir.open(tmp_path)
    with pytest.raises(EngineError, match="runtime.json"):
        ed.vision_runner()
    _touch(ed.vision_runtime, json.dumps({"runner": "onnxruntime", "onnx": "../export-vision/model.onnx"}))
    assert ed.vision_runner() == "onnxruntime"


def test_atomic_dir_publishes_whole_or_nothing(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-") and not out.exists()
        (tmp / "a.txt").write_text("1")
    assert (out / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "b.txt").write_text("2")
            raise RuntimeError("the work failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not (out / "b.txt").exists()  # old one kept
    with atomic_dir(out) as tmp:
        (tmp / "c.txt").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["c.txt"]  # replaced whole
    # a temporary directory a killed process left (its pid is gone) is reclaimed on the next publication
    dead = tmp_path / f".out.tmp-{socket.gethostname()}-999999999"
    dead.mkdir()
    with atomic_dir(out):
        pass
    assert not dead.exists()


def test_atomic_dir_that_fails_leaves_no_parent_it_made(tmp_path):
    """Output under directories that do not exist yet: a failed write removes the ones it made (and only those)."""
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "kept" / "a" / "b" / "out") as tmp:
            (tmp / "x").write_text("1")
            raise RuntimeError("the work failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
    with atomic_dir(tmp_path / "kept" / "a" / "out") as tmp:
        (tmp / "x").write_text("1")
    assert (tmp_path / "kept" / "a" / "out" / "x").read_text() == "1"


def test_atomic_dir_that_cannot_be_made_names_the_output(tmp_path):
    """A parent that is a file: the error names the output asked for and what stood in the way."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError) as e:
        with atomic_dir(tmp_path / "afile" / "repo"):
            pass
    assert e.value.filename == str(tmp_path / "afile" / "repo") and str(tmp_path / "afile") in e.value.strerror
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]

