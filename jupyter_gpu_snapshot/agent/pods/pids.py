"""The agent's pids (the node's) and a user's container's, each way: a caller in a pod
names processes by their pids there, in requests and answers, and so does the criu the
agent runs in their container (``CriuLaunch.pids``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable

import psutil

from ...agent_client.protocol import Refused
from ...core.errors import SnapshotError
from ...core.procfs import ns_pids

NS_GET_PARENT = 0xB702  # ioctl_ns(2): _IO(0xb7, 0x2)


def pid_namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def parent_pid_namespace(pid: int) -> int | None:
    """The pid namespace above process ``pid``'s own (None at the top)."""
    fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
        except OSError:  # EPERM at the agent's own namespace's top
            return None
        try:
            return os.fstat(parent).st_ino
        finally:
            os.close(parent)
    finally:
        os.close(fd)


def pid_seen_by(pid: int, viewer: int) -> int | None:
    """The pid process ``pid`` has in process ``viewer``'s pid namespace, where it is a
    process of that namespace or of one below it; else None."""
    with contextlib.suppress(OSError, ValueError):
        level = len(ns_pids(viewer)) - 1
        chain = ns_pids(pid)
        if len(chain) > level and _under(pid, len(chain) - 1 - level, pid_namespace(viewer)):
            return chain[level]
    return None


def _under(pid: int, levels_below: int, namespace: int) -> bool:
    """Whether the pid namespace ``levels_below`` above ``pid``'s own is ``namespace``."""
    if levels_below == 0:
        return pid_namespace(pid) == namespace
    if levels_below == 1:
        return parent_pid_namespace(pid) == namespace
    return False  # deeper than a kernel's tree ever is


def agent_pid(seen: int, viewer: int, candidates: Iterable[int]) -> int | None:
    """Which of ``candidates`` (the agent's pids) process ``viewer`` calls ``seen``."""
    for pid in candidates:
        if pid_seen_by(pid, viewer) == seen:
            return pid
    return None


def agent_task(seen: int, viewer: int) -> int | None:
    """The agent's pid of the process or thread that process ``viewer``'s pid namespace
    calls ``seen`` (a task of that namespace or of one below it); None if there is none."""
    with contextlib.suppress(OSError, ValueError):
        level = len(ns_pids(viewer)) - 1
        namespace = pid_namespace(viewer)
        for pid in psutil.pids():
            with contextlib.suppress(OSError, ValueError):
                chain = ns_pids(pid)
                if (len(chain) <= level
                        or not _under(pid, len(chain) - 1 - level, namespace)):
                    continue
                if chain[level] == seen:
                    return pid
                for task in os.listdir(f"/proc/{pid}/task"):
                    if int(task) != pid and ns_pids(int(task))[level] == seen:
                        return int(task)
    return None


def tree_pids(roots: Iterable[int]) -> list[int]:
    """The processes of the trees under ``roots``, roots first."""
    found: list[int] = []
    for root in roots:
        with contextlib.suppress(psutil.Error):
            found += [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    return found


def seen_in_container(peer_pid: int, pid: int) -> int:
    """Process ``pid`` of the agent's by its pid in process ``peer_pid``'s container;
    refused if it is not there."""
    seen = pid_seen_by(pid, peer_pid)
    if seen is None:
        raise Refused("save", f"process {pid} is not in your container")
    return seen


def agent_task_of(peer_pid: int, seen: int) -> int:
    """Our pid of what criu, in process ``peer_pid``'s container, calls ``seen``."""
    found = agent_task(seen, peer_pid)
    if found is None:
        raise SnapshotError("restore", f"process {seen} of your container is not found")
    return found


__all__ = ["agent_pid", "agent_task", "agent_task_of", "ns_pids", "pid_namespace",
           "pid_seen_by", "seen_in_container", "tree_pids"]
