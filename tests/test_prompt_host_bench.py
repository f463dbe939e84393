"""benchmarks/prompt_host_gpu.py on the CPU (--smoke): it times the chunks it names, with decode rows beside them, in
every mode, profiles the decoder's own functions, captures steps where a mode asks for them, and leaves no mode's
environment settings behind it."""
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
    monkeypatch.delenv("VLMCTL_STEP_GRAPH_ROWS", raising=False)
    out = tmp_path / "r.json"
    from vlmctl.runtime.step_graphs import STEP_GRAPH_ROWS, buckets

    eager, mode = "auto+VLMCTL_STEP_GRAPH_ROWS=0", "int8+VLMCTL_CHUNK_ATTENTION_ROWS=4+VLMCTL_STEP_GRAPH_ROWS=16"
    monkeypatch.setattr(sys, "argv", ["prompt_host_gpu.py", "--smoke", "--modes", eager, mode, "auto", "--decode-rows",
                                      "2", "--out", str(out)])
    B.main()
    res = json.loads(out.read_text())
    assert res["attention"] == []  # a GPU-only table
    rows = res["forwards"]
    default = buckets(STEP_GRAPH_ROWS)  # the engine's default steps
    assert len(default) > 3
    assert [(r["mode"], r["start"], r["n"], r["step_graphs"]) for r in rows] == [
        (eager, 0, 12, []), (eager, 20, 6, []), (mode, 0, 12, [16]), (mode, 20, 6, [16]), ("auto", 0, 12, default),
        ("auto", 20, 6, default)]
    for r in rows:
        assert r["wall_ms"] > 0 and r["gpu_ms"] is None and r["host_launch_ms"] is None and r["decode_rows"] == 2
        names = [name for name, _, _ in r["host_profile_us_calls"]]
        assert any("forward" in n for n in names) or any("linear" in n for n in names)
        # with captured steps the forward's rows go through them (run eagerly on the CPU), else paged decode
        assert any("step_graphs.py" in n for n in names) == bool(r["step_graphs"])
    assert "VLMCTL_CHUNK_ATTENTION_ROWS" not in os.environ and "VLMCTL_STEP_GRAPH_ROWS" not in os.environ
