"""vlmctl's packages import downward only, and nothing imports in a circle.

Walks every module's imports with `ast` (module-level and function-level ones alike: a lazy import
is still a dependency) and checks them against the floors below, bottom first. A package may import
a package on a lower floor; on the bottom floor its modules may import each other; nothing may import
upward, sideways between the stage bodies, or in a circle (between packages, or between modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vlmctl"

# The floors of README's layout section, bottom first. Keys are the first component under vlmctl
# ("" is vlmctl/__init__.py: the version).
FLOORS = [
    {"", "errors", "progress", "host", "checkpoint"},
    {"formats", "backends", "media"},  # media: request videos' decoding and limits (imports only errors)
    {"models"},
    {"convert", "quant", "export", "runtime"},  # the stage bodies and the runtime, not each other
    {"recipe"},
    {"pipeline"},
    {"serve", "measure"},
    {"repl"},  # the interactive chat: CLI-level, under cli/chat.py only
    {"cli"},
    {"__main__"},  # `python -m vlmctl`
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
SHARED_FLOOR = 0  # the only floor whose members import one another

# Inside serve/, bottom first (keys: the module under vlmctl.serve; "" is its __init__): the leaves
# (wire schema, the field tables, media loading, metrics, logging, the engine's async wrapper), the
# OpenAI-shaped errors, what the endpoints are made of, the endpoints, the app's wiring.
SERVE_FLOORS = [
    {"schema", "openai_fields", "media", "metrics", "logs", "async_engine", "token_bytes"},
    {"errors"},
    {"middleware", "openai_request", "render", "streaming"},
    {"endpoints"},
    {"app"},
    {""},
]
SERVE_FLOOR = {name: i for i, names in enumerate(SERVE_FLOORS) for name in names}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every vlmctl module `path` imports (resolved to a dotted name; `from x import y` counts as x.y
    when x.y is a module, else as x)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "vlmctl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vlmctl":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if _is_module(sub) else target)
    return out


def _is_module(dotted: str) -> bool:
    p = ROOT.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file() or p.is_dir()


def top(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_package_has_a_floor(graph):
    missing = sorted({top(m) for m in graph} - set(FLOOR))
    assert not missing, f"packages without a floor in this test (and README's layout): {missing}"


def test_imports_run_downward_only(graph):
    bad = []
    for mod, deps in graph.items():
        a = top(mod)
        for dep in deps:
            b = top(dep)
            if a == b:
                continue
            fa, fb = FLOOR[a], FLOOR[b]
            if fb > fa or (fb == fa and fa != SHARED_FLOOR):
                bad.append(f"{mod} -> {dep} (floor {fa} -> {fb})")
    assert not bad, "imports that run up or sideways:\n" + "\n".join(sorted(bad))


def _serve_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[:2] != ["vlmctl", "serve"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def test_serve_modules_import_downward_only(graph):
    mods = {_serve_module(m) for m in graph} - {None}
    missing = sorted(mods - set(SERVE_FLOOR))
    assert not missing, f"serve modules without a floor in this test: {missing}"
    bad = []
    for mod, deps in graph.items():
        a = _serve_module(mod)
        if a is None:
            continue
        for dep in deps:
            b = _serve_module(dep)
            if b is None or b == a:
                continue
            if SERVE_FLOOR[b] >= SERVE_FLOOR[a]:
                bad.append(f"{mod} -> {dep} (serve floor {SERVE_FLOOR[a]} -> {SERVE_FLOOR[b]})")
    assert not bad, "serve imports that run up or sideways:\n" + "\n".join(sorted(bad))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_packages(graph):
    edges: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        edges.setdefault(top(mod), set()).update(top(d) for d in deps if top(d) != top(mod))
    assert _cycles(edges) == []


def test_no_import_circle_between_modules(graph):
    # a package's __init__ is not an import of its submodules' (importing a.b runs a/__init__ first,
    # but a/__init__ importing a.b back is the only circle that matters there, and it is an edge here)
    edges = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert _cycles(edges) == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk resolves relative imports as Python does (a check that sees nothing passes everything)."""
    deps = imports_of(ROOT / "runtime" / "engine.py")
    assert "vlmctl.formats.workdir" in deps and "vlmctl.runtime.scheduler" in deps
    assert "vlmctl.errors" in imports_of(ROOT / "formats" / "artifacts.py")
    assert "vlmctl.runtime.kernels.w4a16" in imports_of(ROOT / "runtime" / "decoder.py")
    assert {"vlmctl.serve.errors", "vlmctl.serve.openai_request"} <= imports_of(ROOT / "serve" / "endpoints.py")
