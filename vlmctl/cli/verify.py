"""`vlmctl verify ENGINE`: check every file of an engine directory against its manifests' SHA-256."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, console, out, print_json


def verify_command(
    engine_dir: Path = typer.Argument(..., help="Engine (or work) directory made by `vlmctl build`"),
    json_: bool = JsonOption,
):
    from ..formats.artifacts import verify_engine
    from ..errors import EngineError

    if not engine_dir.is_dir():
        raise EngineError(f"{engine_dir}: no such engine directory")
    report = verify_engine(engine_dir, deep=True)
    if json_:
        print_json(report)
    else:
        for s in report["stages"]:
            mark = "[green]✓[/green]" if not s["problems"] else "[red]✗[/red]"
            out.print(f"{mark} {s['stage']}: {s['files']} files")
            for p in s["problems"]:
                console.print(f"    {p}")
    if not report["ok"]:
        n = sum(len(s["problems"]) for s in report["stages"])
        raise EngineError(f"{engine_dir}: {n} problem(s) found; rebuild the affected stages "
                          f"(`vlmctl build RECIPE -o {engine_dir}` re-runs them)")
