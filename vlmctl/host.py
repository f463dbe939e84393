"""What this host offers the compute commands: the torch device and the CPU thread count (and, for
the reports of long commands, the process's peak memory).

The CLI calls `resolve_device` and `configure_threads` once per command, before loading a model, so
a device this host lacks or a thread count that cannot work is one `error:` line (exit 2), not a
torch traceback. This module does not pick kernels or backends; it only answers "where" and "how
many threads".
"""

from __future__ import annotations

import os

from .errors import OptionError

_configured: int | None = None


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cgroup cpusets), else all of them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """torch's CPU threads when the user names none.

    torch's own default is one thread per physical core. On a host where anything else runs (the
    tokenizer, ONNX Runtime, the HTTP server, other users), that oversubscribes the cores and every
    thread waits for the slowest (issue 9: on a busy 2-core host, 128 demo tokens took 174 s with
    torch's 2 threads, 22 s with 1). So: the CPUs this process may use minus one, at least one,
    never more than torch's default. An explicit OMP_NUM_THREADS is the user's choice and wins.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, min(available_cpus(), torch.get_num_threads()) - 1)


def configure_threads(threads: int | None) -> int:
    """Set torch's CPU threads (`threads`, or `default_num_threads()` when None); returns the count."""
    global _configured
    if threads is not None and threads < 1:
        raise OptionError(f"--threads {threads}: must be at least 1")
    import torch

    n = default_num_threads() if threads is None else threads
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _configured = n
    return n


def configured_threads() -> int | None:
    """The count `configure_threads` set in this process (None when it was not called)."""
    return _configured


def resolve_device(device: str | None) -> str:
    """`cpu`, `cuda` or `cuda:N`; None picks cuda when available. A device this host lacks is an OptionError."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    d = device.strip().lower()
    if d == "cpu":
        return d
    if d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()):
        if not torch.cuda.is_available():
            raise OptionError(f"--device {device}: no CUDA device is available here (torch {torch.__version__}"
                              f"{'' if torch.version.cuda else ', a CPU-only build'}); use --device cpu")
        if ":" in d and int(d[5:]) >= torch.cuda.device_count():
            raise OptionError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA device(s)")
        return d
    raise OptionError(f"--device {device!r}: expected cpu, cuda or cuda:N")


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB.

    Linux's VmHWM is the high-water mark of the current address space; getrusage's ru_maxrss also
    counts the parent's memory at fork/exec time, which makes a child look as big as its parent.
    """
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
        for line in lines:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cuda_graphs_allowed() -> bool:
    """False when VLMCTL_CUDA_GRAPHS=0: every CUDA-graph capture (decode steps, vision tower) is off,
    whatever the engine options say (debugging, A/B measurements)."""
    return os.environ.get("VLMCTL_CUDA_GRAPHS", "1") != "0"
