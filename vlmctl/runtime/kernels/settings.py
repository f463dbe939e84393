"""The kernels' numeric environment settings (VLMCTL_*), parsed one way: a bad value raises `OptionError`, which
the CLI prints as one line with exit code 2 (a setting like a command-line option) instead of a traceback."""

from __future__ import annotations

import os

from ...errors import OptionError


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """The integer in environment variable `name`, or `default` where it is unset or blank."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise OptionError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value
