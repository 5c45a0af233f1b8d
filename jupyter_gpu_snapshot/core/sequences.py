"""What the save sequence (``save.py``) and the restore sequence (``restore.py``) share: the
parts of the engine they use, a criu run's work directory and kept log, and how a cancelled
caller waits for the rollback."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from . import locks
from .compatibility import NodeCompatibility
from .criu import CriuRunner
from .errors import SnapshotError
from .file_access import FileAccess
from .hooks import SnapshotHook
from .locks import HeldLock
from .recovery import WORK_LOCK, work_base
from .store import SnapshotStore

# Asks a kernel (by its connection info) for kernel_info within a timeout, in seconds.
KernelAnswers = Callable[[dict[str, Any], float], Awaitable[bool]]
# How long a kernel that a keep-running save left running has to answer kernel_info.
KERNEL_ANSWER_SECONDS = 30.0
T = TypeVar("T")


class EngineParts(Protocol):
    """What the sequences use of the engine (``SnapshotEngine`` owns them)."""

    @property
    def store(self) -> SnapshotStore: ...

    @property
    def criu(self) -> CriuRunner: ...

    @property
    def hooks(self) -> Sequence[SnapshotHook]: ...

    @property
    def compatibility(self) -> NodeCompatibility: ...

    @property
    def kernel_answers(self) -> KernelAnswers | None: ...

    @property
    def kernel_answer_seconds(self) -> float: ...

    @property
    def files(self) -> FileAccess: ...


def work_dir(kind: str) -> tuple[Path, HeldLock]:
    """A private temp directory for one criu run, locked while in use (see recovery)."""
    work = Path(tempfile.mkdtemp(prefix=f"jupyter-gpu-snapshot-{kind}-", dir=work_base()))
    held = locks.try_lock(work / WORK_LOCK, kind)
    assert held is not None  # nobody else knows the directory yet
    return work, held


def keep_log(store: SnapshotStore, log: Path, label: str) -> Path | None:
    """Copy a failed run's criu log into the store's logs/; where that fails (a full
    disk, a planted link), keep a private temporary copy, so the error points at a log."""
    if not log.is_file():
        return None  # criu died before writing anything
    try:
        return store.keep_log(log, label)
    except (OSError, SnapshotError):
        fd, spare = tempfile.mkstemp(prefix=f"jupyter-gpu-snapshot-{label}-", suffix=".log")
        os.close(fd)
        shutil.copyfile(log, spare)
        return Path(spare)


async def finish_despite_cancel(work: asyncio.Future[T], interrupt: asyncio.Event) -> T:
    """Await a save or restore; when cancelled (Ctrl-C, a server stopping), ask it to stop
    at its next safe point and wait for its rollback: no kernel is left frozen or locked.

    A stopping save whose dump already completed cannot roll back (the kernel is gone), so
    it commits and its snapshot is returned despite the cancel; so is a finished restore.
    """
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.done():
                break
            cancelled = True
            interrupt.set()
        except BaseException:
            break
    if cancelled:
        task = asyncio.current_task()
        if work.cancelled() or work.exception() is not None:
            raise asyncio.CancelledError()
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()
    return work.result()
