"""Which TensorRT-LLM: the interpreter that has it and the version installed there.

TensorRT-LLM 1.2 pins transformers 4.57 and vlmctl needs 5, so TensorRT-LLM usually lives in
another Python environment, named by $VLMCTL_TRTLLM_PYTHON. That interpreter is always asked
itself: a venv made from the same base Python as vlmctl's resolves (realpath) to the very same
executable file but has another site-packages, so comparing paths says nothing.

What it is not: the build (export/trtllm.py) or the runtime client (runtime/trtllm_decoder.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..errors import BackendUnavailableError

SUPPORTED = ((1, 2),)
PYTHON_ENV = "VLMCTL_TRTLLM_PYTHON"
_VERSION_PROBE = "import importlib.metadata as m; print(m.version('tensorrt_llm'))"


def trtllm_python() -> str:
    """The interpreter that has tensorrt_llm: $VLMCTL_TRTLLM_PYTHON, else this one."""
    return os.environ.get(PYTHON_ENV) or sys.executable


def trtllm_version(python: str | None = None) -> str | None:
    """tensorrt_llm's installed version as `python` sees it (None when it is not installed there).

    Only when no interpreter is configured is this process's own metadata read; a configured
    one is always run, even when it is (or links to) this very executable."""
    if python is None and not os.environ.get(PYTHON_ENV):
        import importlib.metadata as md

        try:
            return md.version("tensorrt_llm")
        except md.PackageNotFoundError:
            return None
    python = python or trtllm_python()
    try:
        proc = subprocess.run([python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def version_supported(version: str) -> bool:
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    return major_minor in SUPPORTED


def trtllm_available(required: bool = False) -> bool:
    python = trtllm_python()
    version = trtllm_version(None if not os.environ.get(PYTHON_ENV) else python)
    where = f"{python} (set {PYTHON_ENV} to another interpreter)" if os.environ.get(PYTHON_ENV) else \
        f"this Python ({python}); TensorRT-LLM 1.2 pins transformers 4.57, so it usually lives in its own " \
        f"environment: point {PYTHON_ENV} at that interpreter"
    if version is None:
        if required:
            raise BackendUnavailableError(f"decoder.backend is trtllm but tensorrt_llm is not installed in {where}")
        return False
    if not version_supported(version):
        if required:
            raise BackendUnavailableError(f"tensorrt_llm {version} in {python} is not supported: the engine flow "
                                          "(checkpoint -> trtllm-build -> executor) needs 1.2.x")
        return False
    return True
