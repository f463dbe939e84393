"""Stage caching, partial rebuilds, --force/--until/--dry-run/--json, and atomic outputs."""

from __future__ import annotations

import json

import pytest

from conftest import cli, cli_json, write_recipe


def stages(result):
    return {s["name"]: s for s in result["stages"]}


def test_cache_hits_and_partial_rebuilds(tiny_llava, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    eng = tmp_path / "eng"
    first = stages(cli_json("build", recipe, "-o", eng, "--json", capsys=capsys))
    assert [n for n, s in first.items() if s["cached"]] == []
    assert first["quantize"]["skipped"]
    for s in ("convert", "export-vision", "build-vision", "build-llm"):
        assert first[s]["outputs"] and (eng / s / "manifest.json").exists()

    again = stages(cli_json("build", recipe, "-o", eng, "--json", capsys=capsys))
    assert {n for n, s in again.items() if s["cached"]} == {"convert", "export-vision", "build-vision", "build-llm"}

    # A decoder limit changes build-llm and build-vision's batch profile, nothing upstream.
    changed = stages(cli_json("build", recipe, "-o", eng, "--set", "limits.max_batch_size=3", "--json",
                              capsys=capsys))
    assert changed["convert"]["cached"] and changed["export-vision"]["cached"]
    assert not changed["build-llm"]["cached"] and not changed["build-vision"]["cached"]

    # A validation setting re-exports the vision model only; the decoder stays cached.
    changed = stages(cli_json("build", recipe, "-o", eng, "--set", "limits.max_batch_size=3",
                              "--set", "vision.validate_batch_size=5", "--json", capsys=capsys))
    assert not changed["export-vision"]["cached"]
    assert changed["convert"]["cached"] and changed["build-llm"]["cached"]

    forced = stages(cli_json("build", recipe, "-o", eng, "--set", "limits.max_batch_size=3", "--set",
                             "vision.validate_batch_size=5", "--force", "--json", capsys=capsys))
    assert not any(s["cached"] for s in forced.values())

    # Human output says which stages were cache hits.
    cli("build", recipe, "-o", eng, "--set", "limits.max_batch_size=3", "--set", "vision.validate_batch_size=5",
        capsys=capsys)
    code, _, err = cli("build", recipe, "-o", eng, capsys=capsys)
    assert "convert: cached" in err


def test_until_and_dry_run(tiny_llava, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    eng = tmp_path / "eng"
    plan = cli_json("build", recipe, "-o", eng, "--dry-run", "--json", capsys=capsys)
    assert plan["recipe"]["source"] == str(tiny_llava)
    assert [p["stage"] for p in plan["plan"]] == ["convert", "quantize", "export-vision", "build-vision", "build-llm"]
    assert not eng.exists()
    res = cli_json("build", recipe, "-o", eng, "--until", "export-vision", "--json", capsys=capsys)
    assert [s["name"] for s in res["stages"]] == ["convert", "quantize", "export-vision"]
    assert not (eng / "build-llm").exists()
    code, _, err = cli("build", recipe, "--until", "nope", capsys=capsys, expect=2)
    assert "unknown stage" in err


def test_a_family_tensorrt_llm_does_not_serve_stops_the_build_before_any_stage(tmp_path, capsys):
    """decoder.backend trtllm (or tp_size > 1) for a family TensorRT-LLM does not serve (Qwen2-VL: M-RoPE):
    `build` and its dry run refuse at once with build-llm's own message and exit code, before convert runs (nothing
    is written); a build that stops before build-llm is not refused. (TensorRT-LLM merely missing is left to
    build-llm, after the stages before it: tests/test_stage_commands_recipe.py.)"""
    from tiny_models import make_qwen2_vl

    qwen = make_qwen2_vl(tmp_path / "qwen")
    recipe = write_recipe(tmp_path / "q.yaml", qwen, profiles=[], dtype="float16", decoder={"backend": "trtllm"})
    eng = tmp_path / "eng"
    for extra in (["--dry-run"], []):
        code, _, err = cli("build", recipe, "-o", eng, *extra, capsys=capsys, expect=7)
        assert "the qwen2_vl family is not served by TensorRT-LLM" in err and "use decoder.backend: torch" in err
        assert not eng.exists()
    # tensor parallelism asks for TensorRT-LLM too
    recipe = write_recipe(tmp_path / "q2.yaml", qwen, profiles=[], dtype="float16", decoder={"tp_size": 2})
    code, _, err = cli("build", recipe, "-o", eng, "--dry-run", capsys=capsys, expect=7)
    assert "not served by TensorRT-LLM" in err
    plan = cli_json("build", recipe, "-o", eng, "--until", "quantize", "--dry-run", "--json", capsys=capsys)
    assert [p["stage"] for p in plan["plan"]] == ["convert", "quantize"]


def test_max_input_len_without_room_for_an_image_is_refused_before_any_stage(tiny_llava, tmp_path, capsys):
    """An image of the tiny LLaVA is 16 prompt rows (28 px in patches of 7). A max_input_len of 16 or less with
    images allowed would build an engine that refuses every request with an image: `build` and its dry run say so
    before convert runs, and so does the build-llm stage on its own; a text-only engine (no images) may have it."""
    eng = tmp_path / "eng"
    small = write_recipe(tmp_path / "r.yaml", tiny_llava, limits={"max_input_len": 16})
    for extra in (["--dry-run"], []):
        code, _, err = cli("build", small, "-o", eng, *extra, capsys=capsys, expect=2)
        assert "limits.max_input_len 16 leaves no room for text beside one image, which takes 16 prompt rows" in err
        assert not eng.exists()
    text_only = write_recipe(tmp_path / "t.yaml", tiny_llava, limits={"max_input_len": 16,
                                                                      "max_images_per_request": 0})
    cli_json("build", text_only, "-o", eng, "--dry-run", "--json", capsys=capsys)
    ok = write_recipe(tmp_path / "ok.yaml", tiny_llava, limits={"max_input_len": 17})
    cli("build", ok, "-o", eng, "--until", "convert", capsys=capsys)
    code, _, err = cli("build-llm", eng, "--set", "limits.max_input_len=4", capsys=capsys, expect=2)
    assert "limits.max_input_len 4 leaves no room" in err
    assert not (eng / "build-llm").exists()


def test_failed_stage_leaves_nothing_half_written(tiny_llava, tmp_path, capsys, monkeypatch):
    import vlmctl.export.onnx_vision as ov

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    eng = tmp_path / "eng"
    cli("build", recipe, "-o", eng, "--until", "export-vision", capsys=capsys)
    before = (eng / "export-vision" / "manifest.json").read_text()

    def broken(*a, **k):
        out = a[2]
        (out / "model.onnx").write_bytes(b"partial")
        raise KeyboardInterrupt  # an interruption mid-stage

    monkeypatch.setattr(ov, "export_vision_onnx", broken)
    with pytest.raises(KeyboardInterrupt):
        from vlmctl.pipeline import build
        from vlmctl.recipe import load_recipe

        build(load_recipe(recipe, ["vision.opset=19"]), eng)
    # the previous, finished output is untouched and no temporary directory remains
    assert (eng / "export-vision" / "manifest.json").read_text() == before
    assert not [p for p in eng.iterdir() if p.name.startswith(".") and p.name != ".source-hashes.json"]


def test_manifest_contents(tiny_llava_engine):
    m = json.loads((tiny_llava_engine / "export-vision" / "manifest.json").read_text())
    assert m["stage"] == "export-vision" and m["tool"] == "vlmctl" and m["tool_version"]
    assert m["settings"]["opset"] >= 18 and m["inputs"]["vision"]
    assert m["info"]["max_abs_error"] <= 1e-4 and m["info"]["cosine"] > 0.9999
    assert m["info"]["validate_batch"] != m["info"]["export_batch"]
    assert {f["path"] for f in m["files"]} >= {"model.onnx", "io.json"}
    assert all(len(f["sha256"]) == 64 for f in m["files"])
    v = json.loads((tiny_llava_engine / "build-vision" / "manifest.json").read_text())
    assert v["backend"] in ("onnxruntime", "tensorrt")
    if v["backend"] == "onnxruntime":
        assert "ONNX Runtime runs" in v["info"]["note"]


def test_source_is_not_reread_on_a_cache_hit(tiny_llava, tmp_path, monkeypatch):
    import os
    import shutil

    import vlmctl.formats.artifacts as artifacts
    from vlmctl.pipeline import stage_convert
    from vlmctl.recipe import load_recipe

    src = tmp_path / "ck"
    shutil.copytree(tiny_llava, src)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", src))
    assert not stage_convert(recipe, tmp_path / "w").cached
    read = []
    real = artifacts.sha256_file
    monkeypatch.setattr(artifacts, "sha256_file", lambda p, *a: (read.append(p), real(p, *a))[1])
    assert stage_convert(recipe, tmp_path / "w").cached
    assert not [p for p in read if src in p.parents]  # known (size, mtime): no source file re-read
    # a changed file (new mtime) is hashed again, and its new content invalidates the stage
    w = src / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 1_000_000))
    read.clear()
    assert not stage_convert(recipe, tmp_path / "w").cached
    assert w in read
