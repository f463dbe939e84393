"""The warm-ups' parallel Triton compiles (`vlmctl.runtime.kernels.compile_ahead`): inside
`parallel_compiles()` a launch only compiles, on a thread pool; after it the same launches run and compile
nothing. The pool needs a GPU (Triton compiles for the device in use); off it the context is a no-op that
callers see and skip."""

from __future__ import annotations

import pytest
import torch

from test_w4a16 import _case, _check

from vlmctl.runtime.kernels import compile_ahead
from vlmctl.runtime.kernels import w4a16 as W

HAS_CUDA = torch.cuda.is_available()


def test_workers_setting(monkeypatch):
    monkeypatch.setenv("VLMCTL_COMPILE_WORKERS", "3")
    assert compile_ahead.workers() == 3
    from vlmctl.errors import OptionError

    for bad, why in (("many", "expected an integer"), ("0", "expected an integer >= 1"),
                     ("-2", "expected an integer >= 1")):
        monkeypatch.setenv("VLMCTL_COMPILE_WORKERS", bad)
        with pytest.raises(OptionError, match=f"VLMCTL_COMPILE_WORKERS='{bad}': {why}"):
            compile_ahead.workers()
    monkeypatch.delenv("VLMCTL_COMPILE_WORKERS")
    assert 1 <= compile_ahead.workers() <= 8


def test_off_where_nothing_compiles_ahead(monkeypatch):
    """One worker, or Triton's interpreter: the block yields False, compiles nothing and `run` launches."""
    monkeypatch.setenv("VLMCTL_COMPILE_WORKERS", "1")
    assert not compile_ahead.available()
    with compile_ahead.parallel_compiles() as ahead:
        assert ahead is False and not compile_ahead.compiling_only()
    monkeypatch.delenv("VLMCTL_COMPILE_WORKERS")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compile_ahead.available()


def test_warm_order_of_work(monkeypatch):
    """`warm`: outside a compile pass, the caller's preparation (NVRTC) first, then every call once (no pool
    here: the interpreter); inside one, the calls only, as compiles, and no preparation (its own thread
    does that)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    log = []
    compile_ahead.warm([(1,), (2,)], lambda i: log.append(("call", i, compile_ahead.compiling_only())), gpu=True,
                       prepare=lambda: log.append(("prepare",)))
    assert log == [("prepare",), ("call", 1, False), ("call", 2, False)]
    log.clear()
    token = compile_ahead._COMPILE_ONLY.set(True)  # as inside TorchDecoder.compile_kernels' pass
    try:
        with compile_ahead.parallel_compiles() as ahead:  # nested: the enclosing pass's pool takes them
            assert ahead is True
        compile_ahead.warm([(1,)], lambda i: log.append(("call", i, compile_ahead.compiling_only())), gpu=True,
                           prepare=lambda: log.append(("prepare",)))
    finally:
        compile_ahead._COMPILE_ONLY.reset(token)
    assert log == [("call", 1, True)]


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's path; on a GPU the GPU tests below cover it")
def test_warmup_without_the_pool_still_runs_every_call(monkeypatch):
    """Under the interpreter the warm-up skips its compile pass and its calls run (and are right)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = 32
    p = _case(24, 64, g, seed=3, device="cpu")
    W.warmup([p], g, [1, 2], torch.float16, torch.device("cpu"), biased=[False])
    x = torch.randn(2, 64).half()
    _check(W.w4a16_linear(x, p, g), x, p, g, None, torch.float16)


