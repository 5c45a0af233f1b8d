"""The init of a snapshot-ready kernel's PID namespace.

Run as ``unshare --pid --fork python -I -S nsinit.py --log FILE [--as UID:GID:GROUPS]
[--cwd DIR] [--env-stdin] -- KERNEL-ARGV...``. It becomes PID 1 of a fresh PID namespace,
so CRIU can dump the whole tree and restore it into a new namespace where its PIDs can
never clash with the host's. It:

- starts its own session inside the namespace (CRIU refuses a session leader outside it);
- gives the namespace its own mount namespace with a fresh /proc: with the host's /proc,
  /proc/self/task/<tid> names host thread ids while gettid() returns namespace ones, and
  libcuda fails its initialisation on that mismatch (cuInit: CUDA_ERROR_OPERATING_SYSTEM);
- starts the kernel at a pid of the namespace drawn from ``KERNEL_PIDS``, above every pid
  that a restored process's CUDA socket claims for this namespace (``kernel_pid``):
  libcuda names a socket after the namespace's number and the pid, a restored process
  keeps the name its original had, and Linux gives namespace numbers out again (see
  docs/gpu.md, "Kernels in their own PID namespace");
- with ``--as`` (the node agent launching for an unprivileged user), drops to that user's
  uid, gid and groups once the namespace is set up, before it opens the log or changes to
  ``--cwd``: the user's own permissions decide what it may open, and every process of the
  tree is the user's. ``--env-stdin`` reads the kernel's environment (JSON) from stdin:
  the launcher itself runs with a clean one, since the user's could make root load a
  library of theirs (LD_PRELOAD);
- points stdin at /dev/null and stdout/stderr at an append-only log file, because pipes to
  the launching server do not survive a restore, and CRIU skips the size check only for
  files opened write-only with O_APPEND;
- forwards interrupt/terminate signals to the kernel (PID 1 ignores signals it does not
  handle), reaps orphans, and exits with the kernel's status;
- writes how the kernel ended into the log (``DEATH_PREFIX``): a restored kernel is no
  child of the server, so this line is the only record of what killed it.

Only the standard library is imported: this process is part of every snapshot.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__stdlib_only__ = True  # run as python -I -S: it imports the standard library alone

# The last line of a kernel's log when it ended: "nsinit: kernel ended: killed by signal 11
# (SIGSEGV)" or "... exited with status 1". Equal to _constants.KERNEL_DEATH_PREFIX, which
# this process cannot import (it runs with the standard library alone).
DEATH_PREFIX = "nsinit: kernel ended: "

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


def _redirect_stdio(log_path: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (devnull, log):
        if fd > 2:
            os.close(fd)


_PROC_READY = "JUPYTER_GPU_SNAPSHOT_NSINIT_PROC"
# Set by the node agent's entry into a user's container (agent/pods/entry_program.py), whose
# init took the root steps (the namespace's /proc, the kernel's pid) before it ran this
# script as the user: the note on the kernel's pid, possibly empty.
PREPARED = "JUPYTER_GPU_SNAPSHOT_NSINIT_PREPARED"
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000


def _own_proc() -> str | None:
    """Enter a private mount namespace and mount this PID namespace's /proc; None if done."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    # Private, so that the new /proc never propagates back to the host's mounts.
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"making / private: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        return f"mounting /proc: {os.strerror(ctypes.get_errno())}"
    return None


# At cuInit, libcuda (driver 580) binds a listening abstract Unix socket named after the
# process's PID namespace, by its inode number, and its pid there: "\0cuda-uvmfd-I-P\0",
# which /proc/net/unix lists as "@cuda-uvmfd-I-P@". If the name is taken, cuInit fails with
# CUDA_ERROR_OPERATING_SYSTEM. CRIU binds the name again in a restored process, whose
# namespace has another number by then, and Linux gives the old number to a namespace
# created later: that namespace's process of the same pid cannot initialise CUDA.
CUDA_SOCKET_PREFIX = "@cuda-uvmfd-"
# The range the kernel's pid is drawn from, so that a kernel whose namespace gets the number
# of a saved kernel's is unlikely to get its pid too (had every kernel the same pid, each
# one would). Well below 32768, the smallest pid_max, so that a restore on any machine can
# recreate the pids of the kernel and its threads.
KERNEL_PIDS = (1000, 24576)


def claimed_pids(namespace_inode: int, unix_table: str) -> set[int]:
    """The pids that live CUDA sockets claim for the PID namespace ``namespace_inode``,
    read from ``unix_table`` (the text of /proc/net/unix)."""
    prefix = f"{CUDA_SOCKET_PREFIX}{namespace_inode}-"
    claimed = set()
    for line in unix_table.splitlines()[1:]:
        fields = line.split()
        name = fields[7] if len(fields) > 7 else ""
        if name.startswith(prefix) and name.endswith("@") and name[len(prefix):-1].isdigit():
            claimed.add(int(name[len(prefix):-1]))
    return claimed


