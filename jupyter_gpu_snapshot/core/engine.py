"""The engine: the one object that callers (the server, the CLI, the benchmarks) use to
save kernels into a ``SnapshotStore`` and restore them from it.

It owns the store (and its index), the criu runner, the hooks and the node's compatibility
cache, answers the queries over the store, and runs the two sequences: the save in
``save.py`` (where CUDA and criu interleave) and the restore in ``restore.py``. What hooks
get and may do is in ``hooks.py``.

Whatever fails, a sequence rolls back what it did and raises one SnapshotError naming the
step and the cause; a cancelled caller never leaves a kernel frozen or its CUDA locked.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .compatibility import NodeCompatibility
from .criu import CriuRunner
from .file_access import OWN_FILES, FileAccess
from .hooks import Progress, ProgressCallback, SaveTarget, SnapshotHook
from .sequences import KERNEL_ANSWER_SECONDS, KernelAnswers, keep_log
from .store import Snapshot, SnapshotIndex, SnapshotStore

# The sequences and the usage count are imported when first run: a listing needs none.
if TYPE_CHECKING:
    from .restore import RestoredKernel
    from .store import StoreUsage


class SnapshotEngine:
    """Saves kernels into a ``SnapshotStore`` and restores them from it."""

    def __init__(
        self,
        store: SnapshotStore | None = None,
        criu: CriuRunner | None = None,
        hooks: Sequence[SnapshotHook] = (),
        compatibility: NodeCompatibility | None = None,
        kernel_answers: KernelAnswers | None = None,
        files: FileAccess | None = None,
        index: SnapshotIndex | None = None,
    ) -> None:
        self.store = store or SnapshotStore()
        # Asks a kernel (by its connection info) for kernel_info: part of the check that a
        # keep-running save's kernel survived. core/ speaks no Jupyter protocol itself.
        self.kernel_answers = kernel_answers
        self.kernel_answer_seconds = KERNEL_ANSWER_SECONDS
        self.criu = criu or CriuRunner()
        self.hooks = list(hooks)
        # Also caches the digests of mapped files across saves and restores.
        self.compatibility = compatibility or NodeCompatibility()
        # How the kernels' files are opened: as this process, or (the node agent's) as
        # their user.
        self.files = files or OWN_FILES
        # Shared by engines of one store (the node agent builds one per operation).
        self.index = index or SnapshotIndex(self.store)

    @property
    def location(self) -> str:
        """Where the snapshots are, as messages name it."""
        return str(self.store.root)

    def store_usage(self) -> StoreUsage:
        """The store's bytes on disk (``core/store/usage.py``); it reads every recipe: in a
        thread."""
        from .store import store_usage

        return store_usage(self.store)

    # -- queries ---------------------------------------------------------------------------
    # These read the disk: callers on an event loop run them in a thread.
    def list(self, notebook_path: str | None = None) -> list[Snapshot]:
        """Trusted snapshots only: what retention, status and restores may act on."""
        return self.index.list(notebook_path)

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Every snapshot with its status (ok, unsigned, damaged), for listings people read."""
        return self.index.catalog(notebook_path)

    def get(self, ref: str) -> Snapshot:
        return self.index.get(ref)

    def find_name(self, name: str) -> Snapshot | None:
        return self.index.find_name(name)

    def delete(self, ref: str) -> Snapshot:
        """Remove a snapshot; slow for a big one (it removes gigabytes)."""
        return self.store.delete(self.index.get(ref).id)

    def rename(self, ref: str, new_name: str) -> Snapshot:
        """Give a snapshot another name (its manifest is re-signed)."""
        return self.store.rename(self.index.get(ref).id, new_name)

    def portable_files(self, snapshot: Snapshot) -> contextlib.AbstractContextManager[Path]:
        """A directory holding the checked portable copy of ``snapshot``, for a fallback
        (``node/fallback.py``); removed on leaving."""
        return self.store.portable_files(self.store.reload(snapshot))

    def _keep_log(self, log: Path, label: str) -> Path | None:
        """A failed run's criu log, kept where the error can point at it (``keep_log``)."""
        return keep_log(self.store, log, label)

    # -- the two sequences -----------------------------------------------------------------
    async def save(
        self,
        target: SaveTarget,
        name: str | None = None,
        stop: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Snapshot:
        """Snapshot the kernel tree of ``target.pid``; keep it running unless ``stop``.

        The steps, and where CUDA happens inside criu, are in ``save.py``.
        """
        from .save import save_kernel

        return await save_kernel(self, target, name, stop, _throttled(progress))

    async def restore(
        self,
        ref: str | Snapshot,
        progress: ProgressCallback | None = None,
        gpus: Sequence[str] | None = None,
    ) -> RestoredKernel:
        """Bring a snapshot back as a running process tree in a new PID namespace.

        ``gpus`` chooses the GPUs of this node that the process's devices go onto (index or
        UUID, cuda:0 first); without it, the GPU layer chooses. The steps are in
        ``restore.py``.
        """
        from .restore import restore_snapshot

        report = _throttled(progress)
        snapshot = ref if isinstance(ref, Snapshot) else await asyncio.to_thread(self.get, ref)
        return await restore_snapshot(self, snapshot, report, gpus)

    async def check_ports(self, snapshot: Snapshot) -> None:
        """Raise PortsInUse when a port the restored kernel would listen on is taken."""
        from .restore import check_ports

        await check_ports(snapshot)

    async def check_compatibility(
        self,
        snapshot: Snapshot,
        report: ProgressCallback,
        timings: dict[str, float],
        gpu_targets: Sequence[str] | None = None,
    ) -> None:
        """Raise Incompatible when this node cannot run the snapshot (see compatibility);
        ``gpu_targets`` are the models of the GPUs chosen for a restore, by default this
        node's GPUs."""
        from .restore import check_compatibility

        await check_compatibility(self.compatibility, snapshot, report, timings, gpu_targets,
                                  self.files)


def _throttled(progress: ProgressCallback | None, interval: float = 0.1) -> ProgressCallback:
    """At most one report per ``interval`` within a phase; phase changes and new messages
    (warnings among them) always pass."""
    if progress is None:
        return lambda _p: None
    last: list[Any] = ["", 0.0, ""]
    sink = progress

    def report(p: Progress) -> None:
        now = time.monotonic()
        news = bool(p.message) and p.message != last[2]
        if (p.phase != last[0] or news or now - last[1] >= interval
                or (p.total and p.done >= p.total)):
            last[0], last[1], last[2] = p.phase, now, p.message
            sink(p)

    return report
