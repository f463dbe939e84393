"""Compile a warm-up's Triton kernels several at a time before any of them runs.

An engine compiles its linears' Triton kernels at load, one specialization after another (0.1-1 s each on
a cold cache). Inside `parallel_compiles()`, a launch made through `run` only submits its kernel's compile
to a thread pool (Triton's AsyncCompileMode) and returns; the block's exit waits for them all. The caller
then makes the same launches for real, which find every kernel compiled. NVRTC kernels have their own
parallel precompile (`cuda_rtc.precompile`); callers skip their launches while `compiling_only()`.

Threads, not processes: Triton's compile pipeline holds the GIL for part of its work but not while ptxas
runs (four sm_90 GEMV compiles took 2.07 s on two threads against 2.72 s one after another, on the 2-core
development machine, without a GPU). `VLMCTL_COMPILE_WORKERS=1` turns it off.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

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
    """Compile threads: `VLMCTL_COMPILE_WORKERS`, else up to 8 (one per CPU core)."""
    env = os.environ.get("VLMCTL_COMPILE_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            from ...errors import OptionError  # one line and exit code 2 from the CLI, not an engine failure

            raise OptionError(f"VLMCTL_COMPILE_WORKERS must be an integer, not {env!r}") from None
    return max(1, min(8, os.cpu_count() or 1))


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

    mode_cls = _async_compile_mode()
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


__all__ = ["available", "compiling_only", "parallel_compiles", "run", "warm", "workers"]
