"""benchmarks/prompt_kernel_variants_gpu.py on the CPU (--smoke): while a version of paged_prefill.py is timed, its
functions are the ones the engine's callers look up (ops.prompt_attention and the step graphs, at each call; the CPU
itself runs the torch reference), in every round, and the engine's own are back afterwards."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def test_each_version_is_timed_in_turn_and_the_engines_own_restored(monkeypatch, tmp_path):
    root = Path(__file__).parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import decode_gpu
    import prompt_kernel_variants_gpu as B

    from vlmctl.runtime.kernels import paged_prefill

    monkeypatch.setattr(decode_gpu, "DEV", decode_gpu.DEV)  # --smoke switches the module to the CPU
    own = paged_prefill.prompt_attention
    src = (root / "vlmctl" / "runtime" / "kernels" / "paged_prefill.py").read_text()
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(src)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["prompt_kernel_variants_gpu.py", "--smoke", "--variants",
                                      f"a={tmp_path / 'a.py'}", f"b={tmp_path / 'b.py'}", "--rounds", "2",
                                      "--repeats", "1", "--out", str(out)])
    B.main()
    rows = json.loads(out.read_text())
    assert [(r["round"], r["variant"], r["start"], r["n"]) for r in rows] == [
        (rnd, v, s, n) for rnd in (0, 1) for v in ("a", "b") for s, n in ((0, 12), (20, 6))]
    for r in rows:  # the engine called the version being timed
        assert r["module"] == f"vlmctl.runtime.kernels._prompt_variant_{r['variant']}" and r["wall_ms"] > 0
    assert paged_prefill.prompt_attention is own
    assert all(getattr(paged_prefill, f).__module__ == "vlmctl.runtime.kernels.paged_prefill" for f in B.PATCHED)
