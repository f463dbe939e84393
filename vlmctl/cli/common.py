"""Shared CLI pieces: Rich progress reporter, JSON output, stage-result rendering."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

SetOption = typer.Option(None, "--set", help="Override a recipe key: --set dotted.key=value (repeatable)")
JsonOption = typer.Option(False, "--json", help="Print one machine-readable JSON object instead of progress")


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


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def progress_for(json_mode: bool):
    """A context manager giving a progress reporter (None in --json mode)."""
    return _NoProgress() if json_mode else RichProgress()


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


def run_stage_command(stage_fn, workdir, overrides, force: bool, json_: bool) -> None:
    """The body of every stand-alone stage command: the work directory's recipe (+ --set), run, report."""
    from ..pipeline import load_workdir_recipe, save_recipe

    recipe = load_workdir_recipe(workdir, overrides)
    if overrides:
        save_recipe(workdir, recipe)
    with progress_for(json_) as progress:
        res = stage_fn(recipe, workdir, force=force, progress=progress)
    if json_:
        print_json(res.to_json())
    else:
        render_stage(res)
