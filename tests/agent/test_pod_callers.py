"""Which pod a caller is in, told from the kernel and the container runtime's files: real
processes in real cgroups of this machine's hierarchies, and OCI bundles written where a
runtime would keep them (under a private directory of the test's, as root).

A container here is a cgroup named as the runtime names it, its processes, and a bundle
whose ``config.json`` carries the runtime's pod annotations and whose pid file names the
container's init. ``identify`` must name the pod for a process of it, and refuse a caller
whenever anything on that way could have been put there by someone other than root, or
the process does not run where its cgroup says.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.agent.pods.identity import (
    NotInPod,
    PodIdentity,
    container_id_of,
    identify,
)
from jupyter_gpu_snapshot.agent_client.protocol import Refused
from testkit.pod_init import host_cgroup_mounts
from testkit.pods import make_cgroup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: cgroups, bundles")

# Generous: the machine may be busy with other tests.
SETTLE_SECONDS = 60.0
NAMESPACE, POD, CONTAINER = "team-a", "jupyter-alice", "notebook"

# Each runtime's bundle, under the runtime's state directory; its pid file and pod
# annotations.
BUNDLE_DIRS = {
    "containerd": "containerd/io.containerd.runtime.v2.task/k8s.io/{id}",
    "cri-o": "containers/storage/overlay-containers/{id}/userdata",
}
PID_FILES = {"containerd": "init.pid", "cri-o": "pidfile"}


def pod_annotations(runtime: str, namespace: str, pod: str, pod_uid: str,
                    container: str) -> dict[str, str]:
    if runtime == "containerd":
        return {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-namespace": namespace,
            "io.kubernetes.cri.sandbox-name": pod,
            "io.kubernetes.cri.sandbox-uid": pod_uid,
            "io.kubernetes.cri.container-name": container,
            "io.kubernetes.cri.image-name": "quay.io/jupyter/base-notebook:latest",
        }
    return {
        "io.kubernetes.cri-o.ContainerType": "container",
        "io.kubernetes.pod.namespace": namespace,
        "io.kubernetes.pod.name": pod,
        "io.kubernetes.pod.uid": pod_uid,
        "io.kubernetes.container.name": container,
    }


def unified_cgroup_is_root() -> bool:
    """Whether this process sits at the root of the cgroup v2 hierarchy (or there is
    none): then a process placed in the v1 hierarchies only is told by its v1 cgroup."""
    with open("/proc/self/cgroup") as f:
        return all(line.strip() == "0::/" for line in f if line.startswith("0::"))


class Node:
    """The processes, cgroups and runtime state directory a test made; ``close`` removes
    them all, whatever happened."""

    def __init__(self, tmp_path: Path) -> None:
        # The runtime's state directory: root's and 0755 like /run, as is every directory
        # on the way to it below the temporary root.
        tmp_path.chmod(0o755)
        self.state = tmp_path / "run"
        self.state.mkdir(mode=0o755)
        self.state.chmod(0o755)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.cgroup_tops: list[Path] = []
        self.test_cgroup = f"jgs-test-pod-callers-{uuid.uuid4().hex[:8]}"

    @property
    def bundles(self) -> tuple[str, ...]:
        escaped = str(self.state).replace("{", "{{").replace("}", "}}")
        return tuple(f"{escaped}/{template}" for template in BUNDLE_DIRS.values())

    def start(self, *argv: str) -> int:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(process)
        return process.pid

    def sleeper(self) -> int:
        return self.start("sleep", "100000")

    @staticmethod
    def descendant(pid: int, depth: int) -> int:
        """The pid of the only process ``depth`` generations below ``pid``, once there."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            found = [pid]
            for _ in range(depth):
                found = [child.pid for p in found for child in psutil.Process(p).children()]
            if len(found) == 1:
                return found[0]
            assert time.monotonic() < deadline, f"process {pid} started no single descendant"
            time.sleep(0.05)

    def place(self, pid: int, cgroup: str, *, v1: bool) -> None:
        """Moves process ``pid`` into ``cgroup`` (a path below a test cgroup): in the cgroup
        v2 hierarchy, or in every v1 one with ``v1`` (the cgroupfs driver of a hybrid
        machine)."""
        mounts = [point for point, kind, _options in host_cgroup_mounts()
                  if (kind == "cgroup") == v1]
        if not mounts:
            pytest.skip(f"this machine has no cgroup {'v1' if v1 else 'v2'} hierarchy")
        for point in mounts:
            top = Path(point) / self.test_cgroup
            if top not in self.cgroup_tops:
                self.cgroup_tops.append(top)
            level = top
            make_cgroup(level)
            for name in cgroup.split("/"):
                level = level / name
                make_cgroup(level)
            (level / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:  # its group (unshare's children) goes with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait(timeout=SETTLE_SECONDS)
        deadline = time.monotonic() + SETTLE_SECONDS
        for top in self.cgroup_tops:
            for directory, _dirs, _files in os.walk(top, topdown=False):
                while os.path.isdir(directory):
                    try:
                        os.rmdir(directory)
                    except OSError:  # its last processes are still being reaped
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    try:
        yield made
    finally:
        made.close()


@dataclass
class Container:
    """A container of a pod: its cgroup, its init and bundle; ``caller`` is another of its
    processes."""

    node: Node
    runtime: str
    container_id: str
    pod_uid: str
    cgroup: str
    v1: bool
    init: int
    caller: int

    @property
    def bundle(self) -> Path:
        return self.node.state / BUNDLE_DIRS[self.runtime].format(id=self.container_id)

    @property
    def pid_file(self) -> Path:
        return self.bundle / PID_FILES[self.runtime]

    def write_bundle(self, annotations: dict[str, str] | None = None) -> None:
        """The bundle as the runtime leaves it: root's directories 0755, files 0644 (the
        runtimes' own are 0711 or 0700: only the owner and who else may write
        matter)."""
        top = self.node.state
        for part in BUNDLE_DIRS[self.runtime].format(id=self.container_id).split("/"):
            top = top / part
            top.mkdir(mode=0o755, exist_ok=True)
            top.chmod(0o755)
        if annotations is None:
            annotations = pod_annotations(self.runtime, NAMESPACE, POD, self.pod_uid,
                                          CONTAINER)
        config = {"ociVersion": "1.0.2", "process": {"args": ["sleep", "100000"]},
                  "annotations": annotations}
        write_root_file(self.bundle / "config.json", json.dumps(config))
        write_root_file(self.pid_file, str(self.init))

    def expected(self) -> PodIdentity:
        return PodIdentity(NAMESPACE, POD, self.pod_uid, CONTAINER, self.container_id,
                           self.init)


def write_root_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


@dataclass(frozen=True)
class Layout:
    """Where a runtime with a cgroup driver puts a container: ``{pod}`` stands for the pod's
    uid with '_' for '-' (systemd's slices), ``{uid}`` for the uid, ``{id}`` for the
    container's id."""

    runtime: str
    cgroup: str
    v1: bool = False

    def cgroup_of(self, container_id: str, pod_uid: str) -> str:
        return self.cgroup.format(id=container_id, uid=pod_uid, pod=pod_uid.replace("-", "_"))


SLICES = "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{pod}.slice"
LAYOUTS = {
    "containerd, systemd driver": Layout("containerd", SLICES + "/cri-containerd-{id}.scope"),
    "cri-o, systemd driver": Layout("cri-o", SLICES + "/crio-{id}.scope"),
    "containerd, cgroupfs driver on v1": Layout("containerd", "kubepods/besteffort/pod{uid}/{id}",
                                                v1=True),
    "cri-o, cgroupfs driver on v1": Layout("cri-o", "kubepods/besteffort/pod{uid}/crio-{id}",
                                           v1=True),
}  # fmt: skip


def make_container(node: Node, layout: Layout) -> Container:
    """A container of ``layout`` with two processes (its init and a caller), its bundle
    written."""
    if layout.v1 and not unified_cgroup_is_root():
        pytest.skip("this process has a cgroup v2 path: its children would be told by it")
    container_id, pod_uid = secrets.token_hex(32), str(uuid.uuid4())
    cgroup = layout.cgroup_of(container_id, pod_uid)
    init, caller = node.sleeper(), node.sleeper()
    for pid in (init, caller):
        node.place(pid, cgroup, v1=layout.v1)
    container = Container(node, layout.runtime, container_id, pod_uid, cgroup, layout.v1,
                          init, caller)
    container.write_bundle()
    return container


@pytest.fixture
def container(node: Node) -> Container:
    return make_container(node, LAYOUTS["containerd, systemd driver"])


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_containers_process_is_told_its_pod(node: Node, layout: Layout) -> None:
    made = make_container(node, layout)
    assert identify(made.caller, node.bundles) == made.expected()
    assert identify(made.init, node.bundles) == made.expected()
    assert made.expected().realm_name == f"{NAMESPACE}/{POD}"


def test_a_caller_in_the_containers_own_pid_namespace(node: Node) -> None:
    """The usual pod: the container's init is PID 1 of a namespace of its own, and the
    caller one of its descendants."""
    made = make_container(node, LAYOUTS["cri-o, systemd driver"])
    runtime = node.start("unshare", "--pid", "--fork", "--kill-child", "--",
                         "sh", "-c", "sleep 100000 & wait")
    init, caller = node.descendant(runtime, 1), node.descendant(runtime, 2)
    for pid in (init, caller):
        node.place(pid, made.cgroup, v1=made.v1)
    made.init = init
    write_root_file(made.pid_file, f"{init}\n")
    assert identify(caller, node.bundles) == made.expected()


CGROUP_NAMES = {
    "cri-containerd scope": ("cri-containerd-{id}.scope", "{id}"),
    "crio scope": ("crio-{id}.scope", "{id}"),
    "cri-o scope": ("cri-o-{id}.scope", "{id}"),
    "docker scope": ("docker-{id}.scope", "{id}"),
    "bare id": ("{id}", "{id}"),
    "crio cgroupfs": ("crio-{id}", "{id}"),
    "a login session": ("session-3.scope", None),
    "a slice": ("user-1000.slice", None),
    "no leading alphanumeric": ("-{id}", None),
    "a character no id has": ("{id}:x", None),
    "too long an id": ("{id}{id}x", None),
}  # fmt: skip


@pytest.mark.parametrize(("name", "expected"), CGROUP_NAMES.values(), ids=CGROUP_NAMES.keys())
def test_the_container_id_is_its_cgroups_name_undecorated(
        node: Node, name: str, expected: str | None) -> None:
    container_id = secrets.token_hex(32)
    pid = node.sleeper()
    node.place(pid, f"kubepods/burstable/pod{uuid.uuid4()}/{name.format(id=container_id)}",
               v1=False)
    if expected is None:
        with pytest.raises(NotInPod, match="which is no container's"):
            container_id_of(pid)
    else:
        assert container_id_of(pid) == expected.format(id=container_id)


def make_link(path: Path) -> None:
    """``path`` becomes a link to a copy of itself beside it: root's, same contents."""
    copy = path.with_name(path.name + ".real")
    path.rename(copy)
    path.symlink_to(copy)


def start_elsewhere(container: Container, *unshare: str) -> None:
    """The container's init becomes a process in namespaces of its own (``unshare``'s),
    not the caller's."""
    runtime = container.node.start("unshare", *unshare, "--fork", "--kill-child", "--",
                                   "sleep", "100000")
    container.init = container.node.descendant(runtime, 1)
    write_root_file(container.pid_file, str(container.init))


def other_owner(path: Path) -> None:
    os.chown(path, 1000, 1000)


def end(container: Container) -> None:
    """The container's init is killed and reaped: its pid names no process."""
    os.kill(container.init, signal.SIGKILL)
    for process in container.node.processes:
        if process.pid == container.init:
            process.wait(timeout=SETTLE_SECONDS)


# What spoils a container, and what the refusal says.
SPOILED: dict[str, tuple[Callable[[Container], None], str]] = {
    "config.json writable by others": (
        lambda c: (c.bundle / "config.json").chmod(0o646), r"config.json is writable by others"),
    "config.json writable by the group": (
        lambda c: (c.bundle / "config.json").chmod(0o664), r"config.json is writable by group"),
    "config.json owned by a user": (
        lambda c: other_owner(c.bundle / "config.json"), r"config.json is owned by uid 1000"),
    "config.json a link": (
        lambda c: make_link(c.bundle / "config.json"), r"config.json is a link"),
    "config.json a directory": (
        lambda c: ((c.bundle / "config.json").unlink(), (c.bundle / "config.json").mkdir()),
        r"config.json is a directory"),
    "init.pid writable by others": (
        lambda c: c.pid_file.chmod(0o666), r"init.pid is writable by group and others"),
    "init.pid a link": (lambda c: make_link(c.pid_file), r"init.pid is a link"),
    "the bundle a user's": (lambda c: other_owner(c.bundle), r"/k8s.io/\w+ is owned by uid 1000"),
    "the bundle a link": (lambda c: make_link(c.bundle), r"/k8s.io/\w+ is a link"),
    "a directory above writable by others": (
        lambda c: c.bundle.parent.parent.chmod(0o777),
        r"io.containerd.runtime.v2.task is writable by group and others \(mode 777\)"),
    "a sticky directory above a user's": (
        lambda c: (c.bundle.parent.chmod(0o1777), other_owner(c.bundle.parent)),
        r"/k8s.io is owned by uid 1000"),
    "no bundle": (lambda c: c.bundle.rename(c.bundle.with_name("gone")),
                  r"which no Kubernetes container runtime on this node keeps"),
    "no config.json": (lambda c: (c.bundle / "config.json").unlink(), r"has no config.json"),
    "no init pid": (lambda c: c.pid_file.unlink(), r"records no init pid"),
    "no pid in init.pid": (lambda c: write_root_file(c.pid_file, "-1"), r"holds no pid"),
    "config.json not JSON": (
        lambda c: write_root_file(c.bundle / "config.json", "{"), r"is not JSON"),
    "no pod annotations": (lambda c: c.write_bundle({"io.kubernetes.cri.container-type":
                                                     "container"}), r"names no pod"),
    "a namespace Kubernetes refuses": (
        lambda c: c.write_bundle(pod_annotations(c.runtime, "Team_A", POD, c.pod_uid,
                                                 CONTAINER)),
        r"the namespace 'Team_A', which Kubernetes does not allow"),
    "a pod name with a slash": (
        lambda c: c.write_bundle(pod_annotations(c.runtime, NAMESPACE, "../alice", c.pod_uid,
                                                 CONTAINER)),
        r"the pod name '../alice'"),
    "a pod name too long": (
        lambda c: c.write_bundle(pod_annotations(c.runtime, NAMESPACE, "a" * 254, c.pod_uid,
                                                 CONTAINER)),
        r"the pod name 'a+', which Kubernetes does not allow"),
    "the init in another pid namespace": (
        lambda c: start_elsewhere(c, "--pid"), r"not in its pid namespace"),
    "the init in another network namespace": (
        lambda c: start_elsewhere(c, "--net"), r"not in its net namespace"),
    "the init ended": (
        end, r"the init of container \w+ \(pid \d+\) has ended"),
}  # fmt: skip


@pytest.mark.parametrize(("spoil", "refusal"), SPOILED.values(), ids=SPOILED.keys())
def test_a_container_that_could_be_anyones_is_refused(
        node: Node, container: Container, spoil: Callable[[Container], None],
        refusal: str) -> None:
    spoil(container)
    with pytest.raises(NotInPod, match=refusal) as refused:
        identify(container.caller, node.bundles)
    assert isinstance(refused.value, Refused)
    assert refused.value.step == "agent"
    assert refused.value.hint


def test_a_root_sticky_directory_on_the_way_is_trusted(node: Node, container: Container) -> None:
    """As /tmp: nobody else can rename or remove root's entries in it."""
    container.bundle.parent.chmod(0o1777)
    assert identify(container.caller, node.bundles) == container.expected()


def test_the_first_runtime_that_keeps_the_container_answers(
        node: Node, container: Container) -> None:
    """A CRI-O bundle for the same id is not read while containerd's is there."""
    crio = Container(node, "cri-o", container.container_id, "other-uid", container.cgroup,
                     container.v1, container.init, container.caller)
    crio.write_bundle(pod_annotations("cri-o", "elsewhere", "other", "other-uid", "other"))
    assert identify(container.caller, node.bundles) == container.expected()
    crio_first = tuple(reversed(node.bundles))
    assert identify(container.caller, crio_first).realm_name == "elsewhere/other"


def test_a_process_in_no_container_is_refused(node: Node) -> None:
    with pytest.raises(NotInPod):
        identify(os.getpid(), node.bundles)


def test_a_process_that_ended_is_refused(node: Node) -> None:
    ended = subprocess.Popen(["true"])
    ended.wait(timeout=SETTLE_SECONDS)
    with pytest.raises(NotInPod, match=f"process {ended.pid} has ended"):
        identify(ended.pid, node.bundles)
