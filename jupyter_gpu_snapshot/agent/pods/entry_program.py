"""Runs one of the node agent's own programs inside a user's container.

Run by the agent, as root, with ``python -I -S entry_program.py SPEC -- COMMAND...``.
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
runs in the user's container, not the agent's.

With ``"launch"`` in SPEC, COMMAND is a kernel to start in the container as the agent's
``unshare --pid --fork nsinit.py`` does outside: the child starts a PID namespace inside
the container's, whose init takes nsinit's root steps in this process, with the agent's
nsinit (its own mount namespace and ``/proc``, the kernel's pid), reads the kernel's
environment from stdin, drops to the user (``"as"``), and only then runs the container's
own Python with the container's nsinit (``"nsinit"``: the interpreter and the script, as
the user's server names them), which starts the kernel: the tree's files must be the
container's, for criu to dump them there. Nothing of the container's image runs as root.

Standard library only: it runs as ``python -I -S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__stdlib_only__ = True  # run as python -I -S: it imports the standard library alone

AGENT_ROOT = "@AGENT_ROOT@"
# A file of the agent's, handed in as a copy in memory: the program a command starts with.
AGENT_COPY = "@AGENT_COPY@"
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
AGENT_NSINIT = Path(__file__).resolve().parents[2] / "launch" / "nsinit.py"
# What the container's nsinit finds in its environment once the init took its root steps:
# the note on the kernel's pid (possibly empty). Equal to nsinit's PREPARED.
PREPARED = "JUPYTER_GPU_SNAPSHOT_NSINIT_PREPARED"


def start_ticks(pid: int) -> int:
    """Process ``pid``'s start time, in clock ticks since boot (/proc/PID/stat field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ")".
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _copy_in_memory(path: str) -> int:
    """A memfd holding the agent's file ``path``, for the child to run.

    Run from a file of the agent's root, criu's restore of a tree of two or more processes
    could not give the restored processes their executables (``PR_SET_MM_MAP``: EBUSY,
    which Linux answers while the old executable is still mapped); run from a copy in
    memory, the loader is no file of any mount, and the restore succeeds."""
    fd = os.memfd_create(os.path.basename(path), 0)
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            os.write(fd, chunk)
    return fd


def _root_holder(root: int) -> int:
    """A child whose root directory is the agent's (``root``, a descriptor), sleeping for
    as long as this process lives; its pid here.

    The program's paths of the agent's name that child's root (``/proc/PID/root``), not
    the descriptor: criu keeps none of the descriptors it was started with open, and the
    CUDA plugin's stand-in, which it runs, must be found by a path."""
    parent = os.getpid()
    ready, done = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # ended before the line above
                os._exit(0)
            os.fchdir(root)
            os.chroot(".")
            os.write(done, b"1")
            os.closerange(0, os.sysconf("SC_OPEN_MAX"))
            while True:
                signal.pause()
        finally:
            os._exit(0)
    os.close(done)
    rooted = os.read(ready, 1)
    os.close(ready)
    if not rooted:
        raise OSError(f"the holder of the agent's root (pid {holder}) ended")
    return holder


def _fail(message: str) -> int:
    sys.stderr.write(f"enter_container: {message}\n")
    return ENTRY_FAILED


def _agent_nsinit() -> ModuleType:
    """The agent's nsinit, loaded while the agent's files are still in view."""
    found = importlib.util.spec_from_file_location("agent_nsinit", AGENT_NSINIT)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _wait_for(child: int) -> int:
    """``child``'s end as an exit status, forwarding the signals that end a process."""
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


def _launch(nsinit: ModuleType, launch: dict[str, Any], command: list[str]) -> int:
    """In the container's pid namespace: a namespace of the kernel's own, whose init
    takes nsinit's root steps, drops to the user and runs the container's nsinit."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        return _fail(f"unshare(CLONE_NEWPID): {os.strerror(ctypes.get_errno())}")
    init = os.fork()
    if init != 0:
        return _wait_for(init)
    try:
        problem = nsinit._own_proc()
        if problem is not None:
            os._exit(_fail(f"no private /proc for the kernel ({problem})"))
        pid_note = nsinit._choose_kernel_pid() or ""
        kernel_env = sys.stdin.read() or "{}"
        nsinit._drop_to(launch["as"])
        # The environment again on stdin, for the container's nsinit, now the user's.
        handed = os.memfd_create("kernel-env")
        os.write(handed, kernel_env.encode())
        os.lseek(handed, 0, os.SEEK_SET)
        os.dup2(handed, 0)
        os.close(handed)
        python, script = launch["nsinit"]
        os.execve(python, [python, "-I", "-S", script, "--log", launch["log"], "--cwd",
                           launch["cwd"], "--env-stdin", "--", *command],
                  {nsinit._PROC_READY: "1", PREPARED: pid_note})
    except BaseException as exc:  # nothing may return into the entry's code
        sys.stderr.write(f"enter_container: cannot start the kernel: {exc}\n")
    os._exit(ENTRY_FAILED)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        return _fail("usage: entry_program.py SPEC -- COMMAND...")
    spec = json.loads(argv[0])
    command = argv[2:]
    pid = int(spec["pid"])
    launch = spec.get("launch")
    nsinit = _agent_nsinit() if launch else None
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
        if start_ticks(pid) != int(spec["start"]):
            return _fail(f"process {pid} is not the container's process any more")
        root = os.open("/", os.O_PATH | os.O_DIRECTORY)
        os.set_inheritable(root, True)
        copies = {arg: _copy_in_memory(arg[len(AGENT_COPY):])
                  for arg in command if arg.startswith(AGENT_COPY)}
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
    child = os.fork()
    if child == 0:
        # The entry is outside the pid namespace: the child cannot watch it by pid.
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if nsinit is not None:
            os.close(root)  # nothing of the agent's files for the user's tree
            os._exit(_launch(nsinit, launch, command))
        holder = _root_holder(root)
        through = f"/proc/{holder}/root"
        command = [f"/proc/self/fd/{copies[arg]}" if arg in copies
                   else arg.replace(AGENT_ROOT, through) for arg in command]
        env = {key: value.replace(AGENT_ROOT, through) for key, value in os.environ.items()}
        # The program is the holder's sibling, not its parent: criu waits for its children
        # before it exits, and the holder lives until this process ends.
        program = os.fork()
        if program == 0:
            try:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                os.execve(command[0], command, env)
            except OSError as exc:
                sys.stderr.write(f"enter_container: cannot run {command[0]}: {exc}\n")
            os._exit(ENTRY_FAILED)
        os._exit(_wait_for(program))
    return _wait_for(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
