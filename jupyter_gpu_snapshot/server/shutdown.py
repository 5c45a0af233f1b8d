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
from ..core.estimate import KernelToSave, SaveRates, shutdown_order
from ..launch.provisioner import root_pid
from .jobs import Job, JobRunner

# Starts a stopping save of one kernel (``SnapshotService.start_save`` with stop=True).
StartSave = Callable[[str], Awaitable[Job]]
# Host and GPU bytes of one kernel's processes (``SnapshotService.kernel_size``).
KernelSize = Callable[[str], Awaitable[tuple[int, int]]]


@dataclass
class ShutdownReport:
    """What happened to each kernel; logged, and returned for tests."""

    saved: dict[str, str] = field(default_factory=dict)  # kernel id -> snapshot id
    failed: dict[str, str] = field(default_factory=dict)  # kernel id -> message
    skipped: dict[str, str] = field(default_factory=dict)  # kernel id -> why


async def snapshot_kernels_on_shutdown(
    kernel_manager: Any,
    jobs: JobRunner,
    start_save: StartSave,
    kernel_size: KernelSize,
    budget: float,
    log: logging.Logger,
    rates: SaveRates | None = None,
    work_at_risk: Callable[[str], float] | None = None,
    newest_snapshot: Callable[[str], str | None] | None = None,
    rates_of: Callable[[str], Awaitable[SaveRates]] | None = None,
) -> ShutdownReport:
    """Save the snapshot-ready kernels (stopping them) that fit in ``budget`` seconds.

    Called by ``GPUSnapshotApp._save_before_stop``, which passes the service's
    ``start_save`` and ``kernel_size``.

    ``work_at_risk(kernel_id)`` (the autosave scheduler's) says how many seconds of work
    since its newest snapshot a kernel would lose: kernels with none are not saved again,
    and the others go in that order, most first. Each save's time is estimated from the
    kernel's size with ``rates_of(kernel_id)`` (the rates its own past saves measured, the
    service's ``save_rates``), else ``rates``; a kernel whose save does not fit in what is
    left of the budget is passed over for the next one, and keeps its newest snapshot. A save still
    running when the budget ends is left to it: the engine rolls back on its own, and a
    half-written directory of a server that exits meanwhile is removed at the next start.
    """
    report = ShutdownReport()
    rates = rates or SaveRates()
    at_risk = work_at_risk or (lambda _k: float("inf"))
    newest = newest_snapshot or (lambda _k: None)
    deadline = time.monotonic() + budget
    # Jobs the users started (and autosaves) finish first; they hold their kernels.
    still = await jobs.drain(budget)
    for job in still:
        log.warning("gpu-snapshot: job %s still runs as the server stops", job.id)
    candidates: list[KernelToSave] = []
    for kernel_id in kernel_manager.list_kernel_ids():
        if kernel_id not in kernel_manager:
            continue
        why = await _not_ready(kernel_manager.get_kernel(kernel_id))
        if why is None and at_risk(kernel_id) <= 0:
            last = newest(kernel_id)
            why = f"nothing ran since its snapshot {last}" if last else "it has run nothing"
        if why:
            report.skipped[kernel_id] = why
            log.info("gpu-snapshot: not saving kernel %s on shutdown: %s", kernel_id, why)
            continue
        host, gpu = await kernel_size(kernel_id)
        candidates.append(KernelToSave(kernel_id, host, gpu, at_risk(kernel_id), newest(kernel_id)))
    for kernel in shutdown_order(candidates):
        kernel_id = kernel.kernel_id
        if kernel_id not in kernel_manager:
            continue
        needed = kernel.seconds(await rates_of(kernel_id) if rates_of else rates)
        remaining = deadline - time.monotonic()
        if needed > remaining:
            kept = kernel.newest_snapshot or "none: its work since start is lost"
            report.skipped[kernel_id] = (
                f"its save takes about {needed:.0f} s, {max(0.0, remaining):.0f} s of the "
                f"budget were left; it keeps its newest snapshot ({kept})"
            )
            log.warning(
                "gpu-snapshot: not saving kernel %s on shutdown: %s "
                "(GPUSnapshot.shutdown_budget=%ss)",
                kernel_id, report.skipped[kernel_id], budget,
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
            log.info("gpu-snapshot: saved kernel %s as %s (estimated %.1f s)",
                     kernel_id, job.snapshot_id, needed)
        else:
            message = (job.error or {}).get("message", "unknown error")
            report.failed[kernel_id] = message
    return report


async def _not_ready(km: Any) -> str | None:
    """Why the kernel cannot be saved (quietly skipped), or None."""
    if getattr(getattr(km, "provisioner", None), "hibernated", False):
        return "it is hibernated: its hibernation snapshot holds its state"
    root = root_pid(km)
    if root is None:
        return "it has no running process"
    try:
        found = await asyncio.to_thread(procfs.inspect_kernel, root)
    except SnapshotError as exc:
        return exc.cause
    return "; ".join(found.problems) or None
