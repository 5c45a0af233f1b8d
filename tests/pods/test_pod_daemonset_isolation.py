"""The node agent's isolation table, again with the DaemonSet model: one agent for the
node (``tests/pods/daemonset.py`` plays its manifest and the hub's values), Alice and Bob
running as one uid, each in their own pod, the agent telling them apart by pod.

The refusals are data (``REFUSALS``), as in the sidecar model's table
(``test_pod_isolation``): each is asked of the agent over its socket by a process of the
user's pod, each must be answered with its code and cause, and after each Alice's kernel,
which the agent launched in her pod, still answers, her snapshot is still hers and Bob's
store holds nothing. Then the rows that need their own setting: a process of the node's,
in no pod; the disk quota counted per pod owner; and a pod flooding the agent while
another pod is served.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.agent_client.protocol import decode, encode
from jupyter_gpu_snapshot.core import procfs
from testkit.pods import Pod
from testkit.unix_users import POLL, UnixUser

from ..agent.conftest import COMMAND_SECONDS
from .conftest import ASK_AGENT, NOTEBOOK, PodKernel, image_environment
from .daemonset import (
    HUB_NAMESPACE,
    SOCKET_VARIABLE,
    NodeAgentUser,
    Start,
    node_agent_users,
)
from .test_pod_daemonset import Node
from .test_pod_isolation import ANSWER_SECONDS, FLOOD, NO_SNAPSHOT, NOT_LAUNCHED

NO_GPU_TIER = "does not yet release or give back the GPU of a kernel in a pod"
NO_NSINIT = "the request must name the container's Python and nsinit.py (nsinit)"
# A cap far below the agent's default, so that one pod reaches it at once.
CONNECTION_CAP = 16
# Run in a pod as the user: one more connection to the agent at the socket ``argv[1]``;
# the agent's one line on it. It sends nothing: the agent answers a connection over the
# cap before it reads from it, and closes it, so a request sent meanwhile may meet a
# closed connection.
ONE_MORE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect(sys.argv[1])
print(s.makefile("rb").readline().decode())
"""


@pytest.fixture
def shared_uid(unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
               ) -> UnixUser:
    """The one uid Alice and Bob both run as (Alice's Unix user's: it must have a name
    here), with this checkout's files reachable by it."""
    return unix_users[0]


@contextlib.contextmanager
def node_users(tmp_path: Path, uid: UnixUser, *agent_options: str,
               start: Start = subprocess.Popen) -> Iterator[Node]:
    """The node's agent, given ``agent_options`` after the manifest's and started by
    ``start``, and Alice and Bob; what they started from this machine (their kernels'
    holders, their floods) ended whatever happens, before their pods are deleted."""
    with node_agent_users(tmp_path, uid, agent_options, start) as (agent, alice, bob):
        try:
            yield agent, alice, bob
        finally:
            alice.end()
            bob.end()


def snapshots_in(store: Path) -> list[str]:
    """The ids of the snapshots in ``store`` (its page packs beside them are none)."""
    return sorted(manifest.parent.name for manifest in store.glob("*/manifest.json"))


def error_of(said: dict[str, Any]) -> dict[str, Any]:
    """The error the agent answered with; none is a failure of the test."""
    error = said.get("error")
    assert isinstance(error, dict), f"answered, not refused: {said}"
    return error


@dataclass
class Scene:
    """Alice's pod with the kernel the agent launched there and one snapshot of it, made
    for a notebook; Bob's pod with a process of his own that the agent did not launch."""

    alice: NodeAgentUser
    bob: NodeAgentUser
    alices_pod: Pod
    bobs_pod: Pod
    kernel: PodKernel
    snapshot_id: str
    bobs_own_pid: int  # in his pod

    def asker(self, who: str) -> tuple[NodeAgentUser, Pod]:
        return (self.alice, self.alices_pod) if who == "alice" else (self.bob, self.bobs_pod)


@dataclass(frozen=True)
class Refusal:
    """One row: who asks the node's agent for what, from their pod, and the code and the
    cause it must answer with."""

    row: str
    who: str
    op: str
    args: Callable[[Scene], dict[str, Any]]
    code: str
    cause: str


def _save(pid: Callable[[Scene], int]) -> Callable[[Scene], dict[str, Any]]:
    return lambda scene: {"target": {"pid": pid(scene)}}


