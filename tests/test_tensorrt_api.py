"""vlmctl's TensorRT calls against the API names recorded from NVIDIA's bindings wheels (10.x, 11.x).

TensorRT's libraries are not installable here, so its Python module cannot be imported; the
`tensorrt-cu12-bindings` wheels on PyPI still carry every name the module registers
(tests/data/record_tensorrt_api.py). Every attribute vlmctl reaches on a TensorRT object must
exist in both majors it supports; TensorRT 11 dropped weak typing (BuilderFlag.FP16), which the
recorded data shows and vlmctl must not use.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from vlmctl.backends import tensorrt as BT
from vlmctl.errors import EngineError

DATA = Path(__file__).parent / "data"
VERSIONS = ("10.13.3.9", "11.4.0.106")
# Names bound to TensorRT objects in vlmctl's TensorRT code (module, builder, network, parser,
# builder config, optimization profile, engine, execution context).
TRT_ROOTS = {"trt", "builder", "network", "parser", "config", "profile", "logger"}
TRT_SELF = {"engine", "context", "trt", "logger"}
FILES = [Path(BT.__file__), Path(BT.__file__).parents[1] / "export" / "tensorrt.py"]


def _names(version: str) -> set[str]:
    return set(json.loads((DATA / f"tensorrt-{version}" / "api_names.json").read_text())["names"])


def _trt_attributes() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            chain.reverse()
            if base.id in TRT_ROOTS:
                names = chain
            elif base.id == "self" and chain[0] in TRT_SELF and len(chain) > 1:
                names = chain[1:]
            else:
                continue
            for n in names:
                used.setdefault(n, set()).add(path.name)
    return used


def test_the_recording_shows_what_tensorrt_11_removed():
    assert "FP16" in _names("10.13.3.9") and "FP16" not in _names("11.4.0.106")
    for n in ("STRONGLY_TYPED", "build_serialized_network", "set_input_shape", "execute_async_v3"):
        assert all(n in _names(v) for v in VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_tensorrt_name_vlmctl_uses_exists(version):
    used = _trt_attributes()
    assert {"create_network", "get_tensor_profile_shape", "set_input_shape", "STRONGLY_TYPED"} <= set(used)
    names = _names(version)
    # The linker stores a string that is the tail of another only once ("float16" inside
    # "bfloat16", "Logger" inside "ILogger"), so a name may survive only as a suffix.
    missing = {n: sorted(f) for n, f in used.items() if n not in names and not any(m.endswith(n) for m in names)}
    assert not missing, f"not in TensorRT {version}: {missing}"


def test_feeds_are_split_to_the_profile_maximum():
    feed = {"pixel_values": np.arange(7 * 2).reshape(7, 2), "other": np.zeros((7, 1))}
    chunks = BT.feed_chunks(feed, 3)
    assert [c["pixel_values"].shape[0] for c in chunks] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate([c["pixel_values"] for c in chunks]), feed["pixel_values"])
    assert BT.feed_chunks(feed, 7) == [feed]
    uneven = {"patches": np.zeros((10, 4)), "grid": np.zeros((2, 3))}
    assert BT.feed_chunks(uneven, 10) == [uneven]
    with pytest.raises(EngineError, match="cannot be split"):
        BT.feed_chunks(uneven, 8)
