"""README's "Python API" block, run as written on a tiny checkpoint (only its paths swapped): the library
calls the README shows exist, take those arguments and give an answer."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

from conftest import write_recipe

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_block() -> str:
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python API section holds one example"
    return blocks[0]


def test_the_readmes_python_example_runs(tiny_llava, tmp_path, capsys):
    code = python_api_block()
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llava)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "cat.png")
    swaps = {'"recipes/llava-1.5-7b.yaml"': repr(str(recipe)), '"engines/llava7b"': repr(str(tmp_path / "engine")),
             '"cat.jpg"': repr(str(tmp_path / "cat.png"))}
    for old, new in swaps.items():
        assert code.count(old) >= 1, f"the example no longer names {old}"
        code = code.replace(old, new)
    exec(compile(code, "README.md (Python API)", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[:5] == ["convert done", "quantize skipped", "export-vision done", "build-vision done",
                           "build-llm done"]
    assert printed[-1].split()[-2] in ("stop", "length") and int(printed[-1].split()[-1]) >= 1  # the answer's end
