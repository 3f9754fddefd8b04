"""The import graph follows docs/ARCHITECTURE.md: arrows point down the layout, never back.

Read from the source with `ast` (imports inside functions count too), so that a forbidden import
fails here even when it is lazy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"

# package -> packages (or third-party roots) it must never import
FORBIDDEN = {
    "canonical": {"gateway.api", "gateway.upstream", "gateway.pipeline", "gateway.responsecache", "starlette",
                  "fastapi"},
    "responsecache": {"gateway.api", "gateway.upstream", "gateway.pipeline", "gateway.proxy", "starlette", "fastapi"},
    "engine": {"gateway.api", "gateway.upstream", "gateway.pipeline", "gateway.proxy", "starlette", "fastapi"},
    "kvcache": {"gateway.api", "gateway.upstream", "gateway.engine", "gateway.pipeline", "starlette", "fastapi"},
    "schemas": {"gateway.api", "gateway.upstream", "gateway.pipeline", "starlette", "fastapi"},
    "usage": {"gateway.api", "gateway.pipeline", "starlette", "fastapi"},
    "observability": {"gateway.api", "gateway.pipeline"},
    "pipeline": {"gateway.api", "starlette", "fastapi"},
    "upstream": {"gateway.api", "gateway.pipeline", "gateway.proxy", "gateway.settings"},
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in imported_modules(path):
            for banned in FORBIDDEN[package]:
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_against_the_design(package: str) -> None:
    assert violations(package) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gateway.api.body import read_json\n")
    assert "gateway.api.body" in imported_modules(module)


def module_imports(package: str) -> dict[str, set[str]]:
    """Each module of `package` (dotted names) -> the modules of `package` it imports."""
    root = PACKAGE.parent
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / package.removeprefix("gateway.").replace(".", "/")).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in imported_modules(path) if m.startswith(package + ".") and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for after in sorted(graph.get(node, ())):
            if state.get(after) == 1:
                return [*path[path.index(after):], after]
            if after not in state and (found := visit(after)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_response_cache_imports_downward_only() -> None:
    """No module of the response cache imports, even lazily, one that imports it back
    (language -> sketch -> prejudge -> verifier -> language was one)."""
    graph = module_imports("gateway.responsecache")
    assert "gateway.responsecache.semantic.stage" in graph
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])
    semantic = {m for m in graph if m.startswith("gateway.responsecache.semantic")}
    upward = [f"{m} imports {i}" for m in semantic for i in graph[m]
              if i in graph and not i.startswith("gateway.responsecache.semantic")
              and any(j.startswith("gateway.responsecache.semantic") for j in graph[i])]
    assert upward == []  # what the semantic side reads from the shared modules never reads it back


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
