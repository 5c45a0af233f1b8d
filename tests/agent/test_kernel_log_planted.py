"""What a user may put at their kernel's log before a restore through the node agent.

The log's directory is the user's, and root opens the log there before criu runs: a FIFO,
a Unix socket, a device or a link in its place must never hold root (a FIFO's open waits
for a writer without end) nor be handed to the restored kernel. Each is refused at once,
with a message naming it; the agent serves both users all along and still stops on
SIGTERM; the snapshot stays listed and restores once the log is put right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_gpu_snapshot.core import procfs
from testkit.unix_users import UnixUser

from .conftest import CLI, Agent, as_user, ask_kernel, cli, save_and_stop, start_user_kernel

# A refusal comes in seconds; a restore held by what is at the log never comes, and the
# client gives up after this long (generous: a busy machine's restore takes seconds too).
REFUSAL_SECONDS = 120.0
STOP_SECONDS = 60.0

BIND_SOCKET = "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])"


def _fifo(user: UnixUser, agent: Agent, log: Path) -> None:
    as_user(user, agent, ["mkfifo", str(log)])


def _socket(user: UnixUser, agent: Agent, log: Path) -> None:
    # The socket's file outlives the process that bound it.
    as_user(user, agent, [sys.executable, "-c", BIND_SOCKET, str(log)])


def _device(user: UnixUser, agent: Agent, log: Path) -> None:
    # A user cannot mknod; root makes one of theirs (/dev/null's numbers), as a device they
    # got there some other way would be: theirs, linked once, so only its type refuses it.
    subprocess.run(["mknod", "-m", "600", str(log), "c", "1", "3"], check=True)
    os.chown(log, user.uid, user.gid)


def _link_to_a_device(user: UnixUser, agent: Agent, log: Path) -> None:
    as_user(user, agent, ["ln", "-s", "/dev/zero", str(log)])


PLANTED: dict[str, tuple[Callable[[UnixUser, Agent, Path], None], str]] = {
    "fifo": (_fifo, "is a FIFO (named pipe), not a regular file"),
    "socket": (_socket, "is a Unix socket, not a regular file"),
    "device": (_device, "is a character device, not a regular file"),
    "link to /dev/zero": (_link_to_a_device, "is a link: it is never followed"),
}


def _listed_ids(user: UnixUser, agent: Agent) -> list[str]:
    return [s["id"] for s in json.loads(cli(user, agent, "list", "--json").stdout)]


def test_a_log_that_is_no_regular_file_is_refused_at_once(start_agent, unix_users):
    alice, bob = unix_users
    # One operation at a time per user: a restore still held would refuse the next one.
    agent = start_agent("planted-logs", "--max-operations", "1")
    kernel = start_user_kernel(alice, agent)
    saved = save_and_stop(alice, agent, kernel)
    bobs = _listed_ids(bob, agent)
    log = Path(kernel.log)

    for what, (plant, said) in PLANTED.items():
        as_user(alice, agent, ["rm", "-f", str(log)])
        plant(alice, agent, log)
        started = time.monotonic()
        refused = as_user(alice, agent, [*CLI, "restore", saved["id"]], check=False,
                          timeout=REFUSAL_SECONDS)
        took = time.monotonic() - started
        assert refused.returncode == 2, (what, refused.stdout, refused.stderr,
                                         agent.log()[-3000:])
        assert f"preflight failed: the kernel log {log} {said}" in refused.stderr, (
            what, refused.stderr)
        assert "restore again" in refused.stderr, (what, refused.stderr)
        # The agent serves both users on; nothing of the snapshot was lost.
        assert _listed_ids(alice, agent) == [saved["id"]], what
        assert _listed_ids(bob, agent) == bobs, what
        print(f"{what}: refused in {took:.1f} s")

    # Put right, the same snapshot restores, and the restored kernel writes to the log.
    as_user(alice, agent, ["rm", "-f", str(log)])
    restored = json.loads(cli(alice, agent, "restore", saved["id"], "--json").stdout)
    assert ask_kernel(alice, agent, restored["connection_file"], "x") == "41"
    assert log.is_file() and not log.is_symlink() and log.stat().st_uid == alice.uid
    procfs.kill_tree(restored["pid"])

    agent.process.terminate()
    assert agent.process.wait(timeout=STOP_SECONDS) == 0, agent.log()[-3000:]
