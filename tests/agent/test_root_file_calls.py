"""The node agent's privilege rule, for the whole class of its failures: while it saves,
restores, hibernates (both tiers) and wakes a real user's kernel, no process acting with
root's file rights resolves a path the user can change.

The agent (with a CUDA hook over the scripted driver, ``testkit/fake_cuda_agent.py``) and
every process it starts, criu and its helpers included, are watched from the kernel
(``testkit/root_file_calls.py``): each path-based call (open, stat, exec, chdir, mkdir,
connect to a socket's path...) made while the caller's fsuid is 0 or it holds
``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH`` or ``CAP_FOWNER``. Alice's kernel runs in her
home, holds CUDA state for the scripted driver, and is saved (its connection file read,
as the CLI sends none), released and woken in the gpu tier, saved with a stop (the process
tier) and restored; every call on a path under her home, /tmp, /var/tmp, /dev/shm, the
kernel's working directory or her log directory fails the test, but two of criu's own,
declared below with the reason each is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.fake_driver import GIB, RESTORE_THREAD_CODE, fake_cuda_env
from testkit.root_file_calls import FileCall, RootFileCalls, UserDirs, offence
from testkit.unix_users import REPO, UnixUser

from .conftest import (
    AGENT_START_SECONDS,
    ask_kernel,
    cli,
    kill_users_kernels,
    save_and_stop,
    start_user_kernel,
)
from .test_gpu_tier import UserServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent and the tracer are root")

# criu's own scratch directories of a restore, named by criu itself (mount.c, mount-v2.c,
# cr-restore.c): each made anew (mkdtemp) in /tmp, then, in criu's private mount
# namespace, covered by a tmpfs of its own (the "yard") or used only as a mountpoint
# there, so that nothing a user puts into the directory in /tmp is seen by criu; and the
# pivot of the restored root through the yard ("." and "tmp" relative to it), in that
# namespace, which no user's process shares while criu builds it.
CRIU_SCRATCH = re.compile(
    r"^/tmp/(\.criu\.mntns|\.criu\.move_mount_set_group|crtools-proc|cr-tmpfs)\.\w{6}(/|$)"
    r"|^crtools-put-root\.\w{6}$")
CRIU_PIVOT = {("pivot_root", "."), ("pivot_root", "tmp"), ("umount2", "tmp"),
              ("newfstatat", "tmp")}


@dataclass
class TracedAgent:
    """A node agent, and the tracer of it and everything it starts."""

    process: subprocess.Popen[bytes]
    socket: Path
    run_dir: Path
    log_path: Path
    calls: RootFileCalls

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_dir(self, user: UnixUser) -> Path:
        return self.run_dir / "users" / str(user.uid) / "logs"


@pytest.fixture(scope="module")
def traced_agent(unix_users: tuple[UnixUser, UnixUser],
                 user_paths: dict[Path, int]) -> Iterator[TracedAgent]:
    # Root's alone and out of every directory the users may write, as /var/lib and /run
    # are on a node: only the agent's own files are there.
    base = Path(tempfile.mkdtemp(prefix="jgs-traced-", dir="/run"))
    os.chmod(base, 0o711)  # the users reach the socket and their log directories
    calls = RootFileCalls(base)
    socket, log_path = base / "agent.sock", base / "agent.log"
    with open(log_path, "ab") as log:
        process = calls.start(
            [sys.executable, "-m", "testkit.fake_cuda_agent", "--socket", str(socket),
             "--state-dir", str(base / "state"), "--run-dir", str(base / "run")],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    agent = TracedAgent(process, socket, base / "run", log_path, calls)
    try:
        deadline = time.monotonic() + AGENT_START_SECONDS
        while not socket.is_socket():
            assert process.poll() is None and time.monotonic() < deadline, agent.log()
            time.sleep(0.1)
        yield agent
    finally:
        kill_users_kernels(unix_users)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(AssertionError):
            calls.stop()
        if not os.environ.get("JGS_KEEP"):
            shutil.rmtree(base, ignore_errors=True)


def declared(call: FileCall, working_directories: set[str]) -> bool:
    """Whether ``call`` is one of criu's own, each safe: its scratch directories and the
    pivot of the restored root (``CRIU_SCRATCH``, ``CRIU_PIVOT``); and its lookup of a
    kernel's working directory by path, which criu makes at the dump (a stat, to record
    it) and at the restore (inside the restored mount namespace, where no descriptor
    from outside could serve), and which the restore checks before the tree runs
    (``UserPath.WORKING_DIRECTORY``)."""
    if call.comm != "criu":
        return False
    if CRIU_SCRATCH.match(call.path) or (call.syscall, call.path) in CRIU_PIVOT:
        return True
    looked_up = "/" + call.path.removeprefix("./").lstrip("/")
    return call.syscall in ("openat", "newfstatat") and looked_up in working_directories


def test_no_path_of_the_users_is_resolved_with_roots_rights(
        traced_agent: TracedAgent, unix_users: tuple[UnixUser, UnixUser]) -> None:
    alice, _ = unix_users
    kernel = start_user_kernel(alice, traced_agent, env=fake_cuda_env(GIB))
    assert ask_kernel(alice, traced_agent, kernel.connection_file,
                      f"exec({RESTORE_THREAD_CODE!r}) or 'started'") == "started"
    # The CLI sends no connection: the agent reads the kernel's connection file itself.
    cli(alice, traced_agent, "save", "--pid", str(kernel.root_pid), "--name", "kept")
    server = UserServer(alice, traced_agent)
    try:
        released = server.call("release", kernel.root_pid, {"kernel_id": kernel.kernel_id})
        assert released["gpu_memory"], released
        server.call("wake", kernel.root_pid)
    finally:
        server.close()
    stopped = save_and_stop(alice, traced_agent, kernel)
    restored = json.loads(cli(alice, traced_agent, "restore", stopped["id"],
                              "--json").stdout)
    assert ask_kernel(alice, traced_agent, restored["connection_file"], "x") == "41"

    calls = traced_agent.calls.stop()
    # The tracer saw criu and the agent's reads of the kernel's files: the test can fail.
    assert any(c.comm == "criu" for c in calls), "criu was not seen"
    working_directories = {str(alice.home)}
    user = UserDirs(alice.uid, frozenset(os.getgrouplist(alice.name, alice.gid)), (
        str(alice.home), "/tmp", "/var/tmp", "/dev/shm", str(traced_agent.log_dir(alice)),
        *working_directories))
    found = [why for call in calls
             if (why := offence(call, user)) is not None
             and not declared(call, working_directories)]
    assert found == [], (f"{len(found)} calls with root's file rights on paths "
                         f"{alice.name} can change:\n" + "\n".join(found[:60]))
