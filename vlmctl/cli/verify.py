"""`vlmctl verify ENGINE`: check every file of an engine directory against its manifests' SHA-256."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, console, out, print_json

HELP = """Check an engine directory against its stages' manifests: every stage a complete engine has run is there
(a missing one, as after `build --until`, is named with the next stage to run), and every file a manifest lists
has its size and SHA-256. Exit 8 on any problem. A file that no manifest lists (one put there by hand) is
reported as a warning, not checked, and does not fail the check."""

MAX_UNLISTED_LINES = 20  # warning lines for files no manifest lists; the rest are counted


def verify_command(
    engine_dir: Path = typer.Argument(..., help="Engine (or work) directory made by `vlmctl build`"),
    json_: bool = JsonOption,
):
    from ..errors import EngineError
    from ..formats.artifacts import verify_engine
    from ..formats.workdir import STAGES, incomplete_engine, not_an_engine

    if not engine_dir.is_dir():
        raise EngineError(f"{engine_dir}: no such engine directory")
    if not any((engine_dir / s).is_dir() for s in STAGES):
        raise EngineError(not_an_engine(engine_dir))
    report = verify_engine(engine_dir, deep=True)
    if json_:
        print_json(report)
    else:
        for s in report["stages"]:
            mark = "[green]✓[/green]" if not s["problems"] else "[red]✗[/red]"
            out.print(f"{mark} {s['stage']}: " + ("not run" if s["missing"] else f"{s['files']} files"))
            for p in s["problems"]:
                console.print(f"    {p}")
        unlisted = report["unlisted"]
        for rel in unlisted[:MAX_UNLISTED_LINES]:
            console.print(f"[yellow]warning:[/yellow] {rel} is in no manifest (not written by a stage; not checked)",
                          highlight=False)
        if len(unlisted) > MAX_UNLISTED_LINES:
            console.print(f"[yellow]warning:[/yellow] and {len(unlisted) - MAX_UNLISTED_LINES} more file(s) in no "
                          "manifest (`vlmctl verify --json` lists them)", highlight=False)
    if not report["ok"]:
        damaged = sum(len(s["problems"]) for s in report["stages"] if not s["missing"])
        if not report["complete"]:
            more = f"; and {damaged} problem(s) in the stages that ran" if damaged else ""
            raise EngineError(incomplete_engine(engine_dir) + more)
        raise EngineError(f"{engine_dir}: {damaged} problem(s) found; rebuild the affected stages "
                          f"(`vlmctl build RECIPE -o {engine_dir}` re-runs them)")
