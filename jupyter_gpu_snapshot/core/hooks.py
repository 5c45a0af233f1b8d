"""What the engine hands its hooks, and what a hook may do: the contract with the GPU layer.

A hook (``SnapshotHook``) is called at fixed points of the save sequence (``save.py``) and
of the restore sequence (``restore.py``), with one context per run (``SaveContext``,
``RestoreContext``) through which it reads the kernel or the snapshot, adds to the
manifest and to the criu run, and reports progress. The GPU layer's hook
(``gpu/hook.py``) and the open-files hook (``open_files.py``) are the two there are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import procfs
from .criu import CriuExtras
from .errors import SnapshotError
from .file_access import OWN_FILES, FileAccess
from .store import Snapshot


@dataclass(frozen=True)
class Progress:
    """A progress report: the phase under way and, when known, bytes done of a total."""

    phase: str
    done: int = 0
    total: int = 0
    message: str = ""


ProgressCallback = Callable[[Progress], None]
# Has the kernel write its portable copy (kernel/portable/) into the directory given,
# and returns the kernel's report of it; raises SnapshotError if it could not.
PortableWriter = Callable[[Path], Awaitable[dict[str, Any]]]


@dataclass
class SaveTarget:
    """What to save: any pid of the kernel, plus what the caller knows about it."""

    pid: int
    kernel_name: str | None = None
    kernel_spec: dict[str, Any] | None = None
    connection_info: dict[str, Any] | None = None
    notebook_path: str | None = None
    kernel_id: str | None = None
    reason: str = "user"
    # The cells the kernel ran (the manifest's "history"), asked of it before the save.
    history: dict[str, Any] | None = None
    # Set when a portable copy is asked for: called after the draft, before the pause.
    portable: PortableWriter | None = None
    # Whether the save fails without its copy (the user asked), or goes on with a warning
    # (a policy asked, within a time budget).
    portable_required: bool = True


@dataclass
class SaveContext:
    """Shared by the hooks during one save."""

    target: SaveTarget
    kernel: procfs.KernelProcess
    snapshot_id: str
    images_dir: Path
    stop: bool
    report: ProgressCallback
    # Hooks add their own manifest sections here (the GPU layer adds "gpu").
    manifest: dict[str, Any] = field(default_factory=dict)
    # Bytes that the dump will write beyond host RSS (e.g. GPU memory staged to the host).
    extra_bytes: int = 0
    # What hooks add to the criu dump (the GPU layer: CRIU's CUDA plugin and its broker).
    criu: CriuExtras = field(default_factory=CriuExtras)
    # How the kernel user's files are opened: the engine's (``FileAccess``).
    files: FileAccess = OWN_FILES
    criu_version: str = ""
    # When the kernel process started: with its pid, it names the process that must survive.
    kernel_started: float | None = None
    dump_ended: float = 0.0  # wall clock, to say how long after it a kernel died
    # Set by a hook in ``after_dump`` when it knows why a failed dump failed better than
    # criu's log does (e.g. the CUDA lock that timed out inside criu).
    failure_cause: SnapshotError | None = None

    @property
    def root_pid(self) -> int:
        return self.kernel.root_pid


@dataclass
class RestoreContext:
    """Shared by the hooks during one restore."""

    snapshot: Snapshot
    report: ProgressCallback
    root_pid: int = 0
    # The user's choice of target GPUs (indices or UUIDs, in the order of the process's
    # devices); a hook that honours it sets ``gpus_taken``.
    gpus: list[str] | None = None
    gpus_taken: bool = False
    # What hooks say about this restore, handed back in ``RestoredKernel.notes``
    # (the GPU layer adds "gpu_remap").
    notes: dict[str, Any] = field(default_factory=dict)
    # What hooks add to the criu restore; with ``leave_stopped`` false, criu itself lets the
    # tasks run at its end (the GPU layer's plugin, once CUDA is back) and gates that on
    # ``images_verified``, which resolves once every digest of the images matched.
    criu: CriuExtras = field(default_factory=CriuExtras)
    # How the kernel user's files are opened: the engine's (``FileAccess``).
    files: FileAccess = OWN_FILES
    images_verified: Awaitable[float] | None = None
    criu_version: str = ""
    # The directory criu will read the images from, set before ``before_restore``.
    images_dir: Path | None = None
    # What lets the tree criu left stopped (``criu.leave_stopped``) run, once every digest
    # matched: SIGCONT to each process, unless a hook puts the tree in other hands first
    # (the GPU layer holds the threads of a sleeping kernel's snapshot before it continues).
    resume_tree: Callable[[int], object] = procfs.continue_tree


class SnapshotHook:
    """Extension points around the dump and the restore. The base class does nothing."""

    name = "hook"

    async def preflight_save(self, ctx: SaveContext) -> None:
        """Called by ``save`` before anything touches the process; raise to refuse."""

    async def before_dump(self, ctx: SaveContext) -> None:
        """Called by ``save`` right before ``criu dump``, the tree still running: add to
        ``ctx.criu`` what the dump needs (the GPU layer starts its broker and loads CRIU's
        CUDA plugin, which locks and checkpoints CUDA inside criu)."""

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        """Called by ``save`` once for every save whose ``preflight_save`` this hook passed:
        after the dump, or after whatever ended the save before it (then ``before_dump``
        may not have run, or not to its end). It releases what preflight took.

        ``error`` is None on success. The hook must leave a surviving process running
        (``ctx.stop`` false, or any failure); hooks run in reverse order.
        """

    async def preflight_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` once the signature matched, before criu runs; raise to refuse."""

    async def before_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` right before ``criu restore``, once the images' digests are
        being checked (``ctx.images_verified``)."""

    async def restore_failed(self, ctx: RestoreContext, error: BaseException) -> None:
        """Called by ``restore`` when criu or the digests failed after ``before_restore``."""

    async def before_resume(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` once criu has recreated the tree (``ctx.root_pid``) and every
        digest matched, before the tree is let run where criu left it stopped
        (``ctx.criu.leave_stopped``); raise to refuse it (the tree is killed)."""

    async def after_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` once criu has recreated the tree (``ctx.root_pid``) and it
        runs (or, with ``ctx.criu.leave_stopped``, has just been continued)."""
