"""The server and the CLI reach the stores only through node/: from the store's face they
take a snapshot's view and the rules about it (its name, its manifest, retention), never a
store or its workings.

import-linter holds everything outside core/store/ to that face (pyproject.toml). It fences
modules, not the names a package re-exports, so this test keeps the finer rule for the two
layers above node/.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import jupyter_gpu_snapshot.core.store as face

PACKAGE = Path(face.__file__).parents[2]
# The store's modules whose names the server and the CLI may hold.
VIEW_AND_RULES = {"snapshot", "manifest", "digest", "retention"}


def names_taken_from_the_face(layer: str) -> list[tuple[str, str]]:
    """(file, name) for each name a module of ``layer`` imports from ``core.store``."""
    taken = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        package = ["jupyter_gpu_snapshot", *path.relative_to(PACKAGE).parent.parts]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if module == "jupyter_gpu_snapshot.core.store":
                taken += [(str(path.relative_to(PACKAGE)), alias.name) for alias in node.names]
    return taken


def home_of(name: str) -> str:
    """The store's module that defines ``name`` (a class, a function or a constant)."""
    value = getattr(face, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        return str(value.__module__).removeprefix("jupyter_gpu_snapshot.core.store.")
    for module in VIEW_AND_RULES:
        source = inspect.getsource(importlib.import_module(f"{face.__name__}.{module}"))
        if f"\n{name} = " in source or f"\n{name}: " in source:
            return module
    return "elsewhere"


@pytest.mark.parametrize("layer", ["server", "cli"])
def test_the_server_and_the_cli_hold_no_store(layer: str) -> None:
    taken = names_taken_from_the_face(layer)
    assert taken, f"{layer}/ takes nothing from the store's face: the test reads nothing"
    held = [(path, name, home_of(name)) for path, name in taken
            if home_of(name) not in VIEW_AND_RULES]
    assert held == []
