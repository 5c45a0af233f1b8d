"""The init of a snapshot-ready kernel's PID namespace.

Run as ``unshare --pid --fork python -I -S nsinit.py --log FILE [--as UID:GID:GROUPS]
[--cwd DIR] [--env-stdin] -- KERNEL-ARGV...``. It becomes PID 1 of a fresh PID namespace,
so CRIU can dump the whole tree and restore it into a new namespace where its PIDs can
never clash with the host's. It:

- starts its own session inside the namespace (CRIU refuses a session leader outside it);
- gives the namespace its own mount namespace with a fresh /proc: with the host's /proc,
  /proc/self/task/<tid> names host thread ids while gettid() returns namespace ones, and
  libcuda fails its initialisation on that mismatch (cuInit: CUDA_ERROR_OPERATING_SYSTEM);
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
