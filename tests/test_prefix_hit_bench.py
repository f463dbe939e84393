"""benchmarks/prefix_hit_gpu.py on the CPU (--smoke): the prompts it times really continue a cached prefix, in every
KV pool it names."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def test_the_timed_prompts_continue_a_cached_prefix(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import prefix_hit_gpu as B

    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["prefix_hit_gpu.py", "--smoke", "--work", str(tmp_path / "w"),
                                      "--contexts", "1", "2", "--modes", "auto", "int8", "--profile", "--out", str(out)])
    B.main()
    res = json.loads(out.read_text())
    assert res["gather"] == []  # a GPU-only table
    rows = res["continuations"]
    assert [r["mode"] for r in rows] == ["auto", "auto", "int8", "int8"]
    for r in rows:
        # whole 16-token blocks of the prefix came from the cache, and the new words were prefilled after them
        assert 16 <= r["cached_tokens"] < r["context"] and r["cached_tokens"] % 16 == 0
        assert len(r["continuation_ms"]) == 2 and min(r["continuation_ms"]) > 0
        # --profile: one more continuation under torch.profiler, with the host ops it ran (no GPU here: no kernels)
        prof = r["profile"]
        assert prof["wall_ms"] > 0 and 0 < prof["prefill_tokens"] < r["context"]
        assert any("aten::" in name for name, _, _ in prof["top_host_ops_us_count"])
    assert rows[1]["context"] > rows[0]["context"]
