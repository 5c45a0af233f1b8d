"""``GET kernels/{kernel_id}/status``: can the kernel be saved, and what is its state.

``SnapshotService.kernel_status`` gathers the facts (the kernel's root pid, its notebook,
its snapshots, its running job) and hands them in; nothing here knows the service.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

from ..core import procfs
from ..core.errors import SnapshotError
from ..core.store import Snapshot
from ..node.gpus import tree_cuda_state
from .jobs import Job, JobRunner, kernel_key

# Answers kept for kernels with a save or restore under way, which may take minutes.
_FORGET_SECONDS = 3600.0


class TreeFacts:
    """Why a kernel tree cannot be saved, and whether it uses CUDA, as of a moment ago.

    Finding a tree walks the host's whole process table (tens of ms on a busy host), and
    clients poll the status of the same kernel from several tabs. These are facts of how
    the kernel was launched, so an answer ``ttl`` seconds old is good enough here; a save
    never uses it (the engine inspects the tree afresh).
    """

    def __init__(self, node_problems: Callable[[], list[str]], ttl: float = 1.0) -> None:
        # Why this node can save no kernel now (criu missing or too old: the engine's).
        self.node_problems = node_problems
        self.ttl = ttl
        self._lock = threading.Lock()
        self._recent: dict[int | None, tuple[float, list[str], bool]] = {}

    def get(self, root: int | None, busy: bool = False) -> tuple[list[str], bool]:
        """(reasons it is not snapshot-ready, whether it maps libcuda); blocks: use a thread.

        ``busy``: a save or restore of this kernel runs. Then the last answer, however old,
        is used: reading the /proc of a tree that criu holds can wait for criu.
        """
        now = time.monotonic()
        with self._lock:
            for key in [k for k, v in self._recent.items() if now - v[0] > _FORGET_SECONDS]:
                del self._recent[key]
            if root in self._recent:
                seen, reasons, cuda = self._recent[root]
                if busy or now - seen <= self.ttl:
                    return list(reasons), cuda
        reasons, cuda = self._read(root)
        with self._lock:
            self._recent[root] = (now, reasons, cuda)
        return list(reasons), cuda

    def _read(self, root: int | None) -> tuple[list[str], bool]:
        reasons: list[str] = []
        cuda = False
        if root is None:
            reasons.append("the kernel has no running process")
        else:
            try:
                reasons.extend(procfs.inspect_kernel(root).problems)
            except SnapshotError as exc:
                reasons.append(exc.cause)
            except (OSError, psutil.Error):
                # It exited while it was read: a kernel killed as its status is asked for.
                reasons.append("the kernel has no running process")
            cuda = procfs.tree_maps_library(root, "libcuda.so")
        reasons.extend(self.node_problems())
        return reasons, cuda


async def kernel_status(
    kernel_id: str,
    kernel_name: str,
    root: int | None,
    notebook: str | None,
    snapshots: list[Snapshot],
    job: Job | None,
    facts: TreeFacts,
    log: logging.Logger,
    death: dict[str, Any] | None = None,
    restored_from: str | None = None,
) -> dict[str, Any]:
    """The status object of the API (openapi.yaml, KernelStatus).

    ``snapshots`` are the store's, oldest first; the newest of this kernel's, its
    notebook's or the one it was restored from (``restored_from``) is the last snapshot.
    ``death``: the record of the slot's last kernel death that the user has not dismissed
    (``deaths.KernelDeaths``).
    """
    reasons, uses_cuda = await asyncio.to_thread(facts.get, root, job is not None)
    last = newest_snapshot(snapshots, kernel_id, notebook, restored_from)
    return {
        "kernel_id": kernel_id,
        "ready": not reasons,
        "reasons": reasons,
        "kernel_name": kernel_name,
        "notebook_path": notebook,
        "cuda": await cuda_status(root, uses_cuda, log),
        "last_snapshot": last.summary() if last else None,
        "job": job.to_dict() if job else None,
        "death": death,
    }


def newest_snapshot(
    snapshots: list[Snapshot],
    kernel_id: str,
    notebook: str | None,
    restored_from: str | None = None,
) -> Snapshot | None:
    """The newest of ``snapshots`` (oldest first) taken of the kernel, of its notebook, or
    the one the kernel was restored from."""
    mine = [
        s for s in snapshots
        if (s.manifest.get("kernel") or {}).get("kernel_id") == kernel_id
        or (notebook is not None and s.notebook_path == notebook)
        or (restored_from is not None and s.id == restored_from)
    ]
    return mine[-1] if mine else None


def newest_once_saved(
    jobs: JobRunner, trusted: Callable[[], list[Snapshot]]
) -> Callable[[str, str | None, str | None], Awaitable[Snapshot | None]]:
    """How ``KernelDeaths`` finds a dead kernel's newest snapshot: the newest of
    ``trusted()`` (the engine's trusted snapshots, oldest first, read in a worker thread)
    taken of the kernel, its notebook, or its origin; once a save of the kernel running now
    has ended. A kernel that died right after its dump is offered the snapshot of that
    dump, which the save commits after the death (its job then fails, naming the death)."""

    async def newest(
        kernel_id: str, notebook: str | None, restored_from: str | None = None
    ) -> Snapshot | None:
        saving = jobs.busy_with(kernel_key(kernel_id))
        if saving is not None and saving.kind == "save":
            await jobs.wait(saving)
        snapshots = await asyncio.to_thread(trusted)
        return newest_snapshot(snapshots, kernel_id, notebook, restored_from)

    return newest


async def cuda_status(
    root: int | None, uses_cuda: bool, log: logging.Logger
) -> dict[str, Any] | None:
    """The kernel's CUDA state; None when nobody can tell.

    A kernel that has not loaded libcuda has no CUDA state; for one that has, the driver's
    checkpoint API and NVML are asked.
    """
    if root is None:
        return None
    if not uses_cuda:
        return {"state": "none", "memory_bytes": 0}
    try:
        return await asyncio.to_thread(tree_cuda_state, root)
    except Exception as exc:  # a status query must not fail on a driver problem
        log.info("gpu-snapshot: cannot read the CUDA state of %s: %s", root, exc)
        return None
