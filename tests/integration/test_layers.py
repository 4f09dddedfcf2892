"""The folders of ``nexus_vllm/integration`` are the processes the code runs in, and every
import points down (``nexus_vllm/integration/__init__.py`` states the order).

Read from the source (no import, no vLLM): every ``import`` and ``from ... import`` of
every module, at any depth (inside functions and ``TYPE_CHECKING`` blocks too), relative
ones resolved.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nexus_vllm"
INTEGRATION = PACKAGE / "integration"
SHARED = ("protocol", "config", "metrics", "faults")
# Which parts each part may import (besides nexus_vllm.core, kernels and top-level helpers).
MAY_IMPORT = {
    "plugin": {"frontend", "shared", "compat"},
    "frontend": {"frontend", "shared", "compat"},
    "scheduler": {"scheduler", "shared", "compat"},
    "worker": {"worker", "shared", "compat"},
    # Test instruments run in a server's processes; no production part imports them.
    "testing": {"testing", "scheduler", "worker", "shared", "compat"},
    "shared": {"compat"},
    "compat": {"compat"},
    "package": set(),
}
# Outside ``integration``, only the package's ``register()`` entry point reaches in.
ENTRY_POINT = ("nexus_vllm", {"plugin"})


def _part(module: str) -> str | None:
    """The part of ``nexus_vllm.integration`` a dotted module belongs to (None: outside)."""
    parts = module.split(".")
    if parts[:2] != ["nexus_vllm", "integration"]:
        return None
    if len(parts) == 2:
        return "package"
    head = parts[2]
    return "shared" if head in SHARED else head


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    names = list(rel.parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file; ``from X import Y`` counts as
    ``X.Y`` (Y may be a submodule)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_integration_module_belongs_to_a_part() -> None:
    for path in INTEGRATION.rglob("*.py"):
        assert _part(_module_name(path)) in MAY_IMPORT, path


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: pathlib.Path) -> None:
    """A module imports only its own part and the parts below it; outside
    ``integration`` nothing imports it (``core``, ``kernels``, ``hf``, ``sim`` and
    ``eval`` run without vLLM)."""
    name = _module_name(path)
    own = _part(name)
    allowed = MAY_IMPORT[own] if own is not None else (
        ENTRY_POINT[1] if name == ENTRY_POINT[0] else set())
    wrong = []
    for line, module in _imports(path):
        target = _part(module)
        if target is not None and target not in allowed:
            wrong.append(f"line {line}: {module} ({own or 'outside'} -> {target})")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports upward or sideways: {wrong}"


def _module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` it imports (any depth, as :func:`_imports`;
    ``from pkg import mod`` counts as ``pkg.mod`` when that is a module, else ``pkg``)."""
    names = {_module_name(p): p for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets = set()
        for _, module in _imports(path):
            while module and module not in names:
                module = module.rpartition(".")[0]
            if module and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def test_integration_modules_import_no_circle() -> None:
    """No two ``integration`` modules import each other, directly or through others
    (function-level imports count: a lazy import only hides the circle). Packages'
    ``__init__`` re-exports are left out (they import their own modules by design)."""
    graph = _module_graph(INTEGRATION)
    inits = {_module_name(p) for p in INTEGRATION.rglob("__init__.py")}
    graph = {m: t - inits for m, t in graph.items() if m not in inits}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [module, nxt]
            if nxt not in state:
                found = visit(nxt, [*path, nxt])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [module])
            assert circle is None, f"import circle: {' -> '.join(circle)}"
