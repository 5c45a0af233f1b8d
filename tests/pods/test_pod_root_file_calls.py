"""The node agent's privilege rule for a caller in a pod: the class-level test of
``tests/agent/test_root_file_calls.py``, its steps and verdict run for Alice in a pod of the
DaemonSet's agent (``tests/pods/daemonset.py``).

The node's agent, started under the tracer, launches her kernel in her pod's container;
it is saved there (its connection file, in her home volume, read by the agent, as the CLI
sends none), saved with a stop and restored into her pod (the wake of a hibernation),
each through the CLI in her container. The agent has no gpu tier for a kernel in a
pod (``test_pod_daemonset_isolation`` checks its refusal). What she can change: in her
container, her home, ``/tmp``, ``/var/tmp``, ``/dev/shm`` and the kernel's working
directory; every volume of her pod that she can write (the home volume, her kernel-log
directory), by its path in the pod and on the node; and the node's own ``/tmp``,
``/var/tmp`` and ``/dev/shm``. The agent reaches its own files in her container through
``/proc/PID/root`` of a process of its own, which the verdict follows to the path below.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core import procfs
from testkit.pods import Pod
from testkit.root_file_calls import RootFileCalls, UserDirs
from testkit.unix_users import POLL, UnixUser

from ..agent.conftest import ASK_KERNEL, COMMAND_SECONDS
from ..agent.test_root_file_calls import no_path_of_the_callers_is_resolved_with_roots_rights
from .conftest import PodKernel
from .daemonset import NodeAgentUser
from .test_pod_daemonset_isolation import node_users

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent and the tracer are root")

# Where any user may write, whatever the volumes: in the container, and on the node.
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass
class CallerInAPod:
    """Alice in the DaemonSet model: her pod, and the kernel the node's agent launched in
    it."""

    user: NodeAgentUser
    pod: Pod | None = None
    kernel: PodKernel | None = None

    def _kernel(self) -> PodKernel:
        assert self.kernel is not None, "no kernel started"
        return self.kernel

    def _pod(self) -> Pod:
        assert self.pod is not None, "no pod made"
        return self.pod

    def start_kernel(self) -> None:
        self.pod = self.user.next_pod()
        self.kernel = self.user.start_kernel(self.pod)

    def save(self) -> None:
        # The CLI sends no connection: the agent reads the kernel's connection file itself.
        self.user.cli(self._pod(), "save", "--pid", str(self._kernel().pod_pid),
                      "--name", "kept")

    def release_and_wake_gpu(self) -> None:
        """None here: the agent refuses the gpu tier of a kernel in a pod."""

    def save_and_stop(self) -> str:
        kernel = self._kernel()
        saved = json.loads(self.user.cli(self._pod(), "save", "--pid", str(kernel.pod_pid),
                                         "--stop", "--json").stdout)
        deadline = time.monotonic() + COMMAND_SECONDS
        while procfs.tree_alive(kernel.node_pid):
            assert time.monotonic() < deadline, "the stopping save left the kernel running"
            time.sleep(POLL)
        snapshot_id: str = saved["id"]
        return snapshot_id

    def restore_and_ask(self, snapshot_id: str, expression: str) -> str:
        # Woken in her pod, as her server wakes a hibernated kernel (a restore into her
        # next pod is test_pod_daemonset's).
        pod = self._pod()
        restored = json.loads(self.user.cli(pod, "restore", snapshot_id, "--json").stdout)
        said = self.user.run_in(pod, sys.executable, "-c", ASK_KERNEL,
                                restored["connection_file"], expression)
        return said.stdout.strip().splitlines()[-1]

    def changeable(self) -> UserDirs:
        unix_user = self.user.unix_user
        user = UserDirs(unix_user.uid,
                        frozenset(os.getgrouplist(unix_user.name, unix_user.gid)), ())
        volumes = self.user.volumes()
        # Each volume she can write, by its owner and mode now (her log directory is made
        # hers by the agent); the agent's socket directory is root's alone.
        writable = {here: inside for here, inside in volumes.items()
                    if user.changes(_owner_and_mode(here))}
        assert self.user.home in writable, f"her home volume is not hers: {volumes}"
        # The container's scratch directories and the node's have the same paths.
        return UserDirs(user.uid, user.groups, (
            *self.working_directories(), *SCRATCH, *writable.values(), *map(str, writable)))

    def working_directories(self) -> set[str]:
        return {self.user.spec.home}


def _owner_and_mode(path: Path) -> tuple[int, int, int]:
    found = path.stat()
    return found.st_uid, found.st_gid, found.st_mode


@pytest.fixture
def node_dir() -> Iterator[Path]:
    """The node's directories (the agent's socket, run and state, the runtime's records,
    the pods' volumes): root's and in none that a user may write, as /run and /var/lib are
    on a node, so that /tmp counts whole as the users'."""
    directory = Path(tempfile.mkdtemp(prefix="jgs-", dir="/run"))
    try:
        yield directory
    finally:
        if not os.environ.get("JGS_KEEP"):
            shutil.rmtree(directory, ignore_errors=True)


def test_no_path_of_a_pods_user_is_resolved_with_roots_rights(
        node_dir: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> None:
    calls = RootFileCalls(node_dir)
    try:
        with node_users(node_dir, unix_users[0], start=calls.start) as (_agent, alice, _bob):
            no_path_of_the_callers_is_resolved_with_roots_rights(CallerInAPod(alice), calls)
    finally:
        calls.stop(check=False)