def kernel_pid(claimed: set[int], draw: int) -> int:
    """The kernel's pid in its namespace: from ``KERNEL_PIDS`` by ``draw``, or above every
    claimed pid at or over it (the kernel's threads and children take the pids after it)."""
    low, high = KERNEL_PIDS
    pid = low + draw % (high - low)
    return max(claimed) + 1 if claimed and max(claimed) >= pid else pid


def _start_pids_at(pid: int) -> str | None:
    """Make ``pid`` the next pid of this namespace; what went wrong, or None."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
    except OSError as exc:
        return f"cannot set the namespace's next pid ({exc.strerror})"
    return None


def _choose_kernel_pid() -> str | None:
    """Pick and set the kernel's pid (with root's rights, before any ``--as``); a line
    for the log when there is something to say."""
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/net/unix") as f:
            claimed = claimed_pids(inode, f.read())
    except OSError:
        inode, claimed = 0, set()
    pid = kernel_pid(claimed, int.from_bytes(os.urandom(4), "little"))
    problem = _start_pids_at(pid)
    if problem is not None:
        return (f"{problem}; the kernel is pid 2, where CUDA fails if a restored process "
                "claims that pid for this namespace")
    if claimed:
        return (f"pids {sorted(claimed)} of PID namespace {inode} are claimed by a restored "
                f"CUDA process; the kernel is pid {pid}")
    return None


USAGE = ("usage: nsinit.py --log FILE [--as UID:GID:GROUPS] [--cwd DIR] [--env-stdin] "
         "-- COMMAND...\n")
PR_SET_DUMPABLE = 4


def _parse(argv: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """The options before ``--`` and the command after it; None when malformed."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0] != "--":
        if rest[0] == "--env-stdin":
            options[rest[0]] = ""
            rest = rest[1:]
            continue
        if len(rest) < 2 or rest[0] not in ("--log", "--as", "--cwd"):
            return None
        options[rest[0]] = rest[1]
        rest = rest[2:]
    if not rest or "--log" not in options or len(rest) < 2:
        return None
    return options, rest[1:]


def _drop_to(user: str) -> None:
    """Become ``UID:GID:G1,G2`` for good (real, effective and saved ids)."""
    uid_text, gid_text, groups_text = user.split(":")
    groups = [int(g) for g in groups_text.split(",") if g]
    os.setgroups(groups)
    os.setresgid(int(gid_text), int(gid_text), int(gid_text))
    os.setresuid(int(uid_text), int(uid_text), int(uid_text))
    # Changing ids made this process undumpable, which would hide its /proc files from
    # the user who owns it; it holds nothing privileged any more.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def main(argv: list[str]) -> int:
    parsed = _parse(argv)
    if parsed is None:
        sys.stderr.write(USAGE)
        return 2
    options, command = parsed
    log_path = options["--log"]
    problem = None
    if os.environ.pop(_PROC_READY, None) is None:
        problem = _own_proc()
        if problem is None:
            # Exec ourselves again: what was mapped before the unshare (python, its
            # libraries) refers to the host's mounts, which CRIU cannot resolve inside.
            os.environ[_PROC_READY] = "1"
            os.execv(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__), *argv])
    prepared = os.environ.pop(PREPARED, None)
    pid_note = _choose_kernel_pid() if prepared is None else (prepared or None)
    kernel_env = None
    if "--env-stdin" in options:
        import json

        kernel_env = {str(k): str(v) for k, v in json.loads(sys.stdin.read() or "{}").items()}
    if "--as" in options:
        _drop_to(options["--as"])
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    _redirect_stdio(log_path)
    if "--cwd" in options:
        os.chdir(options["--cwd"])
    if problem is not None:
        # CPU kernels still work; CUDA will not initialise in this namespace.
        sys.stderr.write(f"nsinit: no private /proc ({problem}); CUDA will not work here\n")
    if pid_note is not None:
        sys.stderr.write(f"nsinit: {pid_note}\n")
    # No descriptor of the launcher may leak into the dumped tree.
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)

    kernel_pid = os.fork()
    if kernel_pid == 0:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        try:
            if kernel_env is None:
                os.execvp(command[0], command)
            else:
                os.execvpe(command[0], command, kernel_env)
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(kernel_pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)

    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid == kernel_pid:
            # Exiting as PID 1 takes every remaining process of the namespace with us.
            code = os.waitstatus_to_exitcode(status)
            sys.stderr.write(f"{DEATH_PREFIX}{describe_end(code)}\n")
            sys.stderr.flush()
            return code if code >= 0 else 128 - code


def describe_end(code: int) -> str:
    """``os.waitstatus_to_exitcode``'s value in words: 'killed by signal 11 (SIGSEGV)'."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    return f"killed by signal {-code} ({name})"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
