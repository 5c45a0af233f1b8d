"""The node agent's isolation table, again with pods: Alice and Bob run as one uid, each in
their own pod with the agent as its sidecar (``deploy/kubernetes/jupyterhub-agent-sidecar
.yaml``).

The refusals are data (``REFUSALS``), as the shared host's table is (docs/cluster.md, "What
each check defends against"): each is asked of a real agent in a real pod, over its
socket, by a process of the user's notebook container; each must be refused with its
cause, and after each Alice's kernel still runs and her snapshot is still hers. Then the
rows that need their own setting: an image claiming root though signed with her agent's
key, the disk quota counted per pod owner, and a pod flooding its agent while the other
pod's agent keeps serving.

The rows of the shared host's table that are about one agent shared by many users (a
second user's operations held up behind the first's, a state directory others may write,
the agent's config file) are about the agent's process, which is the same in a pod; they
run in tests/agent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpu_snapshot.agent_client.protocol import DEFAULT_SOCKET
from jupyter_gpu_snapshot.core import procfs
from testkit.pods import Pod

from ..conftest import KERNEL_NAME
from .conftest import PodKernel, PodUser, pid_in_pod

NOT_LAUNCHED = "is not a kernel the node agent launched or restored for you"
NO_SNAPSHOT = "no snapshot"


@dataclass
class Scene:
    """Alice's pod with her kernel and one snapshot of it; Bob's pod with a process of his
    own that the agent did not start."""

    alice: PodUser
    bob: PodUser
    alices_pod: Pod
    bobs_pod: Pod
    kernel: PodKernel
    snapshot_id: str
    bobs_own_pid: int  # in his pod
    bobs_agent_pid: int  # in his pod: root's

    def asker(self, who: str) -> tuple[PodUser, Pod]:
        return (self.alice, self.alices_pod) if who == "alice" else (self.bob, self.bobs_pod)


@dataclass(frozen=True)
class Refusal:
    """One row: who asks their pod's agent for what, and the cause it must give."""

    row: str
    who: str
    op: str
    args: Callable[[Scene], dict[str, Any]]
    cause: str


def _save(pid: Callable[[Scene], int]) -> Callable[[Scene], dict[str, Any]]:
    return lambda scene: {"target": {"pid": pid(scene)}}


REFUSALS = (
    Refusal("another pod's kernel, by the pid its pod gives it", "bob", "save",
            _save(lambda s: s.kernel.pod_pid), NOT_LAUNCHED),
    Refusal("another pod's kernel, by the node's pid", "bob", "save",
            _save(lambda s: s.kernel.node_pid), NOT_LAUNCHED),
    Refusal("a process of his own that the agent did not launch", "bob", "save",
            _save(lambda s: s.bobs_own_pid), NOT_LAUNCHED),
    Refusal("root's process in his pod: the agent itself", "bob", "save",
            _save(lambda s: s.bobs_agent_pid), NOT_LAUNCHED),
    Refusal("root's process in her pod: its PID 1", "alice", "save",
            _save(lambda s: 1), NOT_LAUNCHED),
    Refusal("another pod's snapshot, restored", "bob", "restore",
            lambda s: {"ref": s.snapshot_id}, NO_SNAPSHOT),
    Refusal("another pod's snapshot, deleted", "bob", "delete",
            lambda s: {"ref": s.snapshot_id}, NO_SNAPSHOT),
    Refusal("another pod's snapshot, renamed", "bob", "rename",
            lambda s: {"ref": s.snapshot_id, "name": "bobs"}, NO_SNAPSHOT),
    Refusal("a kernel id that is a path", "alice", "launch",
            lambda s: {"argv": ["true"], "kernel_id": "../../../etc/cron.d/x"},
            "is not a plain name"),
    Refusal("a working directory that is not absolute", "alice", "launch",
            lambda s: {"argv": ["true"], "kernel_id": "k1", "cwd": "relative/dir"},
            "not an absolute path"),
)


