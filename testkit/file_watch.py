"""What happens to a file while a test runs, as the kernel sees it: who opened it
(``FileOpens``, through inotify), and which threads wait in the open of a FIFO that has no
writer (``fifo_waiters``), so that a test waits for those events rather than for time.

Standard library only (inotify through ctypes: no package of the standard library has it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

# inotify(7)
IN_ACCESS = 0x001
IN_OPEN = 0x020
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)

# The kernel function a task sleeps in while its open(2) of a FIFO waits for the other end
# (fs/pipe.c), as /proc/PID/task/TID/wchan names it.
FIFO_OPEN_WAIT = "wait_for_partner"


class FileOpens:
    """Counts the opens and reads of one file, by anyone, while the watch is on: a context
    manager; ``opened()`` tells how many happened so far. An open that the kernel refused
    (EACCES, ELOOP) is no open and is not counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = -1
        self._events: list[int] = []

    def __enter__(self) -> FileOpens:
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self._libc.inotify_add_watch(self._fd, os.fsencode(self.path),
                                        IN_OPEN | IN_ACCESS) < 0:
            error = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(error, f"inotify_add_watch {self.path}")
        return self

    def opened(self) -> int:
        """The opens and reads of the file seen so far."""
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                self._events.append(mask)
                offset += _EVENT.size + length
        return sum(1 for mask in self._events if mask & (IN_OPEN | IN_ACCESS))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        with contextlib.suppress(OSError):
            self.opened()
        os.close(self._fd)


def fifo_waiters(pids: Iterable[int]) -> int:
    """How many threads of the processes ``pids`` sleep in an open of a FIFO, waiting for
    its other end."""
    found = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/task/{task}/wchan").read_text() == FIFO_OPEN_WAIT:
                        found += 1
    return found


def release_fifo(path: Path, tries: int = 100) -> None:
    """Let the opens of the FIFO at ``path`` that wait for a writer go on: open it for
    writing, which succeeds only while it has a reader, and close it again, which ends what
    they read; until no reader is left, or ``tries`` times."""
    for _ in range(tries):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ENOENT):  # no reader left, or no FIFO
                return
            raise
        os.close(fd)
