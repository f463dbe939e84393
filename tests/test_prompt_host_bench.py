"""benchmarks/prompt_host_gpu.py on the CPU (--smoke): it times the chunks it names in every mode, profiles the
decoder's own functions, and leaves a mode's environment settings behind it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def test_every_mode_and_chunk_is_timed_and_profiled(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu
    import prompt_host_gpu as B

    monkeypatch.setattr(decode_gpu, "DEV", decode_gpu.DEV)  # --smoke switches the module to the CPU
    monkeypatch.delenv("VLMCTL_CHUNK_ATTENTION_ROWS", raising=False)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["prompt_host_gpu.py", "--smoke", "--modes", "auto",
                                      "int8+VLMCTL_CHUNK_ATTENTION_ROWS=4", "--out", str(out)])
    B.main()
    res = json.loads(out.read_text())
    assert res["attention"] == []  # a GPU-only table
    rows = res["forwards"]
    assert [(r["mode"], r["start"], r["n"]) for r in rows] == [
        ("auto", 0, 12), ("auto", 20, 6), ("int8+VLMCTL_CHUNK_ATTENTION_ROWS=4", 0, 12),
        ("int8+VLMCTL_CHUNK_ATTENTION_ROWS=4", 20, 6)]
    for r in rows:
        assert r["wall_ms"] > 0 and r["gpu_ms"] is None and r["host_launch_ms"] is None
        names = [name for name, _, _ in r["host_profile_us_calls"]]
        assert any("forward" in n for n in names) or any("linear" in n for n in names)
    assert "VLMCTL_CHUNK_ATTENTION_ROWS" not in os.environ
