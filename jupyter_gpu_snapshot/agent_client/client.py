"""Calls to the node agent, for the user's server, CLI and launcher.

``AgentClient.call`` sends one request and returns its result, passing progress reports
to a callback; an error of the agent is raised as the same ``SnapshotError`` class. An
agent that cannot be reached is a ``NotReady`` naming the socket and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._constants import format_bytes
from ..core.errors import InvalidRequest, NotReady, SnapshotError
from ..core.hooks import Progress
from .protocol import MAX_REPLY_BYTES, MAX_REQUEST_BYTES, decode, encode, error_from


class AgentClient:
    """One node agent, reached through its Unix socket."""

    def __init__(self, socket_path: str | os.PathLike[str]) -> None:
        # Where it is configured: ``GPUSnapshot.agent_socket``.
        self.socket_path = Path(socket_path)

    async def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        progress: Callable[[Progress], None] | None = None,
    ) -> Any:
        request = encode({"op": op, "args": args or {}})
        if len(request) > MAX_REQUEST_BYTES:
            # The agent would refuse it after reading that much: say why here, and what.
            raise InvalidRequest(
                op, f"the request to the node agent takes {format_bytes(len(request))}, more "
                f"than the {format_bytes(MAX_REQUEST_BYTES)} it reads",
                hint="a launch sends the kernel's environment and command line: leave out "
                "large variables",
            )
        try:
            reader, writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=MAX_REPLY_BYTES)
        except OSError as exc:
            raise NotReady(
                "agent", f"the node agent at {self.socket_path} cannot be reached: "
                f"{exc.strerror or exc}",
                hint="ask the machine's administrator to start it (jupyter gpu-snapshot "
                "agent, see docs/cluster.md), or run as root",
            ) from exc
        try:
            writer.write(request)
            with contextlib.suppress(ConnectionError):
                # An agent that refuses the connection (too many of ours open) answers and
                # closes before it reads: its answer is still there to read.
                await writer.drain()
            while True:
                try:
                    line = await reader.readline()
                except ConnectionError:
                    line = b""
                if not line:
                    raise SnapshotError(
                        op, "the node agent closed the connection without an answer",
                        hint="see the agent's log (journalctl -u jupyter-gpu-snapshot-agent)")
                message = decode(line)
                if "progress" in message:
                    if progress is not None:
                        progress(Progress(**message["progress"]))
                    continue
                if "error" in message:
                    raise error_from(message["error"])
                return message.get("result")
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    def call_sync(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        progress: Callable[[Progress], None] | None = None,
    ) -> Any:
        """``call`` from code without an event loop (the CLI)."""
        return asyncio.run(self.call(op, args, progress))
