"""How the engine opens the files of a kernel's user: its connection file, its logs, the files
it has open or mapped, its directory of /dev/shm.

Those paths are the user's to change. The engine opens them only through the ``FileAccess``
it was made with, and reads, checks or hands on the descriptor it gets, never the path:

- ``OwnFiles`` opens them as this process: a server or CLI whose kernels run as its own
  user, or root's own server;
- the node agent's opens them as the kernel's user, in a helper process of theirs that
  sends the descriptor back (``agent/files/opener.py``): root resolves none of their paths.

Every open is ``O_NONBLOCK``: a FIFO or a device at a path answers at once, and a caller
checks the type of what it got (``fstat``) before it reads.
"""

from __future__ import annotations

import abc

from . import kernel_log
from .user_paths import OWN_OPENER, UserPath


class FileAccess(abc.ABC):
    """Opens a kernel user's files for the engine (see the module's docstring)."""

    @abc.abstractmethod
    def open(self, path: str, flags: int, what: UserPath) -> int:
        """A descriptor of ``path``, ``what`` of the registry (``user_paths``), opened with
        ``flags`` (``O_NONBLOCK`` and ``O_CLOEXEC`` added); OSError as the open fails.
        Called by the engine's checks of a kernel's files at its save and restore, in
        worker threads."""

    @abc.abstractmethod
    def open_log(self, path: str) -> int:
        """The kernel's log at ``path``, a regular file of the kernel's user opened for
        appending, made if missing; SnapshotError naming what is there instead. Called by
        the restore before criu reopens it."""

    def close(self) -> None:  # noqa: B027 (most have nothing to close)
        """Called by whoever made it, once the operation that used it ended."""


class OwnFiles(FileAccess):
    """The files opened as this process."""

    def open(self, path: str, flags: int, what: UserPath) -> int:
        return OWN_OPENER.open(path, flags, what)

    def open_log(self, path: str) -> int:
        return kernel_log.open_own_log(path)


OWN_FILES = OwnFiles()
