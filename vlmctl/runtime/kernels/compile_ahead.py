"""Compile a warm-up's Triton kernels several at a time before any of them runs.

An engine compiles its linears' Triton kernels at load, one specialization after another (0.1-1 s each on
a cold cache). Inside `parallel_compiles()`, a launch made through `run` only submits its kernel's compile
to a thread pool (Triton's AsyncCompileMode) and returns; the block's exit waits for them all. The caller
then makes the same launches for real, which find every kernel compiled. NVRTC kernels have their own
parallel precompile (`cuda_rtc.precompile`); callers skip their launches while `compiling_only()`.

Each pooled compile also builds its kernel's launcher: the small C extension Triton compiles with gcc for each
new argument signature at a kernel's first launch, one after another (`build_launcher`). Built in the pool,
it lands in Triton's cache, where that first launch finds it.

Threads, not processes: Triton's compile pipeline holds the GIL for part of its work but not while ptxas
or gcc runs (four sm_90 GEMV compiles took 2.07 s on two threads against 2.72 s one after another, on the
2-core development machine, without a GPU). `VLMCTL_COMPILE_WORKERS=1` turns it off.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading

log = logging.getLogger(__name__)

_COMPILE_ONLY = contextvars.ContextVar("vlmctl_triton_compile_only", default=False)


def compiling_only() -> bool:
    """Whether launches should only compile (inside `parallel_compiles`)."""
    return _COMPILE_ONLY.get()


def run(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); inside `parallel_compiles`, only its compile, submitted to the pool."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
        return None
    return kernel[grid](*args, **kwargs)


def workers() -> int:
    """Compile threads: `VLMCTL_COMPILE_WORKERS` (1 or more; anything else is an OptionError: one line and exit
    code 2 from the CLI, not an engine failure), else up to 8 (one per CPU core)."""
    from .settings import env_int

    return env_int("VLMCTL_COMPILE_WORKERS", max(1, min(8, os.cpu_count() or 1)), minimum=1)


def _async_compile_mode():
    """Triton's AsyncCompileMode (Triton 3.4+), or None where this Triton lacks it."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def available() -> bool:
    """Whether `parallel_compiles` compiles anything ahead: a Triton with AsyncCompileMode, not its
    interpreter (which compiles nothing), and more than one worker."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or workers() < 2:
        return False
    try:
        return _async_compile_mode() is not None
    except Exception:  # a Triton that fails to import: nothing to compile ahead
        return False


_launcher_guard = threading.Lock()
_launcher_locks: dict[str, threading.Lock] = {}
_launchers_built: set[str] = set()


def build_launcher(kernel) -> bool:
    """Build a compiled Triton kernel's launcher into Triton's cache, once per process and signature (kernels
    that share one share its launcher). Returns whether this call built it. Needs Triton's GPU driver."""
    from triton.runtime.driver import driver

    src, metadata = kernel.src, kernel.metadata
    # what the launcher's C source is made of (triton/backends/nvidia/driver.py, CudaLauncher)
    key = repr((src.signature, getattr(src, "constants", None), getattr(metadata, "tensordesc_meta", None)))
    with _launcher_guard:
        lock = _launcher_locks.setdefault(key, threading.Lock())
    with lock:  # two threads with one signature: the second waits, then finds it built
        if key in _launchers_built:
            return False
        driver.active.launcher_cls(src, metadata)
        _launchers_built.add(key)
        return True


def _compile_with_launcher(compile_fn):
    kernel = compile_fn()
    try:
        build_launcher(kernel)
    except Exception as e:  # the kernel's first launch builds it again and raises where it belongs
        log.debug("launcher not built ahead: %s: %s", type(e).__name__, e)
    return kernel


@functools.cache
def _launcher_building_mode(mode_cls):
    """`mode_cls` (Triton's AsyncCompileMode) whose pooled compiles also build their kernels' launchers."""

    class LauncherBuildingCompileMode(mode_cls):
        def submit(self, key, compile_fn, *rest):  # Triton 3.4-3.6 pass finalize_fn, 3.7+ also cleanup_fn
            return super().submit(key, functools.partial(_compile_with_launcher, compile_fn), *rest)

    return LauncherBuildingCompileMode


@contextlib.contextmanager
def parallel_compiles():
    """Inside the block, launches through `run` compile on a thread pool instead of running (yields True);
    at exit, wait for every compile. Where `available()` is False the block is skipped in effect: it yields
    False, and callers should not make their compile-only launches."""
    if _COMPILE_ONLY.get():  # nested in another block: its pool takes these compiles too
        yield True
        return
    if not available():
        yield False
        return
    from concurrent.futures import ThreadPoolExecutor

    mode_cls = _launcher_building_mode(_async_compile_mode())
    token = _COMPILE_ONLY.set(True)
    try:
        with ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="vlmctl-compile") as pool:
            # A compile that fails here is ignored: the real launch after the block compiles it again
            # and raises its error where it belongs.
            with mode_cls(pool, ignore_errors=True):
                yield True
    finally:
        _COMPILE_ONLY.reset(token)


def warm(calls, call, *, gpu: bool, prepare=None) -> None:
    """Make a warm-up's calls (`call(*c)` for each of `calls`) with their Triton kernels compiled several at a
    time. Inside an enclosing `parallel_compiles` block, only their compiles are submitted. Otherwise
    `prepare()` runs first (a caller's NVRTC precompile), then, on a GPU, one compile-only pass on the pool,
    then every call for real."""
    if _COMPILE_ONLY.get():
        for c in calls:
            call(*c)
        return
    if prepare is not None:
        prepare()
    if gpu:
        with parallel_compiles() as ahead:
            for c in calls if ahead else ():
                call(*c)
    for c in calls:
        call(*c)


__all__ = ["available", "build_launcher", "compiling_only", "parallel_compiles", "run", "warm", "workers"]