REFUSALS = (
    Refusal("another pod's kernel, by the pid its pod gives it", "bob", "save",
            _save(lambda s: s.kernel.pod_pid), "refused", NOT_LAUNCHED),
    Refusal("another pod's kernel, by the node's pid", "bob", "save",
            _save(lambda s: s.kernel.node_pid), "refused", NOT_LAUNCHED),
    Refusal("a process of his own pod that the agent did not launch", "bob", "save",
            _save(lambda s: s.bobs_own_pid), "refused", NOT_LAUNCHED),
    Refusal("root's process in his pod: its PID 1", "bob", "save",
            _save(lambda s: 1), "refused", NOT_LAUNCHED),
    Refusal("another pod's snapshot, restored", "bob", "restore",
            lambda s: {"ref": s.snapshot_id}, "not_found", NO_SNAPSHOT),
    Refusal("another pod's snapshot, deleted", "bob", "delete",
            lambda s: {"ref": s.snapshot_id}, "not_found", NO_SNAPSHOT),
    Refusal("another pod's snapshot, renamed", "bob", "rename",
            lambda s: {"ref": s.snapshot_id, "name": "bobs"}, "not_found", NO_SNAPSHOT),
    # In a pod a kernel starts under the container's own nsinit: a launch must name it.
    Refusal("a launch that names no nsinit of her container", "alice", "launch",
            lambda s: {"argv": ["true"], "kernel_id": "k1"}, "invalid_request", NO_NSINIT),
    Refusal("her own kernel's GPU released", "alice", "gpu_release",
            lambda s: {"pid": s.kernel.pod_pid}, "refused", NO_GPU_TIER),
)


def test_what_one_pod_may_not_ask_of_the_node_agent(tmp_path: Path, shared_uid: UnixUser
                                                    ) -> None:
    with node_users(tmp_path, shared_uid) as (_agent, alice, bob):
        scene = _scene(alice, bob)
        for refusal in REFUSALS:
            user, pod = scene.asker(refusal.who)
            error = error_of(user.ask_agent(pod, refusal.op, refusal.args(scene)))
            assert error["code"] == refusal.code, (refusal.row, error)
            assert refusal.cause in error["cause"], (refusal.row, error)
            _still_hers(scene, refusal.row)
        # Nothing a request says makes Bob someone else: the agent knows only his pod's
        # store, whatever notebook, user, uid or pod he names.
        for args in ({"notebook_path": NOTEBOOK},
                     {"uid": alice.unix_user.uid, "user": alice.name,
                      "namespace": HUB_NAMESPACE, "pod": alice.pod_name}):
            said = bob.ask_agent(scene.bobs_pod, "list", args)
            assert said.get("result") == [], (args, said)
        _still_hers(scene, "Bob's lists")
        # The notebook's filter finds her snapshot for her: his list is empty for being his.
        said = alice.ask_agent(scene.alices_pod, "list", {"notebook_path": NOTEBOOK})
        assert [s["id"] for s in said["result"]] == [scene.snapshot_id], said


def _scene(alice: NodeAgentUser, bob: NodeAgentUser) -> Scene:
    alices_pod = alice.next_pod()
    kernel = alice.start_kernel(alices_pod)
    assert alices_pod.holds(kernel.node_pid)
    saved = alice.ask_agent(alices_pod, "save", {
        "target": {"pid": kernel.pod_pid, "notebook_path": NOTEBOOK}, "name": "alices"})
    assert "result" in saved, saved
    bobs_pod = bob.next_pod()
    # A shell of Bob's in his pod, started as a user's terminal would be, not by the agent;
    # it says its pid there. His holders, so that it ends with the test.
    own = subprocess.Popen(
        bobs_pod.argv("sh", "-c", "echo $$ && exec sleep 600", user=bob.unix_user.name),
        stdout=subprocess.PIPE, text=True)
    bob.holders.append(own)
    assert own.stdout is not None
    return Scene(alice, bob, alices_pod, bobs_pod, kernel, saved["result"]["id"],
                 int(own.stdout.readline()))


def _still_hers(scene: Scene, row: str) -> None:
    """What must not have happened: Alice's kernel stopped, her snapshot gone from her
    store, anything in Bob's."""
    alice, bob = scene.alice, scene.bob
    assert procfs.tree_alive(scene.kernel.node_pid), row
    assert alice.ask_kernel(scene.alices_pod, scene.kernel, "x") == "41", row
    assert snapshots_in(alice.store) == [scene.snapshot_id], row
    assert snapshots_in(bob.store) == [], row


# Run as the user on the node, in no pod: one request to the agent, through the socket's
# directory as an open descriptor inherited from root. The directories above the test's
# are root's alone, where a node's /run lets every user reach the socket.
def _ask_from_the_node(user: UnixUser, socket: Path, op: str, args: dict[str, Any]
                       ) -> dict[str, Any]:
    directory = os.open(socket.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        done = subprocess.run(
            ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--",
             sys.executable, "-c", ASK_AGENT, f"/proc/self/fd/{directory}/{socket.name}"],
            input=encode({"op": op, "args": args}), env=image_environment(),
            pass_fds=(directory,), capture_output=True, timeout=COMMAND_SECONDS, check=False)
    finally:
        os.close(directory)
    assert done.returncode == 0, done.stderr
    said: dict[str, Any] = decode(done.stdout.splitlines()[-1])
    return said


