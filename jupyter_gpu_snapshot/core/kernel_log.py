"""A snapshot-ready kernel's log: where it lies, how a restore opens it, how the kernel ended.

Snapshot-ready kernels of a user write their logs in one directory (the store's
``default_kernel_log_dir``, where a manifest's log files must lie).
A restore opens them before criu does (``open_log_files``), through the engine's
``FileAccess``: as this process (``open_own_log``), or, for the node agent, as the
kernel's user.

``launch/nsinit.py`` writes one line when the kernel process ends:
``nsinit: kernel ended: killed by signal 11 (SIGSEGV)`` or ``... exited with status 1``.
A restored kernel is no child of the server, so that line is the one record of what killed
it. The server (``server/deaths.py``) and the engine read it through this module only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._constants import KERNEL_DEATH_PREFIX
from . import safe_fs
from .errors import SnapshotError
from .store import Snapshot
from .user_paths import OWN_OPENER, OpensUserPaths, UserPath

# -- opening the logs for a restore ----------------------------------------------------------
# A kernel log is opened never through a link, never waiting (a FIFO or a device there must
# not hold the restore).
_LOG_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_A_LOG_HINT = "remove it and restore again: the restore creates the kernel's log anew"


class LogOpener(OpensUserPaths, Protocol):
    """What opens a kernel's log for a restore: the engine's ``FileAccess``."""

    def open_log(self, path: str) -> int:
        """The log at ``path`` for appending, made if missing (``FileAccess.open_log``)."""
        ...


def open_log_files(snapshot: Snapshot, files: LogOpener) -> dict[str, int]:
    """The log files of trusted ``snapshot``'s kernel, each opened for appending by
    ``files`` (path -> descriptor; the caller closes them), checked before criu reopens
    them. Each is in the kernel-log directory only (the manifest's check put it there)."""
    snapshot.require_trusted()
    opened: dict[str, int] = {}
    try:
        for path in snapshot.manifest["kernel"]["log_files"]:
            opened[path] = files.open_log(path)
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return opened


def open_own_log(path: str) -> int:
    """A kernel log of this process's own kernels (``OwnFiles.open_log``): opened without
    following a link and without waiting, a regular file of ours linked once; a missing
    one (and its directory) is made anew (``O_EXCL``). Anything else is refused, naming
    what it is."""
    parent, name = os.path.split(path)
    safe_fs.make_private_dirs(Path(parent))
    with safe_fs.opened_dir(parent) as dfd:
        try:
            try:
                fd, created = os.open(name, _LOG_FLAGS, dir_fd=dfd), False
            except FileNotFoundError:
                fd, created = os.open(name, _LOG_FLAGS | os.O_CREAT | os.O_EXCL, 0o600,
                                      dir_fd=dfd), True
        except OSError as exc:
            raise _log_refused(path, name, dfd, exc) from exc
        try:
            require_regular_log(fd, path)
            facts = os.fstat(fd)
            if facts.st_nlink != 1 or not (created or facts.st_uid == os.geteuid()):
                raise SnapshotError(
                    "preflight", f"the kernel log {path} is not the kernel user's own file",
                    hint="remove it and restore again")
            # Blocking again, as the kernel had its log: it is a regular file.
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def require_regular_log(fd: int, path: str) -> None:
    """Refuse a kernel log that is no regular file, naming what it is."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise not_a_regular_log(path, mode)


def _log_refused(path: str, name: str, dfd: int, exc: OSError) -> SnapshotError:
    """The error for a kernel log that could not be opened, naming what is there instead:
    a FIFO with no reader and a socket both fail with ENXIO."""
    mode = None
    with contextlib.suppress(OSError):
        mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
    return log_refused(path, exc, mode)


def log_refused(path: str, exc: OSError, mode: int | None) -> SnapshotError:
    """The error for the kernel log at ``path`` that could not be opened (``exc``), naming
    what is there instead (``mode``, as ``lstat`` saw it, where known)."""
    if exc.errno == errno.ELOOP:
        return SnapshotError("preflight", f"the kernel log {path} is a link: it is never "
                             "followed", hint="remove it and restore again")
    if mode is not None and not stat.S_ISREG(mode):
        return not_a_regular_log(path, mode)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return SnapshotError(
            "preflight", f"the kernel log {path} is not the kernel user's own file "
            f"({exc.strerror})", hint="remove it and restore again")
    return SnapshotError("preflight", f"the kernel log {path} cannot be opened: {exc.strerror}",
                         hint=_NOT_A_LOG_HINT)


def not_a_regular_log(path: str, mode: int) -> SnapshotError:
    return SnapshotError(
        "preflight", f"the kernel log {path} is {safe_fs.kind_of(mode)}, not a regular file",
        hint=_NOT_A_LOG_HINT)


# -- how the kernel ended --------------------------------------------------------------------
# The end of the log is enough: nsinit's line is the last the dead kernel's tree writes; a
# kernel restarted into the same slot appends only its start-up lines before anyone reads.
TAIL_BYTES = 64 * 1024
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_SIGNAL = re.compile(r"killed by signal (\d+)(?: \((\w+)\))?")
_EXIT = re.compile(r"exited with status (-?\d+)")


def kernel_death_cause(log_path: str | os.PathLike[str], start: int = 0,
                       files: OpensUserPaths = OWN_OPENER) -> str | None:
    """What ended the kernel, in nsinit's words ('killed by signal 11 (SIGSEGV)'), or None.

    The last such line written at or after byte ``start`` of the log counts (a slot's log
    holds every kernel that ran in it; ``start`` is where the current one began). None when
    the log is missing or unreadable, or holds no such line: the init itself was killed
    (SIGKILL to the whole tree), or the kernel was not launched by nsinit; also when it is
    no regular file: the log's directory is its user's, so it is opened without following
    a link and without waiting (a FIFO would hold the open forever), by ``files`` (the
    engine's ``FileAccess``: as the kernel's user, for the node agent; by default this
    process). Reads the disk: call it off the event loop.
    """
    try:
        fd = files.open(os.fspath(log_path), _READ_FLAGS, UserPath.KERNEL_LOG)
    except OSError:
        return None
    try:
        facts = os.fstat(fd)
        if not stat.S_ISREG(facts.st_mode):
            return None
        offset = max(start, facts.st_size - TAIL_BYTES, 0)
        tail = os.pread(fd, max(facts.st_size - offset, 0), offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    prefix = KERNEL_DEATH_PREFIX.encode()
    for line in reversed(tail.splitlines()):
        if line.startswith(prefix):
            return line[len(prefix):].decode("utf-8", "replace").strip() or None
    return None


def log_size(log_path: str | os.PathLike[str]) -> int:
    """The log's size now (0 when it does not exist): the ``start`` of a kernel starting now."""
    try:
        return os.stat(log_path).st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class KernelEnd:
    """A death cause as data, for clients that must not read English.

    ``code`` is ``signal`` (``signal`` and, when known, ``signal_name`` are set), ``exit``
    (``exit_status``) or ``unknown`` (no line in the log).
    """

    code: str
    cause: str | None = None
    signal: int | None = None
    signal_name: str | None = None
    exit_status: int | None = None

    @classmethod
    def parse(cls, cause: str | None) -> KernelEnd:
        if cause:
            if (m := _SIGNAL.fullmatch(cause)) is not None:
                return cls("signal", cause, signal=int(m.group(1)), signal_name=m.group(2))
            if (m := _EXIT.fullmatch(cause)) is not None:
                return cls("exit", cause, exit_status=int(m.group(1)))
        return cls("unknown", cause)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "cause": self.cause,
            "signal": self.signal,
            "signal_name": self.signal_name,
            "exit_status": self.exit_status,
        }
