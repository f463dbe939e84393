"""Which Triton kernels compile while a block of code runs. A Triton kernel compiles once per
specialization (argument dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), taking
0.1-0.5 s: a serving engine should compile everything at load, since a step that meets a new
specialization mid-serving stalls every running request (docs/benchmarks.md, session 19). Used by the
GPU tests and `benchmarks/serving_gpu.py` to find such steps."""

from __future__ import annotations

import contextlib


def _runtime_knobs():
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


def available() -> bool:
    """Whether this Triton reports compilations (`triton.knobs.runtime.jit_cache_hook`, Triton 3.4+)."""
    try:
        return _runtime_knobs() is not None
    except ImportError:
        return False


@contextlib.contextmanager
def triton_compiles():
    """Yields a list that collects one line per kernel specialization Triton compiles (or loads from its
    disk cache) inside the block: the kernel's name, launch options and argument types."""
    runtime = _runtime_knobs()
    if runtime is None:
        raise RuntimeError("this Triton does not report compilations (triton.knobs.runtime.jit_cache_hook)")
    seen: list[str] = []
    keys: set = set()
    previous = runtime.jit_cache_hook

    def hook(*args, **kwargs):
        # once per specialization: a compile submitted to a pool (compile_ahead) is reported at each launch
        # until the pool finishes it
        key = (str(kwargs.get("repr", "?")), str(kwargs.get("key")))
        if key not in keys:
            keys.add(key)
            seen.append(key[0])
        # a hook that returns True makes Triton skip the compile: defer to any hook set before ours
        return previous(*args, **kwargs) if previous is not None else False

    runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_cache_hook = previous
