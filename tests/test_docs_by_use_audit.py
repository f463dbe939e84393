"""Findings of a docs-by-use audit: what README.md says a command does, run through the CLI."""

from __future__ import annotations

import json

from conftest import cli


def test_recipes_with_a_recipes_dir_that_is_not_a_directory_is_exit_2(tmp_path, monkeypatch, capsys):
    """README: `VLMCTL_RECIPES_DIR=DIR` makes DIR the directory of named recipes, and a bad value in a `VLMCTL_*`
    setting is exit code 2. A DIR that does not exist (a typo) listed no recipes and exited 0."""
    import vlmctl.recipe

    missing = tmp_path / "no-such-dir"
    monkeypatch.setenv("VLMCTL_RECIPES_DIR", str(missing))
    monkeypatch.setattr(vlmctl.recipe, "RECIPES_DIR", missing)  # read at import; the variable alone is too late
    _, out, err = cli("recipes", "--json", capsys=capsys, expect=2)
    assert out == ""
    assert err.startswith("error: VLMCTL_RECIPES_DIR=") and "not a directory" in err and len(err.splitlines()) == 1


def test_build_by_name_with_a_recipes_dir_that_is_not_a_directory_names_the_variable(tmp_path, monkeypatch, capsys):
    """`vlmctl build NAME` looked NAME up in the missing directory and said "no bundled recipe of that name"."""
    import vlmctl.recipe

    missing = tmp_path / "no-such-dir"
    monkeypatch.setenv("VLMCTL_RECIPES_DIR", str(missing))
    monkeypatch.setattr(vlmctl.recipe, "RECIPES_DIR", missing)
    _, _, err = cli("build", "demo", "-o", tmp_path / "out", capsys=capsys, expect=2)
    assert err.startswith("error: VLMCTL_RECIPES_DIR=") and "not a directory" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_profiles_with_a_configs_dir_that_is_not_a_directory_names_the_variable(tmp_path, monkeypatch, capsys):
    """A recipe's profiles looked up in a missing VLMCTL_CONFIGS_DIR said "unknown profile ... (known: none)"."""
    import vlmctl.recipe

    missing = tmp_path / "no-such-configs"
    monkeypatch.setenv("VLMCTL_CONFIGS_DIR", str(missing))
    monkeypatch.setattr(vlmctl.recipe, "CONFIGS_DIR", missing)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"name: mine\nsource: {tmp_path / 'ckpt'}\nprofiles: [fp16]\n")
    _, _, err = cli("build", recipe, "-o", tmp_path / "out", "--dry-run", capsys=capsys, expect=2)
    assert err.startswith("error: VLMCTL_CONFIGS_DIR=") and "not a directory" in err and len(err.splitlines()) == 1


def test_recipes_with_a_recipes_dir_lists_its_recipes(tmp_path, monkeypatch, capsys):
    import vlmctl.recipe

    (tmp_path / "mine.yaml").write_text("name: mine\nsource: ckpt\n")
    monkeypatch.setenv("VLMCTL_RECIPES_DIR", str(tmp_path))
    monkeypatch.setattr(vlmctl.recipe, "RECIPES_DIR", tmp_path)
    _, out, _ = cli("recipes", "--json", capsys=capsys)
    assert [r["name"] for r in json.loads(out)] == ["mine"]


def test_chat_takes_every_stop_string_given(tiny_llava_engine, capsys):
    """README: `vlmctl chat ... [--stop S]...`, repeatable. A fifth --stop failed after the engine loaded (exit 5)
    with OpenAI's per-request cap of 4 and a pointer to `vlmctl serve --max-stop-sequences`, an option chat
    does not have: the cap is the server's, against its clients, not the command line's."""
    stops = [a for s in ("zz1", "zz2", "zz3", "zz4", "zz5", "zz6") for a in ("--stop", s)]
    _, out, err = cli("chat", tiny_llava_engine, "-p", "hello", "--max-tokens", "3", "--json", *stops,
                      capsys=capsys)
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["completion_tokens"] >= 1 and "max-stop-sequences" not in err
