"""`pip install .` (not only `-e`): the wheel carries what an installed copy needs and nothing points back at a
checkout. The wheel is built from a copy of the source tree (the checkout stays untouched), installed into a
temporary folder, and the installed CLI and library are run from there with the checkout off the path. The oracle
is the checkout's own file listing (recipes/, configs/, the kernels' sources and tuned tables), not vlmctl's code."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


# setuptools >= 70.1 builds wheels itself; pyproject.toml asks for >= 77
pytestmark = pytest.mark.skipif(_setuptools_major() < 77, reason="needs setuptools >= 77 in the test environment "
                                "(the build backend pyproject.toml names; the wheel is built without isolation)")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, folder the wheel was installed into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks", "docs", ".device*",
        ".devrun", "node_modules"))
    dist = tmp / "dist"
    # --no-build-isolation: the test environment's setuptools and wheel, no download
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    (whl,) = dist.glob("vlmctl-*.whl")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(whl)], check=True, capture_output=True, text=True)
    return whl, site


def _run_installed(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMCTL_")}
    env["PYTHONPATH"] = str(site)  # ahead of the editable install's entry in site-packages
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_wheel_carries_the_data_files(installed):
    whl, _ = installed
    names = set(zipfile.ZipFile(whl).namelist())
    expected = {f"vlmctl/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    expected |= {f"vlmctl/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    kernels = ROOT / "vlmctl" / "runtime" / "kernels"
    expected |= {f"vlmctl/runtime/kernels/{p.name}" for p in [*kernels.glob("*.cu"), *kernels.glob("*.json")]}
    assert len(expected) > 10
    assert expected <= names, sorted(expected - names)
    # the models package has no __init__.py: a namespace package the wheel must still carry
    models = {f"vlmctl/models/{p.name}" for p in (ROOT / "vlmctl" / "models").glob("*.py")}
    assert models <= names, sorted(models - names)


def test_installed_cli_lists_the_bundled_recipes(installed, tmp_path):
    _, site = installed
    where = _run_installed(site, "-c", "import vlmctl; print(vlmctl.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout  # the installed copy, not the checkout
    out = _run_installed(site, "-m", "vlmctl", "recipes", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert {r["name"] for r in listed} == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert all(Path(r["path"]).is_relative_to(site) for r in listed), listed


def test_installed_library_resolves_profiles_and_kernel_tables(installed, tmp_path):
    """A recipe with profiles loads from the installed configs/, and the W4A16 tuned table is found in the package."""
    _, site = installed
    code = (
        "import json; from vlmctl.recipe import load_recipe, CONFIGS_DIR;"
        "from importlib.resources import files;"
        "r = load_recipe('llava-1.5-7b-awq');"
        "t = files('vlmctl.runtime.kernels').joinpath('w4a16_tuned.json');"
        "print(json.dumps({'configs': str(CONFIGS_DIR), 'quant': r.public_dict().get('quantization'),"
        " 'table': len(json.loads(t.read_text()))}))"
    )
    out = _run_installed(site, "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert Path(got["configs"]).is_relative_to(site)
    assert got["quant"], got  # the awq profile's quantization section came through
    assert got["table"] > 0


def test_installed_copy_without_its_recipes_says_so(installed, tmp_path):
    """A broken install (the data packages lost) is named as such, not blamed on a variable the user never set."""
    _, site = installed
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    shutil.rmtree(broken / "vlmctl" / "recipes")
    out = _run_installed(broken, "-m", "vlmctl", "recipes", cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "the bundled recipes are missing" in err, err
    assert "VLMCTL_RECIPES_DIR=" not in err
