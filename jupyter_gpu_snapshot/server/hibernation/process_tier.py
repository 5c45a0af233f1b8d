"""Hibernation's process tier: the kernel saved and its process ended, host memory freed too;
the wake is a restore into the same slot.

Hibernating is a stopping save with reason ``hibernate`` that keeps the kernel slot: the
provisioner puts a stand-in for the ended tree (``HibernatedProcess``), so the kernel stays
in /api/kernels and /api/sessions, the restarter (stopped for the save) never sees a
death, and the notebook's websocket stays open. A kernel asleep in the gpu tier moves here
by the same save, its GPU untouched (``gpu/hook.py``). The wake restores the snapshot into
the same slot, onto whatever GPUs are free, as any restore.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..._constants import format_bytes
from ...core import procfs
from ...core.errors import SnapshotError
from ...core.hooks import Progress
from ...launch.provisioner import Adoption
from ...node.gpus import remap_notice
from ..jobs import Job
from ..service import HIBERNATE, SnapshotService
from ..sleepers import SleepingKernel
from .held_messages import HeldMessages, waking_moves

# How often a waking kernel's held cells are told how far the restore is.
PROGRESS_EVERY_SECONDS = 0.5


class ProcessTier:
    """Saves kernels that hibernate in the process tier, and restores them to wake; made by
    ``Hibernation``."""

    def __init__(self, service: SnapshotService, held: HeldMessages) -> None:
        self.service = service
        self.held = held

    async def start_save(self, kernel_id: str, asleep: bool = False) -> Job:
        """The job of the process tier: a stopping save that keeps the slot. ``asleep``: the
        kernel sleeps in the gpu tier, and is saved as it is."""
        return await self.service.start_save(kernel_id, stop=True, reason=HIBERNATE,
                                             asleep=asleep)

    async def wake(self, job: Job, sleeper: SleepingKernel) -> dict[str, Any]:
        """The wake job: restore the snapshot, and give the tree to the same slot."""
        assert sleeper.snapshot_id is not None
        service = self.service
        km = service.kernel(sleeper.kernel_id)
        snapshot = await asyncio.to_thread(service.engine.get, sleeper.snapshot_id)
        restored = await service.engine.restore(
            snapshot, self._wake_progress(job, sleeper), gpus=None
        )
        try:
            ours = {k: v for k, v in restored.connection_info.items() if k.endswith("_port")}
            slot = {k: v for k, v in km.get_connection_info().items() if k.endswith("_port")}
            if ours != slot:
                raise SnapshotError("adopt", "the restored kernel listens on other ports "
                                    "than its slot")
            await km.provisioner.wake(
                Adoption(restored.pid, restored.connection_info, snapshot.id)
            )
        except BaseException:
            await asyncio.to_thread(procfs.kill_tree, restored.pid)
            raise
        km.execution_state = "idle"
        km.start_restarter()
        remap = restored.notes.get("gpu_remap")
        # A restored kernel asks to be told its slot before %gpu_snapshot works in it, even
        # in the slot it was saved from; the held cells go out after this.
        await service.slots.tell_slot(sleeper.kernel_id, remap_notice(remap))
        return {
            "kernel_id": sleeper.kernel_id, "snapshot_id": snapshot.id, "gpu_remap": remap,
            "timings": restored.timings,
        }

    def _wake_progress(self, job: Job, sleeper: SleepingKernel) -> Callable[[Progress], None]:
        """The job's progress, also shown in the held cells' outputs now and then."""
        report = self.service.jobs.progress(job)
        shown = [0.0]

        def progress(p: Progress) -> None:
            report(p)
            now = time.monotonic()
            if now - shown[0] < PROGRESS_EVERY_SECONDS or not p.total:
                return
            shown[0] = now
            text = (f"Waking the kernel ({waking_moves(sleeper)}): {p.phase} "
                    f"{format_bytes(p.done)} of {format_bytes(p.total)}…")
            self.held.show_progress(sleeper, text)

        return progress
