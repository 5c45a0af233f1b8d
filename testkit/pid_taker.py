"""A process started with the host pid a test names, as a full pid wrap would give it to
anyone, made at once with ``clone3``'s ``set_tid`` (root's).

The system's next-pid counter is never turned back for it: on a suite's shared machine, that
hands recently freed pids to other tests' new processes at once, and whatever still holds
one of those pids by number then signals a stranger.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

# Joins the pid and network namespaces of process ``NS_OF`` (``-``: stays in ours), and
# starts PROGRAM there, as UID:GID (``-``: as we are), with the host pid NODE_PID and, in
# that namespace, the pid INNER; its stdio /dev/null. Prints the child's host pid. Exit
# status 3: a pid taken.
SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 7) return 2;
    pid_t tids[2] = {0, atoi(argv[1])};
    int levels = 1;
    if (strcmp(argv[2], "-") != 0) {
        const char *kinds[] = {"net", "pid"};
        for (int i = 0; i < 2; i++) {
            char path[64];
            snprintf(path, sizeof path, "/proc/%s/ns/%s", argv[2], kinds[i]);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0 || setns(fd, 0) < 0) { perror(path); return 1; }
            close(fd);
        }
        tids[0] = atoi(argv[3]);
        levels = 2;
    }
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.exit_signal = SIGCHLD;
    /* set_tid lists the pids from the innermost namespace out. */
    args.set_tid = (uint64_t)(uintptr_t)(tids + 2 - levels);
    args.set_tid_size = levels;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid < 0) { perror("clone3"); return errno == EEXIST ? 3 : 1; }
    if (pid == 0) {
        /* Nothing of ours: whoever waits for our output must not wait for the child. */
        int null = open("/dev/null", O_RDWR);
        for (int fd = 0; fd < 3; fd++) dup2(null, fd);
        if (strcmp(argv[4], "-") != 0) {
            gid_t gid = atoi(argv[5]);
            if (setgroups(1, &gid) || setgid(gid) || setuid(atoi(argv[4]))) _exit(126);
        }
        execv(argv[6], argv + 6);
        _exit(127);
    }
    printf("%ld\n", pid);
    return 0;
}
"""


class PidTaken(Exception):
    """Another process has the pid already."""


@dataclass(frozen=True)
class Namespace:
    """Where to start the process: the namespaces of ``of_pid``, with ``inner_pid`` there;
    the pod's cgroups entered first by ``enter`` (a shell prefix), if any."""

    of_pid: int
    inner_pid: int
    enter: str = ""


def _helper() -> Path:
    """The compiled helper, built once per source on this machine."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"jgs-pid-taker-{digest}"
    if not binary.exists():
        with tempfile.TemporaryDirectory() as work:
            source = Path(work) / "pid-taker.c"
            source.write_text(SOURCE)
            built = Path(work) / "pid-taker"
            subprocess.run(["cc", "-O", "-o", str(built), str(source)], check=True)
            # Renamed into place: workers building at once each see a whole binary.
            built.rename(binary)
    return binary


def take_pid(node_pid: int, argv: list[str], *, namespace: Namespace | None = None,
             user: tuple[int, int] | None = None, timeout: float = 60) -> psutil.Process:
    """Start ``argv`` (an absolute program path first) with the host pid ``node_pid``, as
    ``user`` (uid, gid) if given; its process. Raises ``PidTaken`` if the pid (or the inner
    one) is another process's."""
    ns = ["-", "-"] if namespace is None else [str(namespace.of_pid), str(namespace.inner_pid)]
    ids = ["-", "-"] if user is None else [str(user[0]), str(user[1])]
    command = [str(_helper()), str(node_pid), *ns, *ids, *argv]
    enter = "" if namespace is None else namespace.enter
    done = subprocess.run(["sh", "-c", enter + 'exec "$@"', "pid-taker", *command],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode == 3:
        raise PidTaken(f"pid {node_pid} is another process's: {done.stderr.strip()}")
    if done.returncode != 0:
        raise RuntimeError(f"pid-taker ended {done.returncode}: {done.stderr.strip()}")
    return psutil.Process(int(done.stdout))
