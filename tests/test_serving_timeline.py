"""benchmarks/serving_timeline_gpu.py: its trace analysis (GPU busy share, idle time charged to the engine phase
active when the GPU ran dry) on a hand-made trace, and the script end to end on the CPU (--smoke)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _x(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def test_idle_time_goes_to_the_phase_that_left_the_gpu_idle(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import serving_timeline_gpu as T

    trace = {"traceEvents": [
        _x("vlmctl.step", 0, 1000), _x("vlmctl.step", 1100, 900),  # 100 us of bench loop between the steps
        _x("vlmctl.run", 100, 380), _x("vlmctl.tokens_read", 500, 400),
        _x("vlmctl.prepare_images", 1150, 500),
        # stream 7: busy 0-450 (two overlapping kernels), 600-1200, 1700-2000; stream 9: 1250-1300 (a copy)
        _x("gemm", 0, 300, "kernel", tid=70, stream=7), _x("attn", 200, 250, "kernel", tid=70, stream=7),
        _x("gemm", 600, 600, "kernel", tid=70, stream=7), _x("memcpy", 1250, 50, "gpu_memcpy", tid=71, stream=9),
        _x("gemm", 1700, 300, "kernel", tid=70, stream=7),
        _x("aten::mm", 100, 50, "cpu_op"),  # not one of the engine's phases
    ]}
    r = T.analyse(trace, gap_us=50)
    assert r["steps"] == 2 and r["wall_ms"] == 2.0
    assert r["gpu_busy_ms"] == 1.4 and r["gpu_busy_share"] == 0.7
    # gaps: 450-600 began inside run (inner to step), 1200-1250 inside prepare_images, 1300-1700 too
    assert r["gpu_idle_ms_by_phase"] == {"vlmctl.prepare_images": [0.45, 2], "vlmctl.run": [0.15, 1]}
    assert r["gpu_ms_by_stream"] == {"7": 1.45, "9": 0.05}
    assert tuple(r["top_kernels_ms_count"][0]) == ("gemm", 1.2, 3)
    assert r["host_ms_a_step_by_phase"]["vlmctl.step"] == 0.95


def test_the_script_runs_on_the_cpu(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import serving_timeline_gpu as T

    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["serving_timeline_gpu.py", "--smoke", "--work", str(tmp_path / "w"),
                                      "--out", str(out)])
    T.main()
    r = json.loads(out.read_text())
    assert r["steps"] == 8 and r["async_scheduling"] is True and r["bench"]["output_throughput"] > 0
    assert r["host_ms_a_step_by_phase"]["vlmctl.step"] > 0 and "vlmctl.step_ahead" in r["host_ms_a_step_by_phase"]
