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
