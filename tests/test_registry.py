"""Every registered family has a tiny-model parity test; every family is detected from its config."""

from __future__ import annotations

import ast
from pathlib import Path

from vlmctl.models.registry import FAMILIES, all_families, detect_family

TESTS = Path(__file__).parent


def covered_families() -> dict[str, Path]:
    """family -> test module declaring it in COVERS_FAMILIES (read without importing the modules)."""
    out = {}
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "COVERS_FAMILIES" for t in node.targets):
                for fam in ast.literal_eval(node.value):
                    out[fam] = path
    return out


def test_every_registered_family_has_a_tiny_parity_test():
    covered = covered_families()
    missing = sorted(set(FAMILIES) - set(covered))
    assert not missing, f"families without a tiny-model parity test: {missing}"
    for fam, path in covered.items():
        assert fam in FAMILIES, f"{path.name} covers unknown family {fam!r}"
        text = path.read_text()
        # the module must compare vlmctl's tokens with transformers' generate
        assert ".generate(" in text and ("chat" in text), f"{path.name} has no generate-parity test"


def test_each_architecture_is_detected_as_its_family():
    seen = set()
    for name, cls in all_families().items():
        assert cls.architectures, name
        for arch in cls.architectures:
            assert arch not in seen, f"{arch} is claimed by two families"
            seen.add(arch)
            assert detect_family({"architectures": [arch]}).name == name
