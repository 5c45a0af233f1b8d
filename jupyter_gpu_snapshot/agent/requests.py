"""What each operation's arguments must be, checked before any work starts for it.

``check(op, args)`` is called by ``operations.Session.run`` for every request, before the
caller's realm is even looked up: a field of the wrong kind (a string where a pid goes,
``true`` as a pid, a list as a name, a NUL in a path, a portable copy's writer) is answered
``invalid_request`` naming the field, with ``step`` "agent", which the server logs in one
short line per user and minute at most (``connections.QuietLog``). The handlers then read
fields of the kinds checked here. What a field's value means (a pid of the caller's
kernel, a snapshot of theirs) is the handlers' to check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import InvalidRequest

# Kinds of field: a name for messages, and whether a value is one.
Kind = tuple[str, Callable[[Any], bool]]


def _text(value: Any) -> bool:
    return isinstance(value, str) and "\0" not in value


def _pid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _or_none(kind: Kind) -> Kind:
    name, test = kind
    return f"{name} or null", lambda value: value is None or test(value)


TEXT: Kind = ("a string without NUL", _text)
NONEMPTY: Kind = ("a non-empty string without NUL", lambda v: _text(v) and bool(v))
PID: Kind = ("a positive integer (a process id)", _pid)
FLAG: Kind = ("true or false", lambda v: isinstance(v, bool))
OBJECT: Kind = ("a JSON object", lambda v: isinstance(v, dict))
TEXTS: Kind = ("a list of strings without NUL",
               lambda v: isinstance(v, list) and all(_text(item) for item in v))
ARGV: Kind = ("a non-empty list of strings without NUL",
              lambda v: TEXTS[1](v) and bool(v))
ENVIRONMENT: Kind = (
    "an object of strings without NUL, no name holding '='",
    lambda v: isinstance(v, dict) and all(
        _text(k) and k and "=" not in k and _text(item) for k, item in v.items()))
NSINIT: Kind = ("two absolute paths: the container's Python and its nsinit.py",
                lambda v: TEXTS[1](v) and len(v) == 2 and all(p.startswith("/") for p in v))

# The fields of a save's target (``core.hooks.SaveTarget``) a client may send. No portable
# writer: it would run code in the agent, and the kernel cannot write into root's store.
TARGET: dict[str, Kind] = {
    "pid": PID,
    "kernel_name": _or_none(TEXT),
    "kernel_spec": _or_none(OBJECT),
    "connection_info": _or_none(OBJECT),
    "notebook_path": _or_none(TEXT),
    "kernel_id": _or_none(TEXT),
    "reason": TEXT,
    "history": _or_none(OBJECT),
    "portable": ("null: the node agent writes no portable copy", lambda v: v is None),
    "portable_required": FLAG,
}

# Each operation's fields, by name: (kind, whether it must be there). A field not named is
# ignored, as the protocol has always done.
FIELDS: dict[str, dict[str, tuple[Kind, bool]]] = {
    "launch": {"argv": (ARGV, True), "kernel_id": (NONEMPTY, True),
               "env": (_or_none(ENVIRONMENT), False), "cwd": (_or_none(TEXT), False),
               "nsinit": (_or_none(NSINIT), False)},
    "save": {"target": (OBJECT, True), "name": (_or_none(NONEMPTY), False),
             "stop": (_or_none(FLAG), False)},
    "restore": {"ref": (NONEMPTY, True), "gpus": (_or_none(TEXTS), False)},
    "list": {"notebook_path": (_or_none(TEXT), False)},
    "catalog": {"notebook_path": (_or_none(TEXT), False)},
    "get": {"ref": (NONEMPTY, True)},
    "find_name": {"name": (NONEMPTY, True)},
    "delete": {"ref": (NONEMPTY, True)},
    "rename": {"ref": (NONEMPTY, True), "name": (NONEMPTY, True)},
    "gpu_choice": {"ref": (NONEMPTY, True), "gpus": (_or_none(TEXTS), False)},
    "gpu_release": {"pid": (PID, True), "note": (_or_none(OBJECT), False)},
    "gpu_wake": {"pid": (PID, True)},
    "gpu_asleep": {"pid": (PID, True)},
}


def check(op: str, args: Mapping[str, Any]) -> None:
    """Refuse ``args`` of ``op`` whose fields are not of their kinds (``FIELDS``)."""
    _check_fields(args, FIELDS.get(op, {}), "")
    if op == "save":
        target = args["target"]
        _check_fields(target, {name: (kind, name == "pid") for name, kind in TARGET.items()},
                      "target.")


def _check_fields(args: Mapping[str, Any], fields: Mapping[str, tuple[Kind, bool]],
                  prefix: str) -> None:
    for name, ((kind, test), required) in fields.items():
        if name not in args:
            if required:
                raise InvalidRequest("agent", f"{prefix}{name} is missing: it must be {kind}")
            continue
        if not test(args[name]):
            raise InvalidRequest(
                "agent", f"{prefix}{name} must be {kind}, not {_shown(args[name])}")


def _shown(value: Any) -> str:
    """What a wrong value was, for the message: its JSON kind, and a short text of it."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    kind = kinds.get(type(value), type(value).__name__)
    if isinstance(value, str):
        return f"{kind} ({value[:60]!r})"
    if isinstance(value, (bool, int, float)):
        return f"{kind} ({value!r})"
    return kind