def test_a_process_in_no_pod_is_refused(tmp_path: Path, shared_uid: UnixUser) -> None:
    """A process of the node's, with the users' uid, asks the agent: it runs in no
    container, so it is no pod's user, and it is refused before anything is looked up."""
    with node_users(tmp_path, shared_uid) as (agent, _alice, _bob):
        error = error_of(_ask_from_the_node(shared_uid, agent.node.socket, "list", {}))
        assert (error["code"], error["step"]) == ("refused", "agent"), error
        assert "which is no container's" in error["cause"], error
        # Nor did it get a realm in the agent's state, as a uid or as a pod.
        state = agent.node.state_dir
        assert not (state / "users" / str(shared_uid.uid)).exists()
        assert not (state / "pods").exists()


def test_the_quota_counts_per_pod_owner_though_they_share_a_uid(
    tmp_path: Path, shared_uid: UnixUser,
) -> None:
    """With a quota of one byte (the operator's, after the manifest's 200G), Alice's first
    save is admitted, her store being empty, and her second refused while her kernel runs
    on; Bob, with her uid, saves in his pod all the same: the store that counts is his."""
    with node_users(tmp_path, shared_uid, "--disk-quota", "1") as (_agent, alice, bob):
        alices_pod = alice.next_pod()
        kernel = alice.start_kernel(alices_pod)
        first = alice.ask_agent(alices_pod, "save", {"target": {"pid": kernel.pod_pid}})
        assert "result" in first, first
        error = error_of(alice.ask_agent(alices_pod, "save", {"target": {"pid": kernel.pod_pid}}))
        assert (error["code"], error["step"]) == ("refused", "preflight"), error
        assert error["cause"].startswith("your snapshots use"), error
        assert error["cause"].endswith("of your 1 B"), error
        assert procfs.tree_alive(kernel.node_pid)
        assert alice.ask_kernel(alices_pod, kernel, "x") == "41"

        bobs_pod = bob.next_pod()
        bobs = bob.start_kernel(bobs_pod)
        said = bob.ask_agent(bobs_pod, "save", {"target": {"pid": bobs.pod_pid}})
        assert "result" in said, said
        assert snapshots_in(bob.store) == [said["result"]["id"]]
        assert snapshots_in(alice.store) == [first["result"]["id"]]


def test_a_pod_flooding_the_node_agent_holds_up_no_other_pod(
    tmp_path: Path, shared_uid: UnixUser,
) -> None:
    """Alice's pod holds as many connections open on the agent as it allows one user;
    her next one is refused, while Bob, with her uid, saves through the same agent from his
    pod meanwhile; once she lets go, the agent serves her again."""
    # The flood sends no request: the agent would close each connection once its request
    # timeout passed, and with them the flood, before the test is done with it.
    options = ("--max-connections", str(CONNECTION_CAP), "--request-timeout", "300")
    with node_users(tmp_path, shared_uid, *options) as (_agent, alice, bob):
        alices_pod = alice.next_pod()
        bobs_pod = bob.next_pod()
        bobs = bob.start_kernel(bobs_pod)
        flood = subprocess.Popen(
            alices_pod.argv(sys.executable, "-c", FLOOD, alice.spec.env[SOCKET_VARIABLE],
                            str(CONNECTION_CAP), user=alice.unix_user.name),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        alice.holders.append(flood)  # killed with her holders, whatever happens
        assert flood.stdout is not None and flood.stdin is not None
        assert int(flood.stdout.readline() or 0) == CONNECTION_CAP

        said = json.loads(alice.run_in(alices_pod, sys.executable, "-c", ONE_MORE,
                                       alice.spec.env[SOCKET_VARIABLE]).stdout)
        error = error_of(said)
        assert (error["code"], error["step"]) == ("refused", "agent"), error
        assert f"you have {CONNECTION_CAP} connections open" in error["cause"], error
        asked = time.monotonic()
        said = bob.ask_agent(bobs_pod, "save", {"target": {"pid": bobs.pod_pid}})
        assert "result" in said, said
        assert time.monotonic() - asked < ANSWER_SECONDS
        assert flood.poll() is None, "her connections were let go before his save"

        flood.stdin.write("go\n")
        flood.stdin.flush()
        assert flood.wait(timeout=COMMAND_SECONDS) == 0
        # The agent counts her connections down as it reads each one's end: soon, not
        # necessarily before her next request arrives.
        deadline = time.monotonic() + ANSWER_SECONDS
        while "result" not in (said := alice.ask_agent(alices_pod, "hello", {})):
            assert time.monotonic() < deadline, said
            time.sleep(POLL)
        assert said["result"]["user"]["uid"] == alice.unix_user.uid, said
        assert said["result"]["limits"]["max_connections"] == CONNECTION_CAP, said
