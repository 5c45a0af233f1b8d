"""Runs one of the node agent's own programs inside a user's container.

Run by the agent, as root, with ``python -I -S enter_container.py SPEC -- COMMAND...``.
SPEC (JSON) names a process of the container by its pid in the agent's pid namespace and
its start time (``"pid"``, ``"start"``: the clock ticks of /proc/PID/stat), and the
``cgroup.procs`` files of the container's cgroups as the agent sees them
(``"cgroup_procs"``). The entry:

- opens a descriptor of the agent's root directory, which stays open across the steps
  below: once inside the container's mount namespace it is the only way back to the
  agent's files;
- joins the container's cgroups, then, through a pidfd of that process (so that a pid
  given out again cannot stand for it), its cgroup, ipc, uts, network, pid and mount
  namespaces at once;
- forks, since a pid namespace is entered by one's children only, and runs COMMAND in the
  child with ``AGENT_ROOT`` in its arguments and environment replaced by the path of that
  descriptor (``/proc/self/fd/N``). The child dies with the entry, and the entry forwards
  the signals that end it and ends as the child did.

So the agent runs its criu with its own loader and libraries, read from its root, while
criu works in the container's view of processes, files and mounts: a kernel restored there
runs in the user's container, not the agent's. Nothing of the container's image runs as
root. Standard library only: it runs as ``python -I -S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys

AGENT_ROOT = "@AGENT_ROOT@"
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
# Reported as a failure of the entry itself, not of the command: 128 + n is a signal.
ENTRY_FAILED = 125
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def start_ticks(pid: int) -> int:
    """Process ``pid``'s start time, in clock ticks since boot (/proc/PID/stat field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ")".
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _fail(message: str) -> int:
    sys.stderr.write(f"enter_container: {message}\n")
    return ENTRY_FAILED


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        return _fail("usage: enter_container.py SPEC -- COMMAND...")
    spec = json.loads(argv[0])
    command = argv[2:]
    pid = int(spec["pid"])
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
        if start_ticks(pid) != int(spec["start"]):
            return _fail(f"process {pid} is not the container's process any more")
        root = os.open("/", os.O_PATH | os.O_DIRECTORY)
        os.set_inheritable(root, True)
        for procs in spec.get("cgroup_procs", []):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    except OSError as exc:
        return _fail(f"cannot reach process {pid}'s container: {exc}")
    flags = (CLONE_NEWCGROUP | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWPID
             | CLONE_NEWNS)
    if libc.setns(pidfd, flags) != 0:
        return _fail(f"cannot enter process {pid}'s namespaces: "
                     f"{os.strerror(ctypes.get_errno())}")
    os.close(pidfd)
    through = f"/proc/self/fd/{root}"
    command = [arg.replace(AGENT_ROOT, through) for arg in command]
    env = {key: value.replace(AGENT_ROOT, through) for key, value in os.environ.items()}
    child = os.fork()
    if child == 0:
        try:
            # The entry is outside the pid namespace: the child cannot watch it by pid.
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.execve(command[0], command, env)
        except OSError as exc:
            sys.stderr.write(f"enter_container: cannot run {command[0]}: {exc}\n")
        finally:
            os._exit(ENTRY_FAILED)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        code = os.waitstatus_to_exitcode(status)
        return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
