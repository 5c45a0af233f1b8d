"""The init of a snapshot-ready kernel's PID namespace.

Run as ``unshare --pid --fork python -I -S nsinit.py --log FILE -- KERNEL-ARGV...``. It
becomes PID 1 of a fresh PID namespace, so CRIU can dump the whole tree and restore it into
a new namespace where its PIDs can never clash with the host's. It:

- starts its own session inside the namespace (CRIU refuses a session leader outside it);
- points stdin at /dev/null and stdout/stderr at an append-only log file, because pipes to
  the launching server do not survive a restore, and CRIU skips the size check only for
  files opened write-only with O_APPEND;
- forwards interrupt/terminate signals to the kernel (PID 1 ignores signals it does not
  handle), reaps orphans, and exits with the kernel's status.

Only the standard library is imported: this process is part of every snapshot.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

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


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--log" or argv[2] != "--":
        sys.stderr.write("usage: nsinit.py --log FILE -- COMMAND...\n")
        return 2
    log_path, command = argv[1], argv[3:]
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    _redirect_stdio(log_path)
    # No descriptor of the launcher may leak into the dumped tree.
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)

    kernel_pid = os.fork()
    if kernel_pid == 0:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
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
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
