from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, SetOption, print_json, progress_for, render_stage


def export_vision_command(
    workdir: Path = typer.Argument(..., help="Work directory made by `vlmctl convert` (or `vlmctl build`)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run even if the cache says nothing changed"),
    json_: bool = JsonOption,
):
    from ..pipeline import load_workdir_recipe, save_recipe, stage_export_vision

    recipe = load_workdir_recipe(workdir, overrides)
    if overrides:
        save_recipe(workdir, recipe)
    with progress_for(json_) as progress:
        res = stage_export_vision(recipe, workdir, force=force, progress=progress)
    if json_:
        print_json(res.to_json())
    else:
        render_stage(res)
