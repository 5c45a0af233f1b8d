"""The package's stdlib-only programs import the standard library and nothing else.

A few files of the package are not modules: they are programs run as ``python -I -S FILE``,
with no site-packages and no package on the path, by root (the node agent's way into a
container), as another user (the files opened as the caller), or as PID 1 of a kernel's
namespace, which is part of every snapshot. Each one says so by this line at module level,
after its imports (a module-level name, so that it is found by parsing, not by a list of
paths here)::

    __stdlib_only__ = True  # run as python -I -S: it imports the standard library alone

A program that moves keeps the line; a new one adds it. Every file of the package whose
docstring says it runs as ``python -I -S`` must carry it. For each one found, every import
in it, at the top or inside a function, must name a module of ``sys.stdlib_module_names``
and none may be relative; and the file must load under ``python -I -S`` itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jupyter_gpu_snapshot"
MARKER = "__stdlib_only__"


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def is_marked(tree: ast.Module) -> bool:
    """Whether the module assigns ``__stdlib_only__ = True`` at its top level."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == MARKER for target in node.targets
        ):
            return isinstance(node.value, ast.Constant) and node.value.value is True
    return False


def says_it_runs_alone(tree: ast.Module) -> bool:
    """Whether the module's docstring says it runs as ``python -I -S``."""
    return "python -I -S" in (ast.get_docstring(tree) or "")


FILES = {path: parsed(path) for path in sorted(PACKAGE.rglob("*.py"))}
PROGRAMS = [path for path, tree in FILES.items() if is_marked(tree)]


def name_of(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def test_the_programs_are_found_by_their_marker() -> None:
    assert PROGRAMS, f"no file of {PACKAGE} has {MARKER} = True"
    unmarked = [name_of(path) for path, tree in FILES.items()
                if says_it_runs_alone(tree) and not is_marked(tree)]
    assert not unmarked, f"run as python -I -S, without {MARKER} = True: {unmarked}"


def outside_the_stdlib(tree: ast.Module) -> list[str]:
    """Each import of ``tree`` that the standard library does not satisfy, with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(f"line {node.lineno}: relative import "
                             f"from {'.' * node.level}{node.module or ''}")
                continue
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.partition(".")[0] not in sys.stdlib_module_names:
                found.append(f"line {node.lineno}: import {name}")
    return found


@pytest.mark.parametrize("program", PROGRAMS, ids=name_of)
def test_a_program_imports_only_the_standard_library(program: Path) -> None:
    assert outside_the_stdlib(FILES[program]) == []


@pytest.mark.parametrize("program", PROGRAMS, ids=name_of)
def test_a_program_loads_with_the_standard_library_alone(program: Path) -> None:
    # Its top level only, as a module (its main part does not run), in an interpreter
    # that sees neither site-packages nor this package.
    load = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='stdlib_only')"
    loaded = subprocess.run([sys.executable, "-I", "-S", "-c", load, str(program)],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert loaded.returncode == 0, loaded.stderr


def test_the_import_check_sees_what_it_must_refuse() -> None:
    # The check itself, on code that breaks the rule in each way it can.
    tree = ast.parse("import os\nimport psutil\nfrom .errors import X\n"
                     "def f():\n    from jupyter_client import kernelspec\n")
    assert outside_the_stdlib(tree) == [
        "line 2: import psutil", "line 3: relative import from .errors",
        "line 5: import jupyter_client"]
