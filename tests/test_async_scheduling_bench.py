"""benchmarks/async_scheduling_gpu.py on the CPU (--smoke): its A/B really switches the engine's mode."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def test_the_bench_alternates_async_and_synchronous_steps(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import async_scheduling_gpu as B

    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["async_scheduling_gpu.py", "--smoke", "--work", str(tmp_path / "w"),
                                      "--batches", "1", "3", "--out", str(out)])
    B.main()
    res = json.loads(out.read_text())
    runs = res["engines"][0]["runs"]
    assert [(r["batch"], r["async"]) for r in runs] == [(b, m) for b in (1, 3) for m in (True, False) * 2]
    for r in runs:  # the switch did what it says: every decode step of an async run was launched ahead
        assert (r["steps_ahead"] == r["decode_steps"] > 0) if r["async"] else (r["steps_ahead"] == 0)
        assert r["tok_s"] > 0
