from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, SetOption, command_line_sets, print_json, progress_for, render_stage


def convert_command(
    source: str = typer.Argument(..., help="HF checkpoint directory (or hub id in the local cache), or a recipe .yaml"),
    output: Path = typer.Option(..., "-o", "--output", help="Work directory to create or update"),
    dtype: str = typer.Option(None, "--dtype", help="float32 | float16 | bfloat16 (default: the recipe's, or float16)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run even if the cache says nothing changed"),
    json_: bool = JsonOption,
):
    from ..pipeline import convert
    from ..recipe import load_recipe, recipe_from_source

    sets = command_line_sets(overrides) + ([f"dtype={dtype}"] if dtype else [])
    recipe = load_recipe(source, sets) if source.endswith((".yaml", ".yml")) else recipe_from_source(source, sets)
    with progress_for(json_) as progress:
        res = convert(recipe, output, force=force, progress=progress)  # saves the recipe once converted
    if json_:
        print_json(res.to_json())
    else:
        render_stage(res)
