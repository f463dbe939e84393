"""The GPU this process would build for: its compute capability, without needing CUDA torch.

TensorRT and TensorRT-LLM engines are built for one GPU architecture, so the capability goes
into stage cache keys, and a few features depend on it (TensorRT-LLM 1.2's int4 weight-only
kernels stop at SM 90). Not a device manager.
"""

from __future__ import annotations

import os
import shutil
import subprocess

ENV = "VLMCTL_CUDA_CAPABILITY"  # "9.0": builds on a machine without the target GPU attached


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of GPU 0, from $VLMCTL_CUDA_CAPABILITY, CUDA torch, or nvidia-smi; None without one."""
    forced = os.environ.get(ENV)
    if forced:
        major, _, minor = forced.partition(".")
        return int(major), int(minor or 0)
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability(0))
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out:
        return None
    major, _, minor = out[0].partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() else None


def sm_string(cap: tuple[int, int] | None) -> str | None:
    return None if cap is None else f"sm_{cap[0]}{cap[1]}"
