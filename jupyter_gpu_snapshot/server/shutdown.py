"""Snapshots taken while the server stops, so that a node reboot loses no kernel.

``ServerApp._cleanup`` stops the extensions before it shuts the kernels down, on every
way a server stops (SIGTERM, SIGINT, ``jupyter server stop``, the idle shutdown), so the
extension's ``stop_extension`` hook runs this while the kernels are still alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..core import procfs
from ..core.errors import SnapshotError
from ..launch.provisioner import root_pid
from .jobs import Job, JobRunner

# Starts a stopping save of one kernel (``SnapshotService.start_save`` with stop=True).
StartSave = Callable[[str], Awaitable[Job]]


@dataclass
class ShutdownReport:
    """What happened to each kernel; logged, and returned for tests."""

    saved: dict[str, str] = field(default_factory=dict)  # kernel id -> snapshot id
    failed: dict[str, str] = field(default_factory=dict)  # kernel id -> message
    skipped: dict[str, str] = field(default_factory=dict)  # kernel id -> why


def _last_activity(kernel_manager: Any, kernel_id: str) -> float:
    km = kernel_manager.get_kernel(kernel_id)
    stamp = getattr(km, "last_activity", None)
    return stamp.timestamp() if stamp is not None else 0.0


async def snapshot_kernels_on_shutdown(
    kernel_manager: Any,
    jobs: JobRunner,
    start_save: StartSave,
    budget: float,
    log: logging.Logger,
) -> ShutdownReport:
    """Save every snapshot-ready kernel (stopping it), one at a time, within ``budget`` s.

    The most recently active kernels go first. A kernel whose save is still running when
    the budget ends is left to it: the engine rolls back on its own, and a half-written
    directory of a server that exits meanwhile is removed at the next start.
    """
    report = ShutdownReport()
    deadline = time.monotonic() + budget
    # Jobs the users started finish first; they hold their kernels.
    still = await jobs.drain(budget)
    for job in still:
        log.warning("gpu-snapshot: job %s still runs as the server stops", job.id)
    kernel_ids = sorted(
        kernel_manager.list_kernel_ids(),
        key=lambda k: _last_activity(kernel_manager, k),
        reverse=True,
    )
    for kernel_id in kernel_ids:
        if kernel_id not in kernel_manager:
            continue
        why = await _not_ready(kernel_manager.get_kernel(kernel_id))
        if why:
            report.skipped[kernel_id] = why
            log.info("gpu-snapshot: not saving kernel %s on shutdown: %s", kernel_id, why)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            report.skipped[kernel_id] = "the shutdown budget was spent"
            log.warning(
                "gpu-snapshot: no time left to save kernel %s (GPUSnapshot.shutdown_budget=%ss)",
                kernel_id,
                budget,
            )
            continue
        try:
            job = await start_save(kernel_id)
        except SnapshotError as exc:
            report.failed[kernel_id] = exc.message
            continue
        if not await jobs.wait(job, remaining):
            report.failed[kernel_id] = "still saving when the shutdown budget ended"
            log.warning("gpu-snapshot: saving kernel %s outlasted the shutdown budget", kernel_id)
        elif job.status == "succeeded" and job.snapshot_id:
            report.saved[kernel_id] = job.snapshot_id
            log.info("gpu-snapshot: saved kernel %s as %s", kernel_id, job.snapshot_id)
        else:
            message = (job.error or {}).get("message", "unknown error")
            report.failed[kernel_id] = message
    return report


async def _not_ready(km: Any) -> str | None:
    """Why the kernel cannot be saved (quietly skipped), or None."""
    root = root_pid(km)
    if root is None:
        return "it has no running process"
    try:
        found = await asyncio.to_thread(procfs.inspect_kernel, root)
    except SnapshotError as exc:
        return exc.cause
    return "; ".join(found.problems) or None
