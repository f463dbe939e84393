"""Packaging beyond what pyproject.toml can say: the bundled recipes (recipes/*.yaml) and profiles
(configs/*.yaml) live at the top of the repository, where the README's commands name them, and ship
inside the wheel as the data packages `vlmctl.recipes` and `vlmctl.configs` (vlmctl/recipe.py finds
them there in an installed copy, and at the repository top in a source checkout or editable install).
Everything else (metadata, dependencies, entry points) is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(
    # namespace packages too (vlmctl/models has no __init__.py), as pyproject's packages.find did
    packages=find_namespace_packages(include=["vlmctl", "vlmctl.*"], exclude=["*.__pycache__"])
    + ["vlmctl.recipes", "vlmctl.configs"],
    package_dir={"vlmctl.recipes": "recipes", "vlmctl.configs": "configs"},
    # the W4A16 kernels' tuned configs (measured per GPU) are data of their package
    package_data={"vlmctl.recipes": ["*.yaml"], "vlmctl.configs": ["*.yaml"], "vlmctl.runtime.kernels": ["*.json", "*.cu"]},
)
