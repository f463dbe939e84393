"""Bad input: one clear line on stderr, a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import cli, write_recipe


def run_vlmctl(*args, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "vlmctl", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def assert_one_line_error(proc, code):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr


def test_help_is_instant_and_does_not_import_torch():
    code = ("import sys; from vlmctl.cli.main import cli_main; rc = cli_main(['--help']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; print(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "convert" in proc.stdout and "build" in proc.stdout


def test_version():
    proc = run_vlmctl("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("vlmctl ")


def test_unknown_recipe_key_subprocess(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("source: x\nvision: {backnd: torch}\n")
    proc = run_vlmctl("build", p, "--dry-run")
    assert_one_line_error(proc, 2)
    assert "vision.backnd: unknown key" in proc.stderr and str(p) in proc.stderr


def test_wrong_value_type(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("source: x\n")
    code, _, err = cli("build", p, "--set", "limits.max_input_len=lots", "--dry-run", capsys=capsys, expect=2)
    assert "limits.max_input_len" in err and "integer" in err


def test_missing_source_directory(tmp_path, capsys):
    p = write_recipe(tmp_path / "r.yaml", tmp_path / "nowhere")
    code, _, err = cli("build", p, "-o", tmp_path / "e", capsys=capsys, expect=3)  # README: 3, checkpoint problem
    assert "no such directory" in err
    assert not (tmp_path / "e" / "convert").exists()


def test_unsupported_architecture(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, _, err = cli("convert", ck, "-o", tmp_path / "w", capsys=capsys, expect=4)
    assert "unsupported architecture BertModel" in err and "LlavaForConditionalGeneration" in err


def test_corrupt_safetensors(tiny_llava, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_llava, ck)
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, _, err = cli("convert", ck, "-o", tmp_path / "w", capsys=capsys, expect=3)
    assert "model.safetensors" in err and ("not a valid safetensors" in err or "cannot be read" in err)
    assert not (tmp_path / "w").exists()  # convert made the directory, and a failure leaves nothing of it


def test_missing_and_non_image_paths(tiny_llava_engine, tmp_path, capsys):
    code, _, err = cli("chat", tiny_llava_engine, "--image", tmp_path / "nope.png", "--prompt", "hi", "--json",
                       capsys=capsys, expect=5)
    assert "no such image file" in err
    bad = tmp_path / "bad.png"
    bad.write_text("this is not an image")
    code, _, err = cli("chat", tiny_llava_engine, "--image", bad, "--prompt", "hi", "--json", capsys=capsys,
                       expect=5)
    assert "not a readable image" in err


def test_image_path_error_subprocess_has_no_traceback(tiny_llava_engine, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\x89PNG garbage")
    proc = run_vlmctl("chat", tiny_llava_engine, "--image", bad, "--prompt", "hi", "--json")
    assert_one_line_error(proc, 5)


def test_not_an_engine_dir(tmp_path, capsys):
    code, _, err = cli("chat", tmp_path, "--prompt", "hi", "--json", capsys=capsys, expect=8)
    assert "not a vlmctl engine directory" in err


def test_stage_before_convert(tmp_path, capsys):
    code, _, err = cli("export-vision", tmp_path, capsys=capsys, expect=7)
    assert "vlmctl convert" in err


def _command_that_a_signal_interrupts(sig, swallow: bool):
    """A stand-in for typer's `app` whose work a signal interrupts inside library code that does not let the
    handler's exception through: it raises its own from it (transformers' lazy imports: ModuleNotFoundError), or
    swallows it and fails later on what it left half done (AttributeError, no chain)."""
    import time

    def app(args, standalone_mode):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(10)  # the handler's exception ends this at once
            raise AssertionError("the signal's handler did not run")
        except BaseException as e:
            if isinstance(e, AssertionError):
                raise
            if not swallow:
                raise ModuleNotFoundError("Could not import module 'GenerationMixin'") from e
        raise AttributeError("partially initialized module 'x' has no attribute 'y'")

    return app


def test_a_signal_a_library_turns_into_its_own_error_still_exits_130_or_143(monkeypatch, capsys):
    """SIGTERM (143) and Ctrl-C (130) stay one line and their exit code when a library raises its own exception
    from the one the handler raised, or swallows it; without a signal the same exception is not relabelled; and
    the handlers are restored afterwards."""
    import signal

    import pytest

    from vlmctl.cli import main

    # SIGINT at its default, as a terminal's shell starts programs, whatever this test run inherited (started in
    # the background it has SIGINT ignored, and the CLI leaves an ignored SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
        for sig, code, text in ((signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
                                (signal.SIGINT, 130, "error: interrupted")):
            for swallow in (False, True):
                monkeypatch.setattr(main, "app", _command_that_a_signal_interrupts(sig, swallow))
                assert main.cli_main(["build"]) == code, (sig, swallow)
                err = capsys.readouterr().err
                assert err.strip() == text and "Traceback" not in err
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    finally:
        signal.signal(signal.SIGINT, inherited)

    def no_signal(args, standalone_mode):
        raise ModuleNotFoundError("a real bug")

    monkeypatch.setattr(main, "app", no_signal)
    with pytest.raises(ModuleNotFoundError, match="a real bug"):
        main.cli_main(["build"])
