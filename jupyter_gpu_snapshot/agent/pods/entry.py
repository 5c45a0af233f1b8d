"""The node agent's way into a user's container, for an agent in the node's namespaces.

An agent run as a DaemonSet (``hostPID``) sees every pod's processes, but a kernel it
launched or restored there would run in the agent's own container: its files, loopback and
cgroup. CRIU must instead run inside the user's container, so that it dumps the kernel in
that container's view and restores it there. ``mount --bind`` cannot carry the agent's
files across mount namespaces, and criu's ``--join-ns`` has no mount namespace, so the
agent runs its own programs there through a descriptor of its root: ``entry_program``
joins the container's cgroups and namespaces, and the agent names its files, its dynamic
loader and its libraries by that descriptor (``ContainerEntry.program``). The container's
image supplies nothing that runs as root.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ...core.errors import SnapshotError
from .entry_program import AGENT_COPY, AGENT_ROOT, start_ticks

ENTER = Path(__file__).with_name("entry_program.py")
_PT_INTERP = 3


def in_agent(path: Path | str) -> str:
    """``path`` of the agent's file system, as a program run in a container names it."""
    return f"{AGENT_ROOT}{os.fspath(path)}"


def elf_interpreter(binary: Path) -> str:
    """The dynamic loader a 64-bit little-endian ELF ``binary`` asks for (PT_INTERP)."""
    with open(binary, "rb") as f:
        header = f.read(64)
        if header[:6] != b"\x7fELF\x02\x01":
            raise SnapshotError(
                "agent", f"{binary} is not a 64-bit little-endian ELF program (a script "
                "that starts one?)", hint="name the program itself (for criu: "
                "c.GPUSnapshot.criu_path), with its libraries where the loader finds them")
        phoff, = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        for index in range(phnum):
            f.seek(phoff + index * phentsize)
            kind, _flags, offset, _vaddr, _paddr, size = struct.unpack("<IIQQQQ", f.read(40))
            if kind == _PT_INTERP:
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode()
    raise SnapshotError("agent", f"{binary} names no dynamic loader (a static program?)")


@functools.lru_cache(maxsize=16)
def library_dirs(binary: Path) -> tuple[str, ...]:
    """The directories the agent's loader takes ``binary``'s libraries from, in order."""
    listed = subprocess.run([elf_interpreter(binary), "--list", str(binary)],
                            capture_output=True, text=True, check=False, timeout=60)
    if listed.returncode != 0:
        raise SnapshotError("agent", f"cannot list the libraries of {binary}: "
                            f"{listed.stderr.strip()[-300:]}")
    dirs: list[str] = []
    for line in listed.stdout.splitlines():
        if "=>" not in line:
            continue
        path = line.split("=>", 1)[1].split("(", 1)[0].strip()
        if path.startswith("/") and os.path.dirname(path) not in dirs:
            dirs.append(os.path.dirname(path))
    return tuple(dirs)


def cgroup_procs(pid: int, mounts_file: str = "/proc/self/mountinfo") -> list[str]:
    """The ``cgroup.procs`` file of process ``pid``'s cgroup in each of the agent's
    mounted hierarchies (cgroup v2, and v1 controllers where the node has them)."""
    points: dict[frozenset[str], str] = {}
    with open(mounts_file) as mounts:
        for line in mounts:
            fields = line.split()
            separator = fields.index("-")
            kind, options = fields[separator + 1], fields[separator + 3]
            # A hierarchy mounted from below its root names cgroups by another root.
            if kind not in ("cgroup", "cgroup2") or fields[3] != "/":
                continue
            key = frozenset() if kind == "cgroup2" else frozenset(options.split(","))
            points.setdefault(key, fields[4])
    found = []
    with open(f"/proc/{pid}/cgroup") as cgroups:
        for line in cgroups:
            _hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
            wanted = frozenset(c for c in controllers.split(",") if c)
            point = next((p for key, p in points.items()
                          if (key == wanted if not wanted else wanted <= key)), None)
            if point is not None:
                found.append(os.path.join(point, path.lstrip("/"), "cgroup.procs"))
    return found


