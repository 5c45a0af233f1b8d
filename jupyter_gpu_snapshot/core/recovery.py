"""Finishing what a save left when its process died: never lose a kernel and its image both.

A save writes, in its ``.partial-ID`` directory: ``.owner`` (who), the manifest draft (before
anything touches the kernel, again once the hooks have run), then criu's images, and criu's
post-dump action writes ``.dump-complete`` once every image file is whole. When the saving
process dies (SIGKILL, a stop timeout), criu may still finish, and with ``stop`` the kernel is
then gone: its image is all that is left of it. So a partial whose owner is gone is:

- committed, when its dump completed (digests computed, verified, listed as recovered);
- removed, when its dump did not complete and its kernel still runs (the kernel is the state);
- kept aside as ``.unfinished-ID``, when neither holds: never deleted, only reported.

Called at every server start (``server/app.py``) and by ``jupyter gpu-snapshot recover``.
It builds on the store, which knows nothing of it: data flows one way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import procfs, safe_fs
from .errors import InvalidRequest
from .locks import is_locked, snapshot_key
from .store import (
    ASSEMBLED_PREFIX,
    ASSEMBLY_LOCK,
    DELETING_PREFIX,
    DRAFT_FILE,
    DUMP_COMPLETE_FILE,
    MEMORY_ASSEMBLY_PREFIX,
    MEMORY_DIR,
    PARTIAL_PREFIX,
    UNFINISHED_PREFIX,
    Snapshot,
    SnapshotStore,
    assembly_key,
    is_snapshot_id,
)

log = logging.getLogger(__name__)

# Work directories of criu runs, in the temp dir; each holds this lock while in use.
WORK_PREFIXES = ("jupyter-gpu-snapshot-dump-", "jupyter-gpu-snapshot-restore-",
                 MEMORY_ASSEMBLY_PREFIX)
WORK_LOCK = ASSEMBLY_LOCK

# "<base>/jupyter-gpu-snapshot-restore-XXXXXXXX/images/streamer-serve.sock" within 107 bytes.
MAX_WORK_BASE_BYTES = 40
SHORT_BASE = Path("/tmp")


def work_base() -> Path:
    """Where work directories go: the temp directory, or ``SHORT_BASE`` when its path is
    too long for the Unix socket criu's restore connects to in one (108 bytes at most)."""
    base = Path(tempfile.gettempdir())
    return base if len(os.fsencode(base)) <= MAX_WORK_BASE_BYTES else SHORT_BASE


@dataclass
class RecoveryReport:
    """What a recovery did; each path is logged by the caller."""

    committed: list[Snapshot] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)
    woken: list[int] = field(default_factory=list)


Wake = Callable[[int], object]


def recover_store(store: SnapshotStore, wake: Wake = procfs.continue_tree) -> RecoveryReport:
    """Recover every leftover in ``store``; ``wake`` brings back a kernel tree a killed save
    left stopped (the server and the CLI pass ``local_engine.wake_kernel``, which resumes CUDA)."""
    report = RecoveryReport()
    if not store.root.is_dir():
        return report
    for entry in sorted(store.root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name.startswith(DELETING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            report.removed.append(entry)
        elif entry.name.startswith(PARTIAL_PREFIX):
            _recover_partial(store, entry, report, wake)
        elif entry.name.startswith(ASSEMBLED_PREFIX):
            _remove_unused_assembly(store, entry, report)
        elif is_snapshot_id(entry.name):
            # A commit cut off after its rename leaves whole files beside their recipes.
            report.removed += [entry / name for name in store.drop_whole_copies(entry.name)]
    # Packs of saves killed before their commit, and pages nothing needs any more; left for
    # the next start when a save or a restore holds the packs now.
    store.collect_garbage(wait=False)
    store.locks.tidy()
    return report


def _remove_unused_assembly(store: SnapshotStore, entry: Path, report: RecoveryReport) -> None:
    """Whole files assembled for a restore or an upload whose process died."""
    token = entry.name[len(ASSEMBLED_PREFIX):]
    held = store.locks.try_acquire(assembly_key(token), "recovery")
    if held is None:
        return  # in use
    try:
        shutil.rmtree(entry, ignore_errors=True)
        report.removed.append(entry)
    finally:
        held.release()


def _recover_partial(
    store: SnapshotStore, partial: Path, report: RecoveryReport, wake: Wake
) -> None:
    snapshot_id = partial.name[len(PARTIAL_PREFIX):]
    if procfs.criu_working_on(partial):
        return  # its saver died, but criu still writes: look again at the next start
    held = store.locks.try_acquire(snapshot_key(snapshot_id), "recovery")
    if held is None:
        return  # a save in progress, in this process or another
    try:
        draft = safe_fs.read_json_object(partial / DRAFT_FILE)
        complete = (partial / DUMP_COMPLETE_FILE).is_file()
        kernel = (draft or {}).get("kernel") or {}
        root_pid = int(kernel.get("root_pid") or 0)
        alive = root_pid > 0 and procfs.same_process(root_pid, kernel.get("root_started"))
        if complete and draft is not None:
            _commit_recovered(store, partial, draft, report)
        elif draft is None or alive:
            # No dump began, or the kernel outlived it: the kernel holds the state.
            if alive:
                wake(root_pid)  # a killed criu or saver may have left it stopped or suspended
                report.woken.append(root_pid)
            shutil.rmtree(partial, ignore_errors=True)
            report.removed.append(partial)
        else:
            _keep_aside(
                store, partial, report,
                f"its dump did not complete and kernel pid {root_pid} no longer runs",
            )
    finally:
        held.release()


def _commit_recovered(
    store: SnapshotStore, partial: Path, draft: dict[str, Any], report: RecoveryReport
) -> None:
    manifest = dict(draft, recovered=True)
    try:
        try:
            snapshot = store.commit(partial, manifest)
        except InvalidRequest:  # its name was taken meanwhile: keep the image, rename it
            manifest["name"] = f"recovered-{manifest['id']}"
            snapshot = store.commit(partial, manifest)
        store.verify(snapshot)
    except Exception as exc:
        _keep_aside(store, partial, report, f"its commit failed: {type(exc).__name__}: {exc}")
        return
    report.committed.append(snapshot)


def _keep_aside(store: SnapshotStore, partial: Path, report: RecoveryReport, why: str) -> None:
    target = store.root / f"{UNFINISHED_PREFIX}{partial.name[len(PARTIAL_PREFIX):]}"
    if partial.exists():
        with contextlib.suppress(OSError):
            os.rename(partial, target)
    report.kept.append((target if target.exists() else partial, why))


def clean_work_dirs(directory: Path | None = None) -> list[Path]:
    """Remove criu work directories (in the temp dir) and directories of assembled images
    (in memory) whose saver or restorer died.

    Only directories that carry our lock file are touched, and only when nobody holds it
    and no criu runs in them; anything else may belong to a save just starting.
    """
    bases = [directory] if directory else list(dict.fromkeys(
        [Path(tempfile.gettempdir()), work_base(), MEMORY_DIR]))
    removed: list[Path] = []
    for base in bases:
        removed += _clean_work_dirs_in(base)
    return removed


def _clean_work_dirs_in(base: Path) -> list[Path]:
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            if not entry.name.startswith(WORK_PREFIXES) or entry.is_symlink():
                continue
            with contextlib.suppress(OSError):
                if entry.stat().st_uid != os.getuid() or not (entry / WORK_LOCK).is_file():
                    continue
                if is_locked(entry / WORK_LOCK) or procfs.criu_working_on(entry):
                    continue
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed
