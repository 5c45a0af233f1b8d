"""The files of a kernel tree that the node agent has criu dump as external.

criu writes a file the tree has open or mapped into the image as its path, and at restore
opens that path again. For the node agent that would be root opening a path the user
controls. So at the dump every such file is named external (``--external
file[MNT:INODE]``, criu's own key for it): the image then holds that key instead of the
path, the manifest (signed) holds the path, and at the restore criu takes the file only
from a descriptor the agent hands it (``--inherit-fd``), opened by a helper running as the
user (``opener``). criu reopens that descriptor through ``/proc`` with each file's own
flags and position, so every opening keeps its own mode and offset.

It also keeps re-saves working: a restored kernel's files were opened outside its mount
namespace, where criu could not look their mounts up, but an external file needs none.

The executable is mapped, so it is among them. Left to criu, by path: device files
(``/dev``, the user cannot create one), the kernel's own ``/proc``, each process's root
(the root of its own mount namespace, which no user can swap) and its working directory,
which criu must look up inside the restored mount namespace (a descriptor from outside
would leave the kernel in a directory it cannot name, ``getcwd`` failing): its identity is
recorded here, and the restore checks it (``caller_hook``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field

import psutil

from ...core import procfs
from ...core.open_files import DELETED


def ext_id(mnt_id: int, inode: int) -> str:
    """criu's key for an external file: ``file[MNT:INODE]`` in hex (files-reg.c)."""
    return f"file[{mnt_id:x}:{inode:x}]"


def _mnt_id(fdinfo: str) -> int | None:
    with contextlib.suppress(OSError), open(fdinfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return None


def _wanted(path: str, info: os.stat_result) -> bool:
    if not path.startswith("/") or path.endswith(DELETED):
        return False  # sockets, pipes, anonymous inodes; deleted files are refused later
    if path == "/proc" or path.startswith("/proc/"):
        return False
    return stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)


@dataclass
class Externals:
    """What a save records of the tree's files: criu's external key -> path of every
    regular file and directory it has open or mapped (``paths``), and the (device, inode)
    of each of those, and of each process's working directory, by path (``identities``):
    a restore refuses a working directory or an executable whose path now leads
    elsewhere."""

    paths: dict[str, str] = field(default_factory=dict)
    identities: dict[str, list[int]] = field(default_factory=dict)


def external_files(root_pid: int) -> Externals:
    """The ``Externals`` of the tree under ``root_pid``, read through /proc (descriptors the
    kernel holds: no path of the user's is looked up). Blocking; run in a thread, the tree
    still running."""
    found = Externals()
    for proc in procfs.tree(root_pid):
        with contextlib.suppress(psutil.Error, OSError):
            _open_files(proc.pid, found)
            _mapped_files(proc.pid, found)
            _working_directory(proc.pid, found)
    return found


def _note(found: Externals, key: str, path: str, info: os.stat_result) -> None:
    found.paths[key] = path
    found.identities[path] = [info.st_dev, info.st_ino]


def _open_files(pid: int, found: Externals) -> None:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{fd}"
        try:
            path, info = os.readlink(link), os.stat(link)
        except OSError:
            continue  # closed meanwhile
        mnt = _mnt_id(f"/proc/{pid}/fdinfo/{fd}")
        if mnt is not None and _wanted(path, info):
            _note(found, ext_id(mnt, info.st_ino), path, info)


def _mapped_files(pid: int, found: Externals) -> None:
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="surrogateescape") as maps:
        areas = {}
        for line in maps:
            parts = line.rstrip("\n").split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and parts[4] != "0":
                areas[parts[0]] = parts[5]
    for area, path in areas.items():
        try:
            # map_files gives the mapped file itself (root may open it), and its mount.
            fd = os.open(f"/proc/{pid}/map_files/{area}", os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            mnt = _mnt_id(f"/proc/self/fdinfo/{fd}")
        finally:
            os.close(fd)
        if mnt is not None and _wanted(path, info):
            _note(found, ext_id(mnt, info.st_ino), path, info)


def _working_directory(pid: int, found: Externals) -> None:
    """The identity of the process's working directory (its magic link in /proc: the
    directory itself), by the path criu records for it."""
    path = os.readlink(f"/proc/{pid}/cwd")
    if path.startswith("/") and not path.endswith(DELETED):
        info = os.stat(f"/proc/{pid}/cwd")
        found.identities[path] = [info.st_dev, info.st_ino]
