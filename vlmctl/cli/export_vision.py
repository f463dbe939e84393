from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, SetOption, run_stage_command


def export_vision_command(
    workdir: Path = typer.Argument(..., help="Work directory made by `vlmctl convert` (or `vlmctl build`)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run even if the cache says nothing changed"),
    json_: bool = JsonOption,
):
    run_stage_command("export-vision", workdir, overrides, force, json_)
