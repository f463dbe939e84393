"""`kernels.triton_watch` on the CPU: the compile hook it installs collects what Triton reports, defers to a
hook set before it, and is removed afterwards. (That Triton calls it on a real compile is checked on the GPU:
tests/test_gpu_runtime.py::test_serving_compiles_no_triton_kernel_after_load.)"""

from __future__ import annotations

import pytest

from vlmctl.runtime.kernels import triton_watch

pytestmark = pytest.mark.skipif(not triton_watch.available(), reason="this Triton has no jit_cache_hook")


def test_hook_collects_defers_and_restores():
    import triton

    runtime = triton.knobs.runtime
    original = runtime.jit_cache_hook  # whatever this process had set, put back at the end
    calls = []

    def earlier(*args, **kwargs):
        calls.append(kwargs["repr"])
        return True  # "skip the compile": ours must pass that answer on

    runtime.jit_cache_hook = earlier
    try:
        with triton_watch.triton_compiles() as seen:
            assert runtime.jit_cache_hook is not earlier
            assert runtime.jit_cache_hook(repr="_decode_kernel[num_warps=4](...)", fn=None) is True
        assert seen == ["_decode_kernel[num_warps=4](...)"] and calls == seen
        assert runtime.jit_cache_hook is earlier
        runtime.jit_cache_hook = None
        with triton_watch.triton_compiles() as seen:
            assert runtime.jit_cache_hook(repr="k", key=1) is False
            runtime.jit_cache_hook(repr="k", key=1)  # the same specialization again (a pool's pending compile)
            runtime.jit_cache_hook(repr="k", key=2)
        assert seen == ["k", "k"] and runtime.jit_cache_hook is None
    finally:
        runtime.jit_cache_hook = original
