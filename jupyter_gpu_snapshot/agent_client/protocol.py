"""What the node agent and its clients say to each other over the agent's Unix socket.

One request per connection, as one JSON line: ``{"op": NAME, "args": {...}}``. The agent
answers with JSON lines: any number of ``{"progress": {...}}`` (a ``core.hooks.Progress``),
then exactly one ``{"result": ...}`` or ``{"error": {...}}``, and closes. An error is a
``SnapshotError.to_dict()``; the client raises the same class again, so a failure through the
agent reads exactly like one without it. A client that closes its end mid-operation asks
the agent to stop it: the engine then rolls back as for a Ctrl-C.

The caller is whoever the kernel says is at the other end (``SO_PEERCRED``): nothing in a
request names a user.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core import errors
from ..core.errors import SnapshotError
from ..core.store import Snapshot

DEFAULT_SOCKET = Path("/run/jupyter-gpu-snapshot/agent.sock")
# A request line. The largest a client sends is a launch: the kernel's argv and its whole
# environment, a few KiB usually, some tens of KiB with a module system's or a conda
# environment's variables. Linux caps one variable at 128 KiB (MAX_ARG_STRLEN). The agent
# holds up to this much (twice, with its read buffer) for each open connection, so it stays
# small: 1,000 connections cost at most half a GiB, not the 16 GiB of a reply's limit.
MAX_REQUEST_BYTES = 256 << 10
# A reply line; a snapshot listing of a big store stays far below this. Only clients read
# replies, each its own.
MAX_REPLY_BYTES = 16 << 20

# The operations a caller may ask for; ``hello`` also says which the agent allows them.
# The ``gpu_`` ones are hibernation's gpu tier (``gpu_sleep.AgentGpuSleep``).
OPERATIONS = (
    "hello", "launch", "save", "restore", "list", "catalog", "get", "find_name", "delete",
    "rename", "usage", "store_room", "gpu_choice", "gpu_release", "gpu_wake", "gpu_asleep",
)

_ERROR_CLASSES: dict[str, type[SnapshotError]] = {
    cls.code: cls
    for cls in (
        errors.SnapshotError, errors.InvalidRequest, errors.NotFound, errors.Busy,
        errors.NotReady, errors.PortsInUse, errors.Incompatible, errors.Interrupted,
    )
}


class Refused(errors.InvalidRequest):
    """The agent refused the caller this operation: not theirs, or over their limits."""

    code = "refused"


_ERROR_CLASSES[Refused.code] = Refused


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


def error_from(fields: dict[str, Any]) -> SnapshotError:
    """The SnapshotError an agent's error reply describes, of the same class."""
    cls = _ERROR_CLASSES.get(str(fields.get("code")), SnapshotError)
    if cls is errors.Interrupted:  # its constructor takes the step only
        return errors.Interrupted(str(fields.get("step") or "agent"))
    return cls(
        str(fields.get("step") or "agent"),
        str(fields.get("cause") or "the node agent failed without saying why"),
        hint=fields.get("hint"),
        log_path=Path(fields["log"]) if fields.get("log") else None,
        details=fields.get("details") or {},
    )


def snapshot_fields(snapshot: Snapshot) -> dict[str, Any]:
    """A snapshot as the agent sends it; ``snapshot_from`` makes it a Snapshot again."""
    return {"id": snapshot.id, "path": str(snapshot.path), "manifest": snapshot.manifest,
            "status": snapshot.status, "problem": snapshot.problem}


def snapshot_from(fields: dict[str, Any]) -> Snapshot:
    return Snapshot(fields["id"], Path(fields["path"]), fields["manifest"],
                    fields["status"], fields.get("problem"))
