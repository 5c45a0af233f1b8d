"""How a snapshot-ready kernel ended, as its namespace init wrote it into the kernel's log.

``launch/nsinit.py`` writes one line when the kernel process ends:
``nsinit: kernel ended: killed by signal 11 (SIGSEGV)`` or ``... exited with status 1``.
A restored kernel is no child of the server, so that line is the one record of what killed
it. The server (``server/deaths.py``) and the engine read it through this module only.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from .._constants import KERNEL_DEATH_PREFIX

# The end of the log is enough: nsinit's line is the last the dead kernel's tree writes; a
# kernel restarted into the same slot appends only its start-up lines before anyone reads.
TAIL_BYTES = 64 * 1024
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_SIGNAL = re.compile(r"killed by signal (\d+)(?: \((\w+)\))?")
_EXIT = re.compile(r"exited with status (-?\d+)")


def kernel_death_cause(log_path: str | os.PathLike[str], start: int = 0) -> str | None:
    """What ended the kernel, in nsinit's words ('killed by signal 11 (SIGSEGV)'), or None.

    The last such line written at or after byte ``start`` of the log counts (a slot's log
    holds every kernel that ran in it; ``start`` is where the current one began). None when
    the log is missing or unreadable, or holds no such line: the init itself was killed
    (SIGKILL to the whole tree), or the kernel was not launched by nsinit; also when it is
    no regular file: the log's directory is its user's, and the node agent reads it as root,
    so it is opened without following a link and without waiting (a FIFO would hold the
    open forever). Reads the disk: call it off the event loop.
    """
    try:
        fd = os.open(log_path, _READ_FLAGS)
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
