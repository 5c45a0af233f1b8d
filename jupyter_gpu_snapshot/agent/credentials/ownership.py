"""Whose a process tree is: the checks the node agent makes before it dumps a tree for a
caller, or releases its GPU.

A caller may have dumped only a tree whose every process is theirs and unprivileged:
- every uid (real, effective, saved, filesystem) is the caller's, every gid the caller's
  primary group, and every supplementary group one the caller has;
- no capability in the inheritable, permitted, effective or ambient set;
- the kernel still lets its owner look inside it (``/proc/PID/environ`` owned by the
  caller): a process that changed its credentials (a setuid program, a daemon that
  dropped root) is marked undumpable, since its memory may hold what its owner must not
  read, and a snapshot of it would give its owner exactly that.

When: before the engine's save starts, and again right before ``criu dump``
(``caller_hook.CallerCredentials.before_dump``, the last hook). The tree runs until criu
seizes it, so a process can still exec a setuid program between the second check and the
freeze; no hook runs inside criu, where the tree is frozen. What that leaves:

- criu dumping as the caller (``criu_runs_as.dump_command``'s ``--unprivileged``
  mode) cannot seize such a process: the dump fails;
- criu dumping as root writes its memory into the store, which is root's alone: the
  caller cannot read the image, only ask for a restore, and the restore refuses every
  image with a thread that was not running as the caller, unprivileged
  (``in_images``): a setuid-root program frozen mid-way is refused there;
- not caught: a setuid program that went back to exactly the caller's ids and dropped
  every capability before the freeze (its memory may still hold what it read as root).
  The image records no "undumpable" mark that the restore could check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil

from ...agent_client.protocol import Refused
from ...core import procfs
from . import in_images

_CAPABILITY_SETS = ("CapInh", "CapPrm", "CapEff", "CapAmb")


@dataclass(frozen=True)
class Caller(in_images.Caller):
    """A user at the other end of the agent's socket, as the kernel and the user database
    say; nothing of it comes from the request. The credentials an image must hold are its
    own (``in_images.Caller``); the name is for messages."""

    name: str

    @property
    def id_spec(self) -> str:
        """``UID:GID:G1,G2`` for ``nsinit --as``."""
        return f"{self.uid}:{self.gid}:{','.join(str(g) for g in sorted(self.groups))}"

    @property
    def realm_key(self) -> str:
        """Whose store, logs and kernels the caller's are: a user's, by uid."""
        return str(self.uid)


@dataclass(frozen=True)
class PodCaller(Caller):
    """A caller in a pod, to an agent that serves pods (``--pods``): the pod, as the
    container runtime reports it (``pods/identity``), tells users apart, whatever their uid;
    ``name`` is the pod's ``NAMESPACE/NAME``. ``peer_pid`` is the calling process, through
    which the agent enters the caller's container (``pods/entry``), and ``peer_start`` its
    start (clock ticks since boot) when it connected: the agent uses the pid only while
    the process there started then, never a process that took the pid since."""

    peer_pid: int = field(default=0, compare=False)
    peer_start: int = field(default=0, compare=False)

    @property
    def realm_key(self) -> str:
        return f"pod:{self.name}"


def process_problem(pid: int, caller: Caller) -> str | None:
    """Why process ``pid`` is not the caller's own unprivileged process, or None."""
    try:
        status = procfs.status_fields(pid)
        owner = os.stat(f"/proc/{pid}/environ").st_uid
    except (FileNotFoundError, ProcessLookupError):
        return f"process {pid} has ended"
    uids = {int(u) for u in status.get("Uid", "").split()}
    gids = {int(g) for g in status.get("Gid", "").split()}
    groups = {int(g) for g in status.get("Groups", "").split()}
    name = status.get("Name", "?")
    if uids != {caller.uid}:
        return f"process {pid} ({name}) runs as uid {sorted(uids)}, not as you ({caller.uid})"
    if gids != {caller.gid}:
        return f"process {pid} ({name}) runs with gid {sorted(gids)}, not yours ({caller.gid})"
    if not groups <= caller.groups | {caller.gid}:
        return f"process {pid} ({name}) holds groups {sorted(groups - caller.groups)} you lack"
    for key in _CAPABILITY_SETS:
        if int(status.get(key, "0"), 16):
            return f"process {pid} ({name}) holds capabilities ({key} {status[key]})"
    if owner != caller.uid:
        return (f"process {pid} ({name}) is marked undumpable by the kernel (it changed its "
                "credentials, as a setuid program does, or asked to be)")
    return None


def require_own_tree(root_pid: int, caller: Caller, step: str = "save") -> None:
    """Refuse ``step`` unless every process of the tree under ``root_pid`` is the caller's
    own."""
    try:
        pids = [p.pid for p in procfs.tree(root_pid)]
    except psutil.NoSuchProcess as exc:
        raise Refused(step, f"process {root_pid} has ended") from exc
    for pid in pids:
        problem = process_problem(pid, caller)
        if problem is not None:
            raise Refused(
                step, problem,
                hint="the node agent saves, and releases the GPU of, only kernels whose "
                "every process is your own and unprivileged",
            )
