"""When a kernel's cells started and ended, read from its IOPub channel.

What "ran something" means to autosave: a cell, i.e. an ``execute_input`` message on the
kernel's IOPub channel. ``ExecutionFeed`` subscribes to a kernel's IOPub (one more
subscriber beside jupyter_server's own, reading only message headers). The server's
``last_activity`` would be cheaper but moves on any IOPub message (a reconnecting browser's
kernel_info does it), and ``execution_state`` misses short cells between two looks. Silent
executes (our own allocator release, the env update after a restore) publish no
``execute_input``.

A subscription takes effect some time after the connect, so a client may run a cell before
the feed sees anything: ``ran_unseen_cells`` asks the kernel, once the feed is live, how
many cells it ran (a silent request's ``execution_count``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from jupyter_client.session import Session
from jupyter_core.utils import ensure_async

# How long the question to a new kernel waits for its feed to go live before it is sent
# anyway (its own messages then make the feed live).
PROBE_NUDGE_SECONDS = 1.0


class ExecutionFeed:
    """When a kernel's cells started and ended, read from its IOPub channel."""

    def __init__(self, km: Any) -> None:
        self._session = Session(config=km.session.config, key=km.session.key)
        self._running: dict[str, float] = {}
        self.last_work: float | None = None  # the latest start or end of a cell
        self.long_cells: list[float] = []  # durations of cells that ended, until taken
        # When the first message came: from then on no cell passes unseen. A subscription
        # takes effect some time after the connect (later still while the kernel starts
        # and has not bound its socket yet).
        self.live_at: float | None = None
        self.live = asyncio.Event()
        self._stream = km.connect_iopub()
        self._stream.on_recv(self._on_message)

    @property
    def running_since(self) -> float | None:
        return min(self._running.values()) if self._running else None

    def _on_message(self, parts: list[bytes]) -> None:
        """Called by the IOPub stream on the server's event loop, for every message."""
        if self.live_at is None:
            self.live_at = time.time()
            self.live.set()
        with contextlib.suppress(Exception):  # a message we cannot read is not a cell
            _idents, fed = self._session.feed_identities(parts)
            msg = self._session.deserialize(fed, content=False)
            kind = msg["header"]["msg_type"]
            parent = msg.get("parent_header") or {}
            now = time.time()
            if kind == "execute_input":
                self._running[str(parent.get("msg_id"))] = now
                self.last_work = now
            elif kind == "status" and parent.get("msg_type") == "execute_request":
                state = self._session.unpack(msg["content"]).get("execution_state")
                started = self._running.get(str(parent.get("msg_id")))
                if state == "idle" and started is not None:
                    del self._running[str(parent.get("msg_id"))]
                    self.last_work = now
                    self.long_cells.append(now - started)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


async def ran_unseen_cells(client: Any, feed: ExecutionFeed) -> bool:
    """Whether the kernel ran cells before ``feed`` went live.

    ``client``: a started shell client of the kernel (``kernel_env.shell_client``), which
    the caller stops. Once the feed is live, one silent execute request (no history, no
    output, no count) asks the kernel how many cells it has run: its reply's
    ``execution_count``. A cell run after the request was sent is seen by the feed; one run
    before is in that count. Raises what asking raised: then nobody knows.
    """
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(feed.live.wait(), PROBE_NUDGE_SECONDS)
        sent = time.time()
        # No time limit: a kernel busy with a cell answers after it, and a request
        # given up on would still run there.
        reply = await ensure_async(
            client.execute("", silent=True, store_history=False, reply=True)
        )
        if feed.live_at is not None and feed.live_at <= sent:
            break
        # The probe's own status messages make the feed live; ask again then.
    return int(reply["content"].get("execution_count") or 0) > 0
