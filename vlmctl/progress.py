"""Progress reporting from library code.

Library functions take an optional `progress` callback and never print. The CLI passes a
Rich-backed reporter; `--json` and Python callers pass nothing (or their own).
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def task(self, description: str, total: float | None = None) -> "Task": ...

    def log(self, message: str) -> None: ...


class Task(Protocol):
    def advance(self, amount: float = 1.0) -> None: ...

    def done(self) -> None: ...


class _NullTask:
    def advance(self, amount: float = 1.0) -> None:
        pass

    def done(self) -> None:
        pass


class NullProgress:
    """Reports nothing: the default for library calls."""

    def task(self, description: str, total: float | None = None) -> _NullTask:
        return _NullTask()

    def log(self, message: str) -> None:
        pass


def ensure(progress: Progress | None) -> Progress:
    return progress if progress is not None else NullProgress()
