"""Locks that every process using a store honours: the server, the CLI, the magic's server.

One ``flock`` per thing that two operations must not touch at once: a kernel tree (two
dumps of one kernel), a snapshot name (two commits under one name) and a snapshot id (a
restore and a delete, or a save and the cleaning of its working directory). The kernel
releases a ``flock`` when its holder dies, so a killed process never leaves a lock behind;
and since locks belong to open files, two operations in one process exclude each other too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

from .errors import Busy

LOCKS_DIR = ".locks"


def _holder_of(path: Path) -> str:
    """Who holds a lock, as its holder wrote it: ``pid N (what)``."""
    try:
        text = path.read_text()[:200].strip()
        pid, _, what = text.partition(" ")
        command = " ".join(Path(arg).name for arg in psutil.Process(int(pid)).cmdline()[:3])
    except (OSError, ValueError, psutil.Error):
        return "another process"
    return f"pid {pid} ({what}: {command})" if what else f"pid {pid} ({command})"


class HeldLock:
    """An acquired lock; ``fd`` may be handed to a child (criu) so it outlives us."""

    def __init__(self, path: Path, fd: int, tidy_directory: bool = False) -> None:
        self.path = path
        self.fd = fd
        self.tidy_directory = tidy_directory

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self.fd < 0:
            return
        # Unlink while still holding it: whoever opened the old file re-checks the inode.
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1
        if self.tidy_directory:  # the last lock out leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)


def try_lock(path: Path, note: str) -> HeldLock | None:
    """Take the lock file ``path``, or None when another open file holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder unlinked it as we opened it: lock the new file instead
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {note}".encode())
        return HeldLock(path, fd)


def is_locked(path: Path) -> bool:
    """Whether some process holds the lock file ``path`` now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


class StoreLocks:
    """The locks of one store, as files in its ``.locks`` directory."""

    def __init__(self, root: Path) -> None:
        self.directory = root / LOCKS_DIR

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.lock"

    def try_acquire(self, key: str, note: str) -> HeldLock | None:
        """Take the lock ``key``, or None when another operation holds it."""
        while True:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                held = try_lock(self.path(key), note)
            except FileNotFoundError:
                continue  # the last holder removed the empty directory meanwhile
            if held is not None:
                held.tidy_directory = True
            return held

    def acquire(self, key: str, what: str, step: str, note: str = "") -> HeldLock:
        """Take the lock ``key`` or raise ``Busy`` naming ``what`` and who holds it."""
        path = self.path(key)
        held = self.try_acquire(key, note or what)
        if held is None:
            raise Busy(
                step,
                f"{what} is busy: {_holder_of(path)} is working on it",
                hint="wait for that operation to finish, then try again",
            )
        return held

    @contextlib.contextmanager
    def hold(self, key: str, what: str, step: str, note: str = "") -> Iterator[HeldLock]:
        held = self.acquire(key, what, step, note)
        try:
            yield held
        finally:
            held.release()

    def tidy(self) -> None:
        """Remove lock files nobody holds (criu, which inherits locks, leaves them behind)."""
        with contextlib.suppress(OSError):
            for path in self.directory.glob("*.lock"):
                held = self.try_acquire(path.name.removesuffix(".lock"), "tidy")
                if held is not None:
                    held.release()

    def is_held(self, key: str) -> bool:
        return is_locked(self.path(key))


def kernel_key(root_pid: int) -> str:
    return f"kernel-{root_pid}"


def name_key(name: str) -> str:
    return f"name-{name}"


def snapshot_key(snapshot_id: str) -> str:
    return f"snapshot-{snapshot_id}"
