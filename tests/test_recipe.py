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
