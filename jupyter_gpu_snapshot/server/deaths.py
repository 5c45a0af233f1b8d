"""Deaths of snapshot-ready kernels: what killed them, and the snapshot that can bring
them back.

The server's kernel restarter replaces a kernel that died with a blank one under the same
kernel id, and says nothing. So every snapshot-ready kernel is watched through the
restarter's own callbacks (``KernelManager.add_restart_callback``): when it reports a death,
the cause is read from the line nsinit wrote into the kernel's log (``core.kernel_log``), and
the newest snapshot of the kernel or its notebook is looked up. The record is answered in
the kernel's status (``death``) until the user dismisses it, or the kernel slot goes away (a
restore replaces it, the user shuts it down).

A kernel shut down or restarted on purpose is no death: jupyter_client stops the restarter
(and marks the manager ``shutting_down``) before it stops a kernel, and a stopping save
stops the restarter too, so no callback fires for them.

Nothing here knows ``SnapshotService``, which is made after this and answers these records:
``wiring.build_server_parts`` hands in how to find a kernel's notebook (the kernel slots')
and its newest snapshot (``status.newest_once_saved``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.kernel_log import KernelEnd, kernel_death_cause
from ..core.store import Snapshot
from ..launch.provisioner import SnapshotReadyProvisioner

# jupyter_server's record of kernel starts and shutdowns (its kernel_actions events).
KERNEL_ACTIONS_EVENT_ID = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"

# (kernel id, notebook path, snapshot the kernel was restored from) -> its newest snapshot
NewestSnapshot = Callable[[str, str | None, str | None], Awaitable[Snapshot | None]]
NotebookOf = Callable[[str], Awaitable[str | None]]


@dataclass
class KernelDeath:
    """One death of a kernel slot's process, as the API answers it (``KernelDeath``)."""

    at: float
    end: KernelEnd
    restarted: bool
    snapshot: dict[str, Any] | None
    notebook_path: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            **self.end.to_dict(),
            "restarted": self.restarted,
            "notebook_path": self.notebook_path,
            "snapshot": self.snapshot,
        }


class KernelDeaths:
    """Watches the server's snapshot-ready kernels and keeps a record of each death.

    Made by ``wiring.build_server_parts``: ``watch`` is called for every kernel that starts
    (from jupyter_server's kernel_actions event, ``on_kernel_action``), ``forget`` when one
    is shut down. ``on_death`` is called with the kernel id and the record once it is complete.
    """

    def __init__(
        self,
        kernel_manager: Any,
        newest_snapshot: NewestSnapshot,
        notebook_of: NotebookOf,
        log: logging.Logger,
        on_death: Callable[[str, KernelDeath], None] | None = None,
    ) -> None:
        self.kernel_manager = kernel_manager
        self.newest_snapshot = newest_snapshot
        self.notebook_of = notebook_of
        self.log = log
        self.on_death = on_death
        self._deaths: dict[str, KernelDeath] = {}
        self._watched: dict[str, Any] = {}  # kernel id -> its kernel manager
        self._pending: set[asyncio.Future[None]] = set()

    # -- what the API answers ----------------------------------------------------------------
    def get(self, kernel_id: str) -> dict[str, Any] | None:
        death = self._deaths.get(kernel_id)
        return death.to_dict() if death is not None else None

    def dismiss(self, kernel_id: str) -> bool:
        """Called by ``DELETE kernels/{id}/death``; whether there was a record."""
        return self._deaths.pop(kernel_id, None) is not None

    async def settled(self) -> None:
        """Wait for the records being written now (their causes are read in threads)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    # -- following the kernels ---------------------------------------------------------------
    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of jupyter_server's kernel_actions events (``wiring`` adds it)."""
        kernel_id = data.get("kernel_id")
        if not kernel_id or data.get("status") != "success":
            return
        if data.get("action") == "start":
            self.watch(str(kernel_id))
        elif data.get("action") == "shutdown":
            self.forget(str(kernel_id))

    def watch(self, kernel_id: str) -> bool:
        """Follow the restarter of kernel ``kernel_id``; False for a kernel not ours."""
        try:
            km = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return False
        if not isinstance(getattr(km, "provisioner", None), SnapshotReadyProvisioner):
            return False
        if self._watched.get(kernel_id) is km:
            return True
        # The restarter lives as long as the kernel manager, across restarts.
        km.add_restart_callback(functools.partial(self._died, kernel_id, km, True), "restart")
        km.add_restart_callback(functools.partial(self._died, kernel_id, km, False), "dead")
        self._watched[kernel_id] = km
        return True

    def forget(self, kernel_id: str) -> None:
        """The slot is gone: its record goes with it."""
        self._watched.pop(kernel_id, None)
        self._deaths.pop(kernel_id, None)

    def _died(self, kernel_id: str, km: Any, restarting: bool) -> None:
        """Called by the kernel's restarter (``KernelRestarter._fire_callbacks``) when it
        finds the kernel dead: with ``restarting`` before it starts a blank kernel in the
        slot, without when it gave up restarting. Runs on the event loop: it only takes
        what the restart is about to change, and leaves the reading to a task."""
        if getattr(km, "shutting_down", False):
            return  # a shutdown on purpose that the restarter saw before it stopped
        earlier = self._deaths.get(kernel_id)
        if earlier is not None:
            # The user has not seen the first death yet, the one that lost the state; the
            # blank kernels that followed hold nothing.
            earlier.restarted = restarting
            return
        provisioner = km.provisioner
        log_path: Path | None = provisioner.log_path
        task = asyncio.ensure_future(self._record(
            kernel_id, time.time(), restarting, log_path, provisioner.log_start,
            provisioner.adopted_snapshot,
        ))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _record(
        self,
        kernel_id: str,
        at: float,
        restarting: bool,
        log_path: Path | None,
        log_start: int,
        restored_from: str | None,
    ) -> None:
        cause = None
        if log_path is not None:
            cause = await asyncio.to_thread(kernel_death_cause, log_path, log_start)
        notebook = await self.notebook_of(kernel_id)
        snapshot = None
        with contextlib.suppress(Exception):  # a store that cannot be read has no offer
            snapshot = await self.newest_snapshot(kernel_id, notebook, restored_from)
        death = KernelDeath(
            at=at,
            end=KernelEnd.parse(cause),
            restarted=restarting,
            snapshot=(
                {"id": snapshot.id, "name": snapshot.name, "created": snapshot.created}
                if snapshot is not None else None
            ),
            notebook_path=notebook,
        )
        if kernel_id not in self._watched:
            return  # shut down meanwhile
        self._deaths.setdefault(kernel_id, death)
        self.log.warning(
            "gpu-snapshot: kernel %s%s died (%s)%s; %s", kernel_id,
            f" of {notebook}" if notebook else "", cause or "cause unknown: no line in its log",
            ", a blank kernel replaces it" if restarting else "",
            f"its newest snapshot is {snapshot.name} ({snapshot.id})" if snapshot is not None
            else "it has no snapshot",
        )
        if self.on_death is not None:
            self.on_death(kernel_id, self._deaths[kernel_id])
