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

The steps and the verdict are one function of a ``Caller``
(``no_path_of_the_callers_is_resolved_with_roots_rights``): here a user of this host, and in
``tests/pods/test_pod_root_file_calls.py`` a user in a pod of the node's agent, the pod's
volumes counted among what they can change.
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
from typing import Protocol

import pytest

from testkit.fake_driver import GIB, RESTORE_THREAD_CODE, fake_cuda_env
from testkit.root_file_calls import FileCall, RootFileCalls, UserDirs, offence
from testkit.unix_users import REPO, UnixUser

from .conftest import (
    AGENT_START_SECONDS,
    UserKernel,
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
    (``UserPath.WORKING_DIRECTORY``). In a pod the agent runs criu by its own loader, a
    copy in memory run as ``/proc/self/fd/N``: the kernel names that task ``N``."""
    if call.comm != "criu" and not call.comm.isdigit():
        return False
    if CRIU_SCRATCH.match(call.path) or (call.syscall, call.path) in CRIU_PIVOT:
        return True
    looked_up = "/" + call.path.removeprefix("./").lstrip("/")
    return call.syscall in ("openat", "newfstatat") and looked_up in working_directories


class Caller(Protocol):
    """A user whose kernel the class runs through a traced agent: one of this host's
    (``HostCaller``), or of a pod the node's agent serves (``tests/pods``). It holds its
    kernel between the steps."""

    def start_kernel(self) -> None:
        """A kernel of theirs, started through the agent, with ``x = 41`` in it."""

    def save(self) -> None:
        """A save that keeps the kernel running, sending no connection: the agent reads
        the kernel's connection file itself."""

    def release_and_wake_gpu(self) -> None:
        """The gpu tier of a hibernation, where the agent has one for the caller."""

    def save_and_stop(self) -> str:
        """A save that stops the kernel (the process tier of a hibernation); its id, once
        the kernel's tree has ended."""

    def restore_and_ask(self, snapshot_id: str, expression: str) -> str:
        """The snapshot restored through the agent (the wake), and what the restored
        kernel says ``expression`` is."""

    def changeable(self) -> UserDirs:
        """Every directory the caller can change, once the steps are done."""

    def working_directories(self) -> set[str]:
        """The kernel's working directories, as criu names them."""


def no_path_of_the_callers_is_resolved_with_roots_rights(
        caller: Caller, calls: RootFileCalls) -> None:
    """The class: save, the gpu tier's release and wake, a stopping save and a restore of
    ``caller``'s kernel, each through the agent ``calls`` watches; then not one call with
    root's file rights on a path the caller can change, but criu's declared ones."""
    caller.start_kernel()
    caller.save()
    caller.release_and_wake_gpu()
    stopped = caller.save_and_stop()
    assert caller.restore_and_ask(stopped, "x") == "41"

    recorded = calls.stop()
    # The tracer saw criu and the agent's reads of the kernel's files: the test can fail.
    assert any(c.comm == "criu" for c in recorded), "criu was not seen"
    user = caller.changeable()
    working_directories = caller.working_directories()
    found = [why for call in recorded
             if (why := offence(call, user)) is not None
             and not declared(call, working_directories)]
    assert found == [], (f"{len(found)} calls with root's file rights on paths the caller "
                         "can change:\n" + "\n".join(found[:60]))


@dataclass
class HostCaller:
    """Alice, a user of this host, her kernel holding CUDA state for the scripted driver."""

    user: UnixUser
    agent: TracedAgent
    kernel: UserKernel | None = None

    def _kernel(self) -> UserKernel:
        assert self.kernel is not None, "no kernel started"
        return self.kernel

    def start_kernel(self) -> None:
        self.kernel = start_user_kernel(self.user, self.agent, env=fake_cuda_env(GIB))
        assert ask_kernel(self.user, self.agent, self.kernel.connection_file,
                          f"exec({RESTORE_THREAD_CODE!r}) or 'started'") == "started"

    def save(self) -> None:
        # The CLI sends no connection: the agent reads the kernel's connection file itself.
        cli(self.user, self.agent, "save", "--pid", str(self._kernel().root_pid),
            "--name", "kept")

    def release_and_wake_gpu(self) -> None:
        kernel = self._kernel()
        server = UserServer(self.user, self.agent)
        try:
            released = server.call("release", kernel.root_pid, {"kernel_id": kernel.kernel_id})
            assert released["gpu_memory"], released
            server.call("wake", kernel.root_pid)
        finally:
            server.close()

    def save_and_stop(self) -> str:
        stopped: str = save_and_stop(self.user, self.agent, self._kernel())["id"]
        return stopped

    def restore_and_ask(self, snapshot_id: str, expression: str) -> str:
        restored = json.loads(cli(self.user, self.agent, "restore", snapshot_id,
                                  "--json").stdout)
        return ask_kernel(self.user, self.agent, restored["connection_file"], expression)

    def changeable(self) -> UserDirs:
        user = self.user
        return UserDirs(user.uid, frozenset(os.getgrouplist(user.name, user.gid)), (
            str(user.home), "/tmp", "/var/tmp", "/dev/shm", str(self.agent.log_dir(user)),
            *self.working_directories()))

    def working_directories(self) -> set[str]:
        return {str(self.user.home)}


def test_no_path_of_the_users_is_resolved_with_roots_rights(
        traced_agent: TracedAgent, unix_users: tuple[UnixUser, UnixUser]) -> None:
    no_path_of_the_callers_is_resolved_with_roots_rights(
        HostCaller(unix_users[0], traced_agent), traced_agent.calls)
