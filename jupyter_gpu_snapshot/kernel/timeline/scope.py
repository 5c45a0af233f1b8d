"""Which of the user's names a cell's code could reach: those whose big buffers the timeline
digests again after the cell (``fingerprint``).

The names the cell's code mentions, and, through the user's own functions and classes it
mentions (defined in the notebook), the global names their code mentions, a few levels
deep. Code that reaches names in ways that cannot be read from it (``globals()``, ``exec``,
``eval``, ``vars``, magics, ``%run``) makes every name reachable: the slow, sure path.
"""

from __future__ import annotations

import ast
import types
from typing import Any

# Code that reaches the namespace without naming what it touches.
_OPAQUE = frozenset({"globals", "exec", "eval", "vars", "get_ipython", "locals",
                     "__import__", "__builtins__"})
_ROUNDS = 3


class Everything:
    """Every name: the cell's code cannot be read for the names it reaches."""

    def __contains__(self, name: object) -> bool:
        return True


def reachable(code: str, namespace: dict[str, Any]) -> set[str] | Everything:
    """The names ``code`` (Python, after IPython's transformations) could reach."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return Everything()
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    if names & _OPAQUE:
        return Everything()
    seen_code: set[int] = set()
    frontier = set(names)
    for _ in range(_ROUNDS):
        found: set[str] = set()
        for name in frontier:
            for code_object in _own_code(namespace.get(name), namespace):
                found |= _code_names(code_object, seen_code)
        if found & _OPAQUE:
            return Everything()
        frontier = found - names
        names |= found
        if not frontier:
            break
    return names


def _own_code(value: Any, namespace: dict[str, Any]) -> list[types.CodeType]:
    """The code of the user's own function, class, or object of a class of theirs."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return [value.__code__] if value.__globals__ is namespace else []
    kind = value if isinstance(value, type) else type(value)
    if kind.__module__ != "__main__":
        return []
    found: list[types.CodeType] = []
    for base in kind.__mro__:
        if base.__module__ != "__main__":
            continue
        for member in vars(base).values():
            member = getattr(member, "__func__", member)
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                found.append(member.__code__)
    return found


def _code_names(code: types.CodeType, seen: set[int]) -> set[str]:
    if id(code) in seen:
        return set()
    seen.add(id(code))
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const, seen)
    return names