def test_what_one_pod_may_not_ask_of_its_agent(hub_users: tuple[PodUser, PodUser]) -> None:
    alice, bob = hub_users
    try:
        scene = _scene(alice, bob)
        for refusal in REFUSALS:
            user, pod = scene.asker(refusal.who)
            said = user.ask_agent(pod, refusal.op, refusal.args(scene))
            error = said.get("error") or {}
            assert refusal.cause in error.get("message", ""), (refusal.row, said)
            # What must not have happened: Alice's kernel still runs, her snapshot is
            # hers, and Bob's store holds nothing.
            assert procfs.tree_alive(scene.kernel.node_pid), refusal.row
            assert (alice.store / scene.snapshot_id / "manifest.json").is_file(), refusal.row
            assert not bob.store.exists() or not any(bob.store.iterdir()), refusal.row
        # Nothing a request says makes Bob someone else: his agent knows only his store.
        said = bob.ask_agent(scene.bobs_pod, "list", {"uid": 0, "user": alice.name})
        assert said["result"] == [], said
        assert alice.ask_kernel(scene.alices_pod, scene.kernel, "x") == "41"
        listed = json.loads(alice.cli(scene.alices_pod, "list", "--json").stdout)
        assert [s["id"] for s in listed] == [scene.snapshot_id]
    finally:
        alice.end()
        bob.end()


def _scene(alice: PodUser, bob: PodUser) -> Scene:
    alices_pod, _agent = alice.new_pod()
    kernel = alice.start_kernel(alices_pod)
    assert alices_pod.holds(kernel.node_pid)
    saved = json.loads(alice.cli(alices_pod, "save", "--pid", str(kernel.pod_pid), "--name",
                                 "alices", "--json").stdout)
    bobs_pod, _agent = bob.new_pod()
    # A process of Bob's in his notebook container; it says its pid in the pod.
    own = subprocess.Popen(
        bobs_pod.argv("sh", "-c", "echo $$; exec sleep 600", user=bob.unix_user.name),
        stdout=subprocess.PIPE, text=True)
    bob.holders.append(own)
    assert own.stdout is not None
    bobs_own_pid = int(own.stdout.readline())
    # The agent's process in the pod (its launcher, here, names it too).
    (bobs_agent_pid,) = [
        in_pod for p in psutil.process_iter(["cmdline"])
        if bobs_pod.holds(p.pid) and (in_pod := pid_in_pod(p.pid)) is not None
        and {"jupyter_gpu_snapshot.cli", "agent"} <= set(p.info["cmdline"] or [])]
    return Scene(alice, bob, alices_pod, bobs_pod, kernel, saved["id"], bobs_own_pid,
                 bobs_agent_pid)


# Run as root in a mount namespace where the pod's run directory is at the path the pod
# sees it: a root kernel logging into Alice's log directory, saved and signed with her
# agent's key. Prints the snapshot's id and status and the kernel's id.
FORGE = """
import asyncio, json, sys
from pathlib import Path
from jupyter_client.manager import KernelManager
from traitlets.config import Config
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import ManifestPolicy
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.liveness import kernel_answers

store_dir, key, logs, kernel_name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
km = KernelManager(kernel_name=kernel_name,
                   config=Config({"SnapshotReadyProvisioner": {"log_dir": logs}}))
km.start_kernel()
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=120)
assert kc.execute_interactive("secret = 'root'", timeout=120)["content"]["status"] == "ok"
kc.stop_channels()
store = SnapshotStore(store_dir, key, ManifestPolicy(kernel_log_dir=lambda: Path(logs)))
engine = SnapshotEngine(store, kernel_answers=kernel_answers)
try:
    forged = asyncio.run(engine.save(SaveTarget(pid=km.provisioner.root_pid), name="roots",
                                     stop=True))
finally:
    if km.has_kernel:
        km.shutdown_kernel(now=True)
print(json.dumps({"id": forged.id, "status": forged.status, "kernel_id": km.kernel_id}))
"""


def test_an_image_claiming_root_is_refused_by_her_pods_agent_though_signed(
    hub_users: tuple[PodUser, PodUser],
) -> None:
    """A snapshot of a root kernel, signed with the key of Alice's pod's agent and logging
    into her log directory, lies in her store (as if someone with the node's volumes had
    put it there): her agent refuses it before criu runs."""
    alice, _bob = hub_users
    try:
        pod, _agent = alice.new_pod()
        alice.cli(pod, "check")  # the agent makes her realm on first contact
        uid = str(alice.unix_user.uid)
        run_dir = alice.volumes_of[pod.name][alice.spec.notebook_volume_at(
            DEFAULT_SOCKET.parent)]
        forged = _forge_a_root_image(
            run_dir, alice.store, alice.state / "users" / uid / "signing.key",
            DEFAULT_SOCKET.parent / "users" / uid / "logs")
        assert forged["status"] == "ok", forged
        assert forged["id"] in [s["id"] for s in json.loads(
            alice.cli(pod, "list", "--json").stdout)]
        # Its log is root's file in her directory: not handed to her.
        said = alice.ask_agent(pod, "restore", {"ref": forged["id"]})
        assert "is not the kernel user's own file" in said["error"]["message"], said
        logs = run_dir / "users" / uid / "logs"
        for log in logs.glob(f"kernel-{forged['kernel_id']}.log"):
            log.unlink()
        said = alice.ask_agent(pod, "restore", {"ref": forged["id"]})
        assert said["error"]["step"] == "restore", said
        assert "would run as uid 0" in said["error"]["message"], said
        assert not [p for p in psutil.process_iter(["cmdline"])
                    if forged["kernel_id"] in " ".join(p.info["cmdline"] or [])]
    finally:
        alice.end()


