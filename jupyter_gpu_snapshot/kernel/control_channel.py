"""Replies this kernel sends on its control channel, to what a save asks of it: its cells
(``cell_record``) and its portable copy (``portable_request``).

ipykernel serves the control channel from a thread of its own, so these are answered even
while a cell runs.
"""

from __future__ import annotations

from typing import Any


def send_reply(shell: Any, stream: Any, msg_type: str, content: dict[str, Any],
               parent: dict[str, Any], ident: Any) -> None:
    """Answer the control request ``parent`` through the shell's kernel, if it has one."""
    kernel = getattr(shell, "kernel", None)
    if kernel is not None and kernel.session is not None:
        kernel.session.send(stream, msg_type, content, parent, ident)


def error_content(exc: BaseException) -> dict[str, Any]:
    """A reply's content for a request that failed."""
    return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
