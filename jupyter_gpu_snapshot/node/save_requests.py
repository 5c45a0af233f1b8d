"""What a save asks the kernel itself, on its control channel: the cells it ran, and its
portable copy.

Snapshot-ready kernels load the extension at start, which answers two control messages:
the cells the kernel ran with the names each defined (``kernel/cell_record.py``), and
"write your portable copy into this directory" (``kernel/portable_request.py``). The
control channel is served by its own thread in ipykernel, so a kernel answers while a cell
runs, in particular while ``%gpu_snapshot save`` waits for the save it asked for. Where the
portable copy must wait for a running cell to end, the kernel does the waiting (it alone
knows).

Both faces call this with the kernel's connection info: the server for its kernels, the CLI
for a kernel named by its connection file. A kernel without the extension (a plain kernel,
or one restored from a snapshot older than the recorder) never replies to a message it does
not know: the question then times out, and the save goes on without the cells.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._constants import CELLS_REQUEST, PORTABLE_REQUEST
from ..core.errors import SnapshotError
from ..launch.liveness import control_client, reply_to

if TYPE_CHECKING:
    # The engine's hooks bring the store and criu: a question to a kernel (the CLI's
    # timeline) needs neither.
    from ..core.hooks import PortableWriter

# A kernel with the recorder answers at once, even mid-cell; one without never does.
CELLS_SECONDS = 3.0
# Writing a copy waits for a running cell to end, then for the bytes of every tensor.
PORTABLE_SECONDS = 6 * 3600.0


async def ask_kernel(
    connection_info: dict[str, Any], msg_type: str, content: dict[str, Any], timeout: float
) -> dict[str, Any] | None:
    """The content of the kernel's reply to one control message, or None if none came
    within ``timeout`` seconds."""
    async with control_client(connection_info) as client:
        request = client.session.msg(msg_type, content)
        client.control_channel.send(request)
        reply = await reply_to(client, {request["header"]["msg_id"]}, timeout)
        return None if reply is None else dict(reply.get("content") or {})


async def kernel_history(connection_info: dict[str, Any]) -> dict[str, Any] | None:
    """The cells the kernel ran, as the manifest's "history" keeps them, or None when the
    kernel does not say (no recorder, or no answer in time)."""
    content = await ask_kernel(connection_info, CELLS_REQUEST, {}, CELLS_SECONDS)
    if not content or content.get("status") != "ok":
        return None
    history = {"cells": content.get("cells", []), "complete": content.get("complete", True)}
    if content.get("omitted"):
        history["omitted"] = content["omitted"]
    return history


def portable_writer(
    connection_info: dict[str, Any], budget_seconds: float | None = None
) -> PortableWriter:
    """The save's ``SaveTarget.portable``: asks the kernel to write its copy into the
    directory the save gives, and returns the kernel's report of it. ``budget_seconds``:
    how long the kernel waits for a running cell to end before it gives the copy up (a
    policy's copy); else it waits as long as the cell runs."""

    async def write(directory: Path) -> dict[str, Any]:
        request: dict[str, Any] = {"directory": str(directory)}
        if budget_seconds is not None:
            # The kernel gives up if a running cell does not end in time. Once it writes,
            # it is waited for: a copy still being written must never meet the commit.
            request["wait_seconds"] = budget_seconds
        content = await ask_kernel(connection_info, PORTABLE_REQUEST, request,
                                   PORTABLE_SECONDS)
        if content is None:
            raise SnapshotError(
                "portable", "the kernel did not answer the request for its portable copy",
                hint="is it a snapshot-ready kernel started with this version? Save "
                "without --portable, or restart the kernel")
        if content.get("status") != "ok" or not isinstance(content.get("portable"), dict):
            raise SnapshotError(
                "portable", "the kernel could not write its portable copy: "
                f"{content.get('ename', 'error')}: {content.get('evalue', content)}")
        report: dict[str, Any] = content["portable"]
        return report

    return write
