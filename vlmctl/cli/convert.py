from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, SetOption, print_json, progress_for, render_stage


def convert_command(
    source: str = typer.Argument(..., help="HF checkpoint directory (or hub id in the local cache), or a recipe .yaml"),
    output: Path = typer.Option(..., "-o", "--output", help="Work directory to create or update"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | float16 | bfloat16 (default: the recipe's, or float16)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run even if the cache says nothing changed"),
    json_: bool = JsonOption,
):
    from ..pipeline import save_recipe, stage_convert
    from ..recipe import load_recipe, recipe_from_source

    sets = list(overrides or []) + ([f"dtype={dtype}"] if dtype else [])
    recipe = load_recipe(source, sets) if source.endswith((".yaml", ".yml")) else recipe_from_source(source, sets)
    save_recipe(output, recipe)
    with progress_for(json_) as progress:
        res = stage_convert(recipe, output, force=force, progress=progress)
    if json_:
        print_json(res.to_json())
    else:
        render_stage(res)
