"""Recipe loading: profiles, overrides, and errors that name the file and the key path."""

from __future__ import annotations

import pytest

from vlmctl.errors import RecipeError
from vlmctl.recipe import RECIPES_DIR, list_recipes, load_recipe


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_profiles_merge_under_recipe_and_set_overrides_last(tmp_path):
    p = write(tmp_path, "source: ./ckpt\nprofiles: [fp16]\nlimits: {max_batch_size: 3}\n")
    r = load_recipe(p, ["limits.max_output_len=77", "quantization.method=awq", "dtype=float32"])
    assert r.dtype == "float32"  # --set beats the profile
    assert r.limits.max_batch_size == 3  # recipe beats the profile
    assert r.limits.max_input_len == 2048  # from the profile
    assert r.limits.max_output_len == 77
    assert r.quantization.method == "awq"
    assert r.resolve_path(r.source) == (tmp_path / "ckpt").resolve()


@pytest.mark.parametrize("text,overrides,fragment", [
    ("source: x\nlimits: {max_batch: 4}\n", [], "limits.max_batch: unknown key"),
    ("source: x\nlimits: {max_batch_size: many}\n", [], "limits.max_batch_size: Input should be a valid integer"),
    ("source: x\n", ["quantization.method=gptq"], "quantization.method: Input should be 'none' or 'awq'"),
    ("dtype: float16\n", [], "source: required key is missing"),
    ("source: x\nprofiles: [nope]\n", [], "unknown profile 'nope'"),
    ("source: [unclosed\n", [], "invalid YAML"),
    ("- a\n- b\n", [], "must be a mapping"),
    ("source: x\n", ["novalue"], "expected dotted.key=value"),
])
def test_errors_name_file_and_key(tmp_path, text, overrides, fragment):
    p = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, overrides)
    assert fragment in str(e.value)
    if "dotted.key" not in fragment:
        assert str(p) in str(e.value)


def test_bundled_recipes_all_validate():
    names = [r["name"] for r in list_recipes()]
    assert {"demo", "llava-1.5-7b", "llava-1.5-13b"} <= set(names)
    for name in names:
        load_recipe(RECIPES_DIR / f"{name}.yaml")  # raises on any invalid bundled recipe


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe"):
        load_recipe(tmp_path / "absent.yaml")


# ---- --set values and keys that must not slip through -------------------------------------------
@pytest.mark.parametrize("item,fragment", [
    ("vision.validate_batch_size=yes", "vision.validate_batch_size: expected a number, got the boolean true"),
    ("vision.validate_batch_size=100000", "vision.validate_batch_size: Input should be less than or equal to 64"),
    ("limits.max_batch_size=true", "limits.max_batch_size: expected a number, got the boolean true"),
    ("decoder.backend=on", "decoder.backend: expected text, got the boolean true"),
    ("name=../../escape", "not a plain name"),
    ("name=a/b", "not a plain name"),
    ("base_dir=/etc", "base_dir: unknown key"),
    ("profiles=[nonexistent]", "unknown profile 'nonexistent'"),
])
def test_overrides_that_would_have_slipped_through_are_errors(item, fragment):
    from vlmctl.errors import RecipeError
    from vlmctl.recipe import load_recipe

    with pytest.raises(RecipeError) as e:
        load_recipe("demo", [item])
    assert fragment in e.value.message, e.value.message


def test_text_keys_take_the_text_as_typed_and_profiles_from_an_override():
    from vlmctl.recipe import load_recipe

    assert load_recipe("demo", ["name=123"]).name == "123"
    assert load_recipe("demo", ["name=on"]).name == "on"
    assert load_recipe("demo", ["quantization.calibration.data=null"]).quantization.calibration.data is None
    assert load_recipe("demo", ["vision.max_rel_error=1e-3"]).vision.max_rel_error == 1e-3
    plain = load_recipe("demo")
    assert plain.quantization.method == "none"
    awq = load_recipe("demo", ["profiles=[awq]"])  # the profile is merged, not only listed
    assert awq.profiles == ["awq"] and awq.quantization.method == "awq"


def test_a_recipe_may_name_one_profile_without_a_list_and_may_not_set_base_dir(tmp_path):
    from vlmctl.errors import RecipeError
    from vlmctl.recipe import load_recipe

    (tmp_path / "one.yaml").write_text("name: one\nsource: x\nprofiles: fp32-cpu\n")
    r = load_recipe(tmp_path / "one.yaml")
    assert r.profiles == ["fp32-cpu"] and r.dtype == "float32"
    (tmp_path / "bd.yaml").write_text("name: bd\nsource: x\nbase_dir: /etc\n")
    with pytest.raises(RecipeError, match="base_dir: unknown key"):
        load_recipe(tmp_path / "bd.yaml")


def test_a_directory_named_like_a_bundled_recipe_does_not_hide_it(tmp_path, monkeypatch):
    from vlmctl.errors import RecipeError
    from vlmctl.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert load_recipe("demo").name == "demo"
    (tmp_path / "mine").mkdir()
    with pytest.raises(RecipeError, match="mine: a directory, not a recipe file"):
        load_recipe("mine")
