"""Shared CLI pieces: Rich progress reporter, JSON output, stage-result rendering."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

SetOption = typer.Option(None, "--set", help="Override a recipe key: --set dotted.key=value (repeatable)")
JsonOption = typer.Option(False, "--json", help="Print one machine-readable JSON object instead of progress")
KvCacheDtypeOption = typer.Option("auto", "--kv-cache-dtype", help="KV cache storage: auto (the model's dtype), "
                                  "int8 or fp8 (8 bits with a scale a token and KV head: about 1.9x the tokens in "
                                  "the same memory; the torch decoder only)")


class RichProgress:
    """Implements vlmctl.progress.Progress with Rich progress bars on stderr."""

    def __init__(self):
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=True)

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc):
        self._progress.stop()

    def task(self, description: str, total: float | None = None):
        tid = self._progress.add_task(description, total=total)
        progress = self._progress

        class _Task:
            def advance(self, amount: float = 1.0) -> None:
                progress.advance(tid, amount)

            def done(self) -> None:
                progress.remove_task(tid)

        return _Task()

    def log(self, message: str) -> None:
        self._progress.console.print(message)


class PlainProgress:
    """Implements vlmctl.progress.Progress for a stderr that is not a terminal (a CI log, a file): a line
    when a task starts, and for a counted task one at each tenth reached at least 5 s after the last line,
    with the time so far; no redrawn bars."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def task(self, description: str, total: float | None = None):
        start = time.monotonic()
        state = {"done": 0.0, "tenths": 0, "shown": start}
        self.log(f"{description} ..." if not total else f"{description}: 0/{total:g}")

        class _Task:
            def advance(task, amount: float = 1.0) -> None:
                state["done"] += amount
                tenths = int(10 * state["done"] / total) if total else 0
                now = time.monotonic()
                if tenths > state["tenths"] and now - state["shown"] >= 5:
                    state["tenths"], state["shown"] = tenths, now
                    self.log(f"{description}: {state['done']:g}/{total:g} ({time.monotonic() - start:.0f}s)")

            def done(task) -> None:
                pass

        return _Task()

    def log(self, message: str) -> None:
        console.print(message, markup=False, highlight=False)


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def progress_for(json_mode: bool):
    """A context manager giving a progress reporter (None in --json mode): bars on a terminal, plain
    lines elsewhere (a CI log would get nothing from bars that only a terminal redraws)."""
    if json_mode:
        return _NoProgress()
    return RichProgress() if console.is_terminal else PlainProgress()


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, default=str) + "\n")
    sys.stdout.flush()


def render_stage(res) -> None:
    if res.skipped:
        console.print(f"[dim]-[/dim] {res.name}: skipped ({res.skipped})")
    elif res.cached:
        console.print(f"[green]✓[/green] {res.name}: cached [dim]({res.directory})[/dim]")
    else:
        console.print(f"[green]✓[/green] {res.name}: done in {res.seconds:.1f}s [dim]({res.directory})[/dim]")
        note = res.info.get("note") if res.info else None
        if note:
            console.print(f"  [yellow]note:[/yellow] {note}")


def command_line_sets(overrides: list[str] | None) -> list[str]:
    """`--set` items as typed, with the paths among them made absolute against the current directory: a path
    typed on the command line is relative to where it was typed, while the recipe resolves its own values
    against its file's directory (and a work directory's saved recipe against that). `source` stays as
    typed when it reads as a hub id (`org/name`, no such local directory or parent directory here);
    `quantization.calibration.data` when it reads as a dataset name (no such file here, no file suffix)."""
    import os
    from pathlib import Path

    from ..quant.calibration import _looks_like_file
    from ..recipe import parse_override

    items = []
    for item in overrides or []:
        parts, value = parse_override(item)
        if isinstance(value, str) and value and parts in (["source"], ["quantization", "calibration", "data"]):
            path = Path(os.path.expanduser(value))
            here = Path.cwd() / path
            if parts == ["source"]:
                hub_id = value.count("/") == 1 and not value.startswith((".", "/", "~"))
                local = not hub_id or here.exists() or here.parent.is_dir()
            else:
                local = here.exists() or _looks_like_file(value)
            if local and not path.is_absolute():
                item = f"{item.split('=', 1)[0]}={os.path.abspath(here)}"
        items.append(item)
    return items


def run_stage_command(stage: str, workdir, overrides, force: bool, json_: bool) -> None:
    """The body of every stand-alone stage command: the work directory's recipe (+ --set), run, report
    (pipeline.run_stage_alone: stale inputs refused, the recipe saved only on success)."""
    from ..pipeline import run_stage_alone

    with progress_for(json_) as progress:
        res = run_stage_alone(stage, workdir, command_line_sets(overrides), force=force, progress=progress)
    if json_:
        print_json(res.to_json())
    else:
        render_stage(res)