def _forge_a_root_image(run_dir: Path, store: Path, key: Path, logs: Path) -> dict[str, Any]:
    """``FORGE`` run with ``run_dir`` at ``DEFAULT_SOCKET.parent``, where the pods see it."""
    made = not DEFAULT_SOCKET.parent.exists()
    DEFAULT_SOCKET.parent.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             'mount --bind "$0" "$1" && shift && exec "$@"', str(run_dir),
             str(DEFAULT_SOCKET.parent), sys.executable, "-c", FORGE, str(store), str(key),
             str(logs), KERNEL_NAME],
            capture_output=True, text=True, timeout=300, check=False)
    finally:
        if made:
            DEFAULT_SOCKET.parent.rmdir()
    assert done.returncode == 0, done.stderr[-3000:]
    forged: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return forged


def test_the_quota_counts_per_pod_owner_though_they_share_a_uid(
    hub_users: tuple[PodUser, PodUser],
) -> None:
    """With a quota of one byte, Alice's second save is refused and her kernel runs on;
    Bob, with her uid, saves in his pod all the same: the store that counts is his."""
    alice, bob = hub_users
    try:
        alices_pod, _agent = alice.new_pod(agent_options=("--disk-quota", "1"))
        kernel = alice.start_kernel(alices_pod)
        alice.cli(alices_pod, "save", "--pid", str(kernel.pod_pid), "--name", "one")
        refused = alice.cli(alices_pod, "save", "--pid", str(kernel.pod_pid), "--name", "two",
                            check=False)
        assert refused.returncode != 0
        assert "your snapshots use" in refused.stderr and "of your 1" in refused.stderr
        assert procfs.tree_alive(kernel.node_pid)
        assert alice.ask_kernel(alices_pod, kernel, "x") == "41"

        bobs_pod, _agent = bob.new_pod(agent_options=("--disk-quota", "1"))
        bobs = bob.start_kernel(bobs_pod)
        bob.cli(bobs_pod, "save", "--pid", str(bobs.pod_pid), "--name", "bobs")
        assert [s["name"] for s in json.loads(bob.cli(bobs_pod, "list", "--json").stdout)
                ] == ["bobs"]
        assert "used of 1 B" in alice.cli(alices_pod, "check").stdout
    finally:
        alice.end()
        bob.end()


# Run in a pod as the user: holds many connections open on the agent's socket until told
# to let go, then says how many it held.
FLOOD = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    try:
        s.connect(sys.argv[1])
    except OSError:
        break
    held.append(s)
print(len(held), flush=True)
sys.stdin.readline()
"""
FLOOD_CONNECTIONS = 300
ANSWER_SECONDS = 30.0


def test_a_pod_flooding_its_agent_holds_up_no_other_pod(
    hub_users: tuple[PodUser, PodUser],
) -> None:
    """Alice's pod holds hundreds of connections open on her agent; Bob, with her uid,
    saves through his pod's agent meanwhile; once she lets go, her agent serves her."""
    alice, bob = hub_users
    try:
        alices_pod, _agent = alice.new_pod()
        kernel = alice.start_kernel(alices_pod)
        bobs_pod, _agent = bob.new_pod()
        bobs = bob.start_kernel(bobs_pod)
        flood = subprocess.Popen(
            alices_pod.argv(sys.executable, "-c", FLOOD, str(DEFAULT_SOCKET),
                            str(FLOOD_CONNECTIONS), user=alice.unix_user.name),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and flood.stdin is not None
            assert int(flood.stdout.readline() or 0) > 100
            asked = time.monotonic()
            bob.cli(bobs_pod, "save", "--pid", str(bobs.pod_pid), "--name", "during")
            assert time.monotonic() - asked < ANSWER_SECONDS
            flood.stdin.write("go\n")
            flood.stdin.flush()
        finally:
            flood.kill()
            flood.communicate()
        said = alice.ask_agent(alices_pod, "hello", {})
        assert said["result"]["user"]["uid"] == alice.unix_user.uid, said
        assert alice.ask_kernel(alices_pod, kernel, "x") == "41"
    finally:
        alice.end()
        bob.end()
