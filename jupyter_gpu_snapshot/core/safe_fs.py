"""File system steps that never follow a symlink planted by someone else.

The store is trusted the way OpenSSH trusts ``~/.ssh``: the directory and every parent up
to ``/`` must be owned by us or by root and writable by nobody else (a sticky parent such
as /tmp is allowed: nobody can rename what we own in it). Inside it, every open is
``O_NOFOLLOW`` relative to a directory fd.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import SnapshotError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafeStore(SnapshotError):
    """The store, or a directory above it, could be changed by another user."""


def chain_problems(path: Path) -> list[str]:
    """What makes ``path`` (a directory) or one of its parents unsafe; empty when none."""
    problems: list[str] = []
    me = os.geteuid()
    resolved = Path(os.path.realpath(path))
    try:
        info = os.lstat(resolved)
    except OSError as exc:
        return [f"{resolved}: {exc.strerror}"]
    if not stat.S_ISDIR(info.st_mode):
        return [f"{resolved} is not a directory"]
    if info.st_uid != me:
        problems.append(f"{resolved} is owned by uid {info.st_uid}, not by uid {me}")
    if info.st_mode & 0o077:
        problems.append(f"{resolved} has mode {info.st_mode & 0o777:o}, needs 700")
    for parent in resolved.parents:
        try:
            info = os.lstat(parent)
        except OSError as exc:
            problems.append(f"{parent}: {exc.strerror}")
            continue
        if info.st_uid not in (me, 0):
            problems.append(f"{parent} is owned by uid {info.st_uid}, neither root nor us")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                               if info.st_mode & bit)
            problems.append(f"{parent} is writable by {who} (mode {info.st_mode & 0o7777:o})")
    return problems


def require_private_dir(path: Path) -> None:
    problems = chain_problems(path)
    if problems:
        raise UnsafeStore(
            "store",
            f"the snapshot store {path} is not private: {'; '.join(problems)}",
            hint="snapshots are code that runs as this user; use a store that only this user "
            "can change (chown/chmod it, or set c.GPUSnapshot.store_dir)",
        )


def tighten_own_dir(path: Path) -> None:
    """Make a directory of ours that others may only read 0700 (a store made by ``mkdir``
    under the usual umask). One that others could write stays as it is, to be refused:
    what they may have put there is not ours."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        readable_only = info.st_mode & 0o077 and not info.st_mode & 0o022
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and readable_only:
            os.chmod(path, 0o700, follow_symlinks=False)


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 whatever the umask."""
    missing: list[Path] = []
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700, follow_symlinks=False)


@contextlib.contextmanager
def opened_dir(name: str | Path, dir_fd: int | None = None) -> Iterator[int]:
    """A directory fd; refuses a symlink (ELOOP) or a non-directory (ENOTDIR)."""
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(name: str, dir_fd: int) -> tuple[int, int]:
    """``(fd, size)`` of a regular file in ``dir_fd``; symlinks and devices are refused."""
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(f"{name} is not a regular file")
    return fd, info.st_size


def read_small(name: str, dir_fd: int, limit: int) -> bytes:
    fd, size = open_regular(name, dir_fd)
    try:
        if size > limit:
            raise OSError(f"{name} has {size} bytes, more than {limit}")
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def write_new(name: str, dir_fd: int, data: bytes) -> None:
    """Write a new 0600 file durably; never through an existing name."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def entry_kind(name: str, dir_fd: int) -> str:
    """'dir', 'file', 'symlink', 'other' or 'missing', without following a link."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


_KINDS = {
    stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a link",
    stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a Unix socket",
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
}  # fmt: skip


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` is, for messages: 'a FIFO (named pipe)', 'a link'..."""
    return _KINDS.get(stat.S_IFMT(mode), "a file of another type")


def remove_at(name: str, dir_fd: int) -> None:
    """Remove a directory tree, a file or a link (the link itself, never its target)."""
    if entry_kind(name, dir_fd) == "dir":
        # Reached through the directory fd; rmtree walks by fds and never follows a link.
        shutil.rmtree(f"/proc/self/fd/{dir_fd}/{name}", ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``, however many calls pwrite takes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path`` (never through a link); None if unreadable or no object."""
    try:
        with open(path, opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
