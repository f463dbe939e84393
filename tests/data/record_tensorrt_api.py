"""Record the Python API names of TensorRT's bindings wheel (tests/data/tensorrt-<version>/api_names.json).

NVIDIA publishes `tensorrt-cu12-bindings` on PyPI without the TensorRT libraries, so the module
cannot be imported here; its extension module still carries every name it registers with
pybind11 (classes, methods, properties, enum members) as strings. This script downloads one
wheel with pip, scans `tensorrt_bindings/tensorrt.so` for identifier-shaped strings (no
external `strings` tool) and keeps those that look like Python API names.

    python tests/data/record_tensorrt_api.py 10.13.3.9
    python tests/data/record_tensorrt_api.py 11.4.0.106

Where TensorRT imports (NVIDIA's container), `--introspect` records `dir()` of the real module
and its classes instead, which is exact.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).parent
IDENT = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{2,63}")


def names_from_binary(blob: bytes) -> list[str]:
    out = set()
    for run in re.findall(rb"[\x20-\x7e]{3,}", blob):
        if run.startswith(b"_Z") or b" " in run:  # mangled C++ symbols, docstrings
            continue
        if IDENT.fullmatch(run):
            out.add(run.decode())
    return sorted(out)


def record_wheel(version: str) -> Path:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                        f"tensorrt-cu12-bindings=={version}", "-d", d], check=True, capture_output=True)
        wheel = next(Path(d).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            blob = z.read("tensorrt_bindings/tensorrt.so")
            init = z.read("tensorrt_bindings/__init__.py")
    # The package's Python wrapper (__init__.py) defines a few names itself (e.g. __version__).
    names = sorted(set(names_from_binary(blob)) | {m.decode() for m in IDENT.findall(init)})
    return write(version, names, f"strings of tensorrt_bindings/tensorrt.so and identifiers of its __init__.py "
                                 f"in {wheel.name}")


def introspect() -> Path:
    import tensorrt as trt

    names = set(dir(trt))
    for n in list(names):
        names |= set(dir(getattr(trt, n)))
    return write(trt.__version__, sorted(x for x in names if not x.startswith("__")), "dir() of the imported module")


def write(version: str, names: list[str], how: str) -> Path:
    out = HERE / f"tensorrt-{version}" / "api_names.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"package": "tensorrt-cu12-bindings", "version": version, "recorded_from": how,
                               "names": names}, indent=0) + "\n")
    return out


if __name__ == "__main__":
    print(introspect() if sys.argv[1:] == ["--introspect"] else record_wheel(sys.argv[1]))