def _watch_compiles():
    """(context manager, list) recording, per Triton compile, whether it ran in a compile-only pass."""
    from vlmctl.runtime.kernels import triton_watch

    if not triton_watch.available():
        pytest.skip("this Triton does not report compilations")
    import triton

    flags: list[bool] = []
    rt = triton.knobs.runtime

    class Watch:
        def __enter__(self):
            self.prev = rt.jit_cache_hook

            def hook(*a, **k):
                flags.append(compile_ahead.compiling_only())
                return self.prev(*a, **k) if self.prev is not None else False

            rt.jit_cache_hook = hook

        def __exit__(self, *exc):
            rt.jit_cache_hook = self.prev

    return Watch(), flags


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_warmup_compiles_everything_in_the_parallel_pass(monkeypatch):
    """A W4A16 warm-up at shapes no other test uses (so its kernels are new to this process): every Triton
    compile falls in the compile-only pass, the calls after it compile nothing, and results are right. The
    bias variant not asked for is not compiled."""
    monkeypatch.delenv("VLMCTL_COMPILE_WORKERS", raising=False)
    if not compile_ahead.available():
        pytest.skip("this Triton has no AsyncCompileMode")
    for name in ("VLMCTL_W4A16_MMA_HEURISTIC", "VLMCTL_W4A16_MMA_GEMV", "VLMCTL_W4A16_WGMMA", "VLMCTL_W4A16_GEMV_CUDA"):
        monkeypatch.setenv(name, "0")  # the Triton kernels at every row count (the NVRTC ones compile apart)
    g = 64
    dev = torch.device("cuda")
    p = _case(1088, 1472, g, seed=11, device="cuda")  # K = 23 groups: a specialization of its own
    watch, flags = _watch_compiles()
    with watch:
        W.warmup([p], g, [1, 3, 200, 1100], torch.float16, dev, biased=[True])
    assert flags and all(flags), flags  # compiled ahead, none at the real calls
    bias = torch.randn(1088, device=dev).half()
    watch2, later = _watch_compiles()
    with watch2:
        for m in (1, 3, 200, 1100):
            x = torch.randn(m, 1472, device=dev).half()
            _check(W.w4a16_linear(x, p, g, bias), x, p, g, bias, torch.float16)
    assert later == []
    with watch2:  # no bias: a variant the warm-up was told is never called, so it compiles now
        W.w4a16_linear(torch.randn(3, 1472, device=dev).half(), p, g)
    assert later, "the bias-less variant should not have been compiled by a warm-up asked for biased calls only"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_compile_only_launch_leaves_the_output_untouched(monkeypatch):
    monkeypatch.delenv("VLMCTL_COMPILE_WORKERS", raising=False)
    if not compile_ahead.available():
        pytest.skip("this Triton has no AsyncCompileMode")
    g = 128
    p = _case(1040, 1152, g, seed=12, device="cuda")
    x = torch.randn(5, 1152, device="cuda").half()
    cfg = W.Config("dot", block_n=64, block_k=128, block_m=16, num_warps=4, num_stages=2)
    y = torch.full((5, 1040), float("nan"), device="cuda", dtype=torch.float16)
    with compile_ahead.parallel_compiles() as ahead:
        assert ahead
        W.launch(x, p, g, cfg, out=y)
    torch.cuda.synchronize()
    assert torch.isnan(y).all()  # compiled, not run
    W.launch(x, p, g, cfg, out=y)
    _check(y, x, p, g, None, torch.float16)


def test_load_bench_child_reports_every_phase(tiny_llava_engine, tmp_path):
    """`benchmarks/load_gpu.py --child` (what the GPU test above and the load benchmark run) loads an engine in
    its own process and reports each load phase, on the CPU too (where nothing compiles)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "load_gpu.py"), "--child", str(tiny_llava_engine),
                           "--kv-cache-tokens", "512"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(r["phases_s"]) == ["processor", "decoder weights", "vision", "compile kernels", "decode graphs",
                                   "prefill kernels", "warm steps"]
    assert r["engine_s"] >= sum(r["phases_s"].values()) - 0.01 and r["triton_compiles_per_phase"] == {}
    assert r["nvrtc_compiles_per_phase"] == {}  # counted (the GPU test reads it), and nothing compiles here


def test_a_launcher_that_cannot_be_built_ahead_leaves_the_compile_as_it_is(monkeypatch):
    """The pool's compile also builds the kernel's launcher; where that fails (here: no GPU driver, or an
    object that is no compiled kernel) the compiled kernel is still returned, and its first launch builds
    the launcher again and reports the error there."""
    if HAS_CUDA:
        pytest.skip("on a GPU the launcher builds; test_gpu_pool_builds_the_launchers covers it")
    compiled = object()
    assert compile_ahead._compile_with_launcher(lambda: compiled) is compiled
    with pytest.raises(Exception):
        compile_ahead.build_launcher(compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_pool_builds_the_launchers(monkeypatch, tmp_path):
    """On an empty Triton cache, a warm-up's compile pass builds each launcher its new kernels need on the
    pool's threads (`triton.runtime.build._build`, Triton's gcc call, counted per thread): the warm-up's
    real calls, made after the pass, build none."""
    import threading

    from triton.runtime import build

    monkeypatch.delenv("VLMCTL_COMPILE_WORKERS", raising=False)
    if not compile_ahead.available() or not hasattr(build, "_build"):
        pytest.skip("this Triton has no AsyncCompileMode or no triton.runtime.build._build")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_ahead, "_launchers_built", set())
    for name in ("VLMCTL_W4A16_MMA_HEURISTIC", "VLMCTL_W4A16_MMA_GEMV", "VLMCTL_W4A16_WGMMA", "VLMCTL_W4A16_GEMV_CUDA"):
        monkeypatch.setenv(name, "0")
    inner = build._build
    where: list[str] = []

    def counted(*a, **k):
        where.append(threading.current_thread().name)
        return inner(*a, **k)

    monkeypatch.setattr(build, "_build", counted)
    g = 64
    dev = torch.device("cuda")
    p = _case(1112, 1600, g, seed=13, device="cuda")  # K = 25 groups: kernels no other test compiles
    W.warmup([p], g, [1, 5, 300], torch.float16, dev, biased=[False])
    assert where, "the warm-up built no launcher on an empty Triton cache"
    assert all(n.startswith("vlmctl-compile") for n in where), where
