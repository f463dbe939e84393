"""README and docs/ against what the package has: every command-line option and every `VLMCTL_*` variable is
documented, the extras the docs name exist (and README names them all), and `vlmctl build` examples use a
bundled recipe's name (a `recipes/*.yaml` path exists only in a source checkout). docs/benchmarks.md, a
record of measurements, is not held to this."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import typer

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md")) if p.name != "benchmarks.md"}
ALL = README + "".join(DOCS.values())


def _commands(cmd, path=()):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def test_every_cli_option_is_documented():
    from vlmctl.cli.main import app

    root = typer.main.get_command(app)
    missing = []
    for name, cmd in [("(global)", root), *_commands(root)]:
        for param in cmd.params:
            if not isinstance(param, click.Option):
                continue
            for opt in (*param.opts, *param.secondary_opts):
                if opt != "--help" and not re.search(re.escape(opt) + r"(?![\w-])", ALL):
                    missing.append(f"{name} {opt}")
    assert not missing, f"options neither README nor docs/ mention: {missing}"


def test_every_vlmctl_environment_variable_is_in_the_settings_table():
    used = set()
    for path in (REPO / "vlmctl").rglob("*"):
        if path.suffix in (".py", ".cu", ".h") and path.is_file():
            used |= set(re.findall(r"\bVLMCTL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    table = DOCS["serving.md"].split("## Environment settings", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(VLMCTL_[A-Z0-9_]+)`", table))
    assert used, "no VLMCTL_ variable found in the package"
    assert not used - listed, f"read by vlmctl, missing from docs/serving.md's Environment settings: {sorted(used - listed)}"
    assert not listed - used, f"listed in docs/serving.md but read nowhere: {sorted(listed - used)}"


def test_the_extras_the_docs_name_exist_and_readme_names_them_all():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for text in (README, *DOCS.values()):
        for group in re.findall(r"pip install '(?:vlmctl|\.)\[([a-z0-9_,-]+)\]'", text):
            named |= set(group.split(","))
    assert named <= extras, f"docs install extras pyproject.toml does not have: {sorted(named - extras)}"
    setup = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    unnamed = sorted(e for e in extras if f"`{e}`" not in setup and f".[{e}]" not in setup)
    assert not unnamed, f"README's Set up does not name the extras {unnamed}"


def test_build_examples_name_bundled_recipes():
    from vlmctl.recipe import list_recipes

    for name, text in [("README.md", README), *DOCS.items()]:
        paths = re.findall(r"vlmctl build (recipes/\S+)", text)
        assert not paths, f"{name}: `vlmctl build {paths[0]}` works only in a source checkout; name the bundled recipe"
    bundled = {r["name"] for r in list_recipes()}
    for name, text in [("README.md", README), *DOCS.items()]:
        for recipe in re.findall(r"vlmctl build ([a-z][a-z0-9.-]*[a-z0-9])\b", text):
            if recipe not in ("RECIPE", "NAME"):
                assert recipe in bundled, f"{name}: `vlmctl build {recipe}` names no bundled recipe"