@dataclass(frozen=True)
class ContainerEntry:
    """How the agent runs its programs in the container of process ``pid`` (a pid of the
    agent's namespace), which started at ``start`` (clock ticks since boot)."""

    pid: int
    start: int
    cgroup_procs: tuple[str, ...]

    @classmethod
    def of(cls, pid: int, start: int | None = None) -> ContainerEntry:
        """The way into process ``pid``'s container; with ``start``, only while the process
        at ``pid`` is the one that started then (the caller's, as they connected)."""
        ended = SnapshotError(
            "agent", f"the process that connected (pid {pid}) has ended",
            hint="ask from a process that stays until the answer comes")
        try:
            # The entry program checks the start again, once it holds a pidfd of the pid.
            entry = cls(pid, start_ticks(pid), tuple(cgroup_procs(pid)))
        except (FileNotFoundError, ProcessLookupError):
            raise ended from None
        except (OSError, ValueError) as exc:
            raise SnapshotError("agent", f"cannot read process {pid}'s container: {exc}"
                                ) from None
        if start is not None and entry.start != start:
            raise ended
        return entry

    def prefix(self, launch: dict[str, Any] | None = None) -> list[str]:
        """What a command runs under to run in the container (``entry_program``); with
        ``launch``, a kernel started there as a snapshot-ready tree."""
        spec: dict[str, Any] = {
            "pid": self.pid, "start": self.start, "cgroup_procs": list(self.cgroup_procs)}
        if launch is not None:
            spec["launch"] = launch
        return [sys.executable, "-I", "-S", str(ENTER), json.dumps(spec), "--"]

    @staticmethod
    def program(binary: Path | str) -> list[str]:
        """The agent's ``binary``, run in the container with the agent's own loader (a copy
        in memory, see ``entry_program``) and libraries: the container's image may have
        neither, or others."""
        binary = Path(binary)
        dirs = ":".join(in_agent(d) for d in library_dirs(binary))
        return [f"{AGENT_COPY}{elf_interpreter(binary)}", "--library-path", dirs,
                "--argv0", binary.name, in_agent(binary)]


CLONE_NEWCGROUP = 0x02000000


def join_node_cgroup_namespace() -> bool:
    """Join the cgroup namespace of the node's init (the agent sees it with hostPID), if
    the agent is not in it: a container's own namespace would name other containers'
    cgroups from its own, as ``/../..``. Call before any thread starts (a thread keeps the
    namespace it was created in). Whether it joined."""
    try:
        fd = os.open("/proc/1/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        # An init even root may not look into (a sandbox's): the agent runs beside it,
        # not in a container of the node's runtime.
        return False
    try:
        if os.fstat(fd).st_ino == os.stat("/proc/self/ns/cgroup").st_ino:
            return False
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWCGROUP) != 0:
            raise SnapshotError("agent", "cannot join the node's cgroup namespace: "
                                f"{os.strerror(ctypes.get_errno())}",
                                hint="run the agent privileged, with hostPID")
    finally:
        os.close(fd)
    return True


CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")


async def in_network_of(pid: int, work: Callable[[], _T]) -> _T:
    """``work()`` in a thread of its own that joined process ``pid``'s network namespace
    (a container's loopback is its own). The thread ends with it, and so does its
    namespace: no thread of the agent's pool is ever moved."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def joined() -> _T:
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise SnapshotError("agent", f"cannot enter process {pid}'s network: "
                                    f"{os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        return work()

    with concurrent.futures.ThreadPoolExecutor(1, "container-network") as own:
        return await asyncio.get_running_loop().run_in_executor(own, joined)


__all__ = ["AGENT_ROOT", "ContainerEntry", "cgroup_procs", "elf_interpreter", "in_agent",
           "in_network_of", "join_node_cgroup_namespace", "library_dirs"]
