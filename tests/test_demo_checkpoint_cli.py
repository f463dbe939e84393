"""The demo checkpoint's command line (`python -m vlmctl.models.demo_checkpoint`), without building one (the
builds themselves are test_demo.py's, marked slow)."""

from __future__ import annotations


def test_demo_checkpoint_command_line(tmp_path, capsys, monkeypatch):
    """`python -m vlmctl.models.demo_checkpoint --help` prints its usage; an unknown option is a usage error
    (exit 2); neither writes a checkpoint (`--help` was once taken for the output directory)."""
    from vlmctl.models.demo_checkpoint import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0
    assert "usage: python -m vlmctl.models.demo_checkpoint OUT_DIR" in capsys.readouterr().out
    assert main(["--smolvlm", "--bogus"]) == 2
    assert "usage:" in capsys.readouterr().err
    assert main([]) == 2
    assert list(tmp_path.iterdir()) == []
