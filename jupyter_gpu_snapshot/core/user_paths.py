"""Every path of a kernel's user that the engine opens, stats or hands on while it saves or
restores their kernel: one registry.

Each open of such a path names its entry (``FileAccess.open``), so that what the engine
touches is written down here and nowhere else; the node agent opens each as the kernel's
user (``agent/files/opener``). docs/cluster.md's table of checks lists them, and the
agent's path-swap table (``tests/agent/test_path_swaps.py``) swaps each for a file, a FIFO,
a device, a link and a directory: an entry added here without a scenario there fails it.
"""

from __future__ import annotations

import enum
import os
from typing import Protocol


class UserPath(enum.Enum):
    """A path of the kernel's user: (what it is, when the engine touches it, how)."""

    CONNECTION_FILE = (
        "the kernel's connection file (-f on its command line)",
        "a save whose request carries no connection",
        "opened as the user, read only if a regular file of at most 64 KiB",
    )
    WORKING_DIRECTORY = (
        "a process's working directory",
        "a restore",
        "opened as the user (O_PATH) and refused unless the directory of the recorded "
        "device and inode; criu looks it up in the restored mount namespace (O_PATH), and "
        "the restore refuses the tree, before it runs, unless each process sits in a "
        "directory the user opened",
    )
    KERNEL_LOG = (
        "the kernel's log",
        "a restore; a save whose kernel died",
        "opened (made, if missing) as the user, refused unless a regular file",
    )
    OPEN_FILE = (
        "a file the kernel has open",
        "a save (its size and digest); a restore (the changed-files check, criu's reopen)",
        "opened as the user; criu gets that descriptor (--inherit-fd) and opens no path",
    )
    MAPPED_FILE = (
        "a file the kernel has mapped (its libraries)",
        "a save (digests); a restore (the node's compatibility, criu's reopen)",
        "opened as the user; digested from the descriptor; criu gets that descriptor",
    )
    EXECUTABLE = (
        "a process's executable",
        "a restore",
        "opened as the user and refused unless the file of the recorded device and inode; "
        "criu gets that descriptor",
    )
    DEV_SHM = (
        "the kernel's /dev/shm",
        "a save (where a renamed segment lives)",
        "opened as the user, read by its descriptor (names and inodes, no lookup)",
    )

    @property
    def what(self) -> str:
        return self.value[0]

    @property
    def when(self) -> str:
        return self.value[1]

    @property
    def how(self) -> str:
        return self.value[2]


class OpensUserPaths(Protocol):
    """What opens a path of the registry: the engine's ``FileAccess``
    (``core/file_access.py``), taken by the modules it cannot be imported into."""

    def open(self, path: str, flags: int, what: UserPath) -> int:
        """A descriptor of ``path`` opened with ``flags``, ``O_NONBLOCK`` added."""
        ...


class OwnOpener:
    """Opens a path of the registry as this process: a server or CLI whose kernels are
    its own."""

    def open(self, path: str, flags: int, what: UserPath) -> int:
        return os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)


OWN_OPENER = OwnOpener()
