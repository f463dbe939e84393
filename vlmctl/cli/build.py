from __future__ import annotations

import time
from pathlib import Path

import typer

from .common import JsonOption, SetOption, command_line_sets, console, out, print_json, progress_for, render_stage


def build_command(
    recipe_path: str = typer.Argument(..., metavar="RECIPE", help="Recipe file, or a bundled recipe name"),
    output: Path = typer.Option(None, "-o", "--output", help="Engine directory (default: engines/<recipe name>)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run every stage"),
    until: str = typer.Option(None, "--until", help="Stop after this stage"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved recipe and the plan; run nothing"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs minus "
                                                              "one)"),
    json_: bool = JsonOption,
):
    from ..host import configure_threads
    from ..pipeline import build, next_stage, plan
    from ..recipe import load_recipe

    recipe = load_recipe(recipe_path, command_line_sets(overrides))
    output = output or Path("engines") / recipe.name
    if until is not None:
        from ..errors import RecipeError
        from ..formats.workdir import STAGES

        if until not in STAGES:
            raise RecipeError(f"--until {until!r}: unknown stage (stages: {', '.join(STAGES)})")
    if dry_run:
        items = plan(recipe, output, until, force=force)
        if json_:
            print_json({"recipe": recipe.public_dict(), "output": str(output),
                        "plan": [{"stage": i.stage, "runs": i.will_run, "reason": i.reason} for i in items]})
            return
        import yaml

        out.print("[bold]resolved recipe[/bold]")
        out.print(yaml.safe_dump(recipe.public_dict(), sort_keys=False).rstrip())
        out.print(f"[bold]plan[/bold] (output: {output})")
        for i in items:
            out.print(f"  {'run ' if i.will_run else 'skip'} {i.stage}: {i.reason}")
        return
    configure_threads(threads)
    t0 = time.perf_counter()
    with progress_for(json_) as progress:
        results = build(recipe, output, until=until, force=force, progress=progress,
                        on_stage=None if json_ else render_stage)
    total = time.perf_counter() - t0
    pending = next_stage(recipe, until)  # --until stopped before the engine was complete
    if json_:
        done = {"engine_dir": str(output), "seconds": round(total, 3), "complete": pending is None}
        if pending:
            done["next_stage"] = pending
        print_json({**done, "stages": [r.to_json() for r in results]})
    elif pending:
        console.print(f"[bold]built up to {until}:[/bold] {output} ({total:.1f}s); not an engine yet: the next "
                      f"stage is {pending} (`vlmctl {pending} {output}`, or `vlmctl build` without --until)")
    else:
        console.print(f"[bold]engine ready:[/bold] {output} ({total:.1f}s) — try `vlmctl chat {output}`")
