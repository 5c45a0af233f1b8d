"""The node agent as a DaemonSet, played from ``deploy/kubernetes/node-agent.yaml`` and the
Zero to JupyterHub values ``deploy/kubernetes/jupyterhub-node-agent.yaml``.

One agent serves the whole node: it runs in this machine's namespaces, as the DaemonSet's
privileged agent with ``hostPID`` runs in the node's, with the manifest's arguments, its
socket, run and state directories moved under the test's directory, and it reads the
container runtime's records of the pods' containers from there too. Each user's pod
(``testkit.pods``) has one container, the notebook, where the user's server runs as the
user, without privileges, with the values' environment; it mounts the user's home volume,
the agent's socket directory and the pod's own kernel-log directory, the last at the same
path as on the node. Alice and Bob run as one uid, as the chart's one ``uid`` has them:
the agent tells them apart by pod, as the runtime records it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jupyter_gpu_snapshot.agent.server import DEFAULT_RUN_DIR, DEFAULT_STATE_DIR
from jupyter_gpu_snapshot.agent_client.protocol import DEFAULT_SOCKET
from testkit.pods import REPO, Pod, pods, write_runtime_record
from testkit.unix_users import UnixUser

from .conftest import AGENT_START_SECONDS, PodUser, SidecarPods, image_environment

DAEMONSET = REPO / "deploy" / "kubernetes" / "node-agent.yaml"
VALUES = REPO / "deploy" / "kubernetes" / "jupyterhub-node-agent.yaml"
# The hub's namespace, which the values' kernel-log directory names.
HUB_NAMESPACE = "jupyterhub"
SOCKET_VARIABLE = "JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET"
# What the chart expands in the values' volumes: the user's name, and the server's (none
# for the default server).
USER_SERVER = "{user_server}"
NAMESPACE_KINDS = ("mnt", "pid", "net", "uts", "ipc", "cgroup")

@dataclass(frozen=True)
class DaemonSetPods(SidecarPods):
    """What the DaemonSet says of the agent, and the values of the users' pods. Of the
    sidecar's fields: ``volumes`` and ``notebook_mounts`` are the pods' further volumes
    (hostPaths, their paths on the node in ``host_paths``), ``agent_mounts`` the agent's
    volumes, and ``gpus`` the notebook container's, where the kernels run."""

    env: dict[str, str]  # the notebook container's environment (extraEnv)
    host_paths: dict[str, str]  # the pods' volume name -> its path on the node

    @classmethod
    def read(cls, path: Path, values_path: Path = VALUES) -> DaemonSetPods:
        """The DaemonSet at ``path``, the values at ``values_path``."""
        agent_pod = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
        # The agent played here: in the node's PID namespace, privileged, serving pods.
        assert agent_pod["hostPID"] is True
        (agent,) = agent_pod["containers"]
        assert agent["command"] == ["jupyter", "gpu-snapshot", "agent"], agent["command"]
        assert "--pods" in agent["args"], agent["args"]
        assert agent["securityContext"]["privileged"] is True
        agent_host_paths = {v["name"]: v["hostPath"]["path"] for v in agent_pod["volumes"]}
        agent_mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
        # The agent, run here on the node itself, names the node's paths as the node does:
        # a kernel log it names is where the pod mounts it.
        assert all(agent_host_paths[name] == mount for name, mount in agent_mounts.items()), (
            agent_mounts)
        singleuser = yaml.safe_load(values_path.read_text())["singleuser"]
        storage = singleuser["storage"]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in storage["extraVolumes"]}
        limits = singleuser.get("extraResource", {}).get("limits", {})
        spec = cls(
            uid=int(singleuser["uid"]),
            home=storage["homeMountPath"],
            volumes=dict.fromkeys(host_paths, "hostPath"),
            notebook_mounts={m["name"]: m["mountPath"] for m in storage["extraVolumeMounts"]},
            agent_mounts=agent_mounts,
            agent_args=tuple(agent["args"]),
            gpus=int(limits.get("nvidia.com/gpu", 0)),
            env={str(k): str(v) for k, v in singleuser["extraEnv"].items()},
            host_paths=host_paths,
        )
        # The servers find the agent's socket where their pods mount its directory.
        socket = Path(spec.socket)
        (socket_volume,) = [name for name, node_path in host_paths.items()
                            if Path(node_path) == socket.parent]
        assert Path(spec.env[SOCKET_VARIABLE]) == (
            Path(spec.notebook_mounts[socket_volume]) / socket.name), spec.env
        return spec

    def option(self, name: str) -> str | None:
        """The value the DaemonSet gives the agent's option ``name``, if any."""
        args = self.agent_args
        return args[args.index(name) + 1] if name in args else None

    @property
    def socket(self) -> str:
        return self.option("--socket") or str(DEFAULT_SOCKET)

    @property
    def run_dir(self) -> str:
        return self.option("--run-dir") or str(DEFAULT_RUN_DIR)

    @property
    def state_dir(self) -> str:
        return self.option("--state-dir") or str(DEFAULT_STATE_DIR)

    def pod_volumes(self, user_server: str) -> dict[str, tuple[str, str]]:
        """The further volumes of the pod of ``user_server``, as the chart expands them:
        name -> (path on the node, mount path in the pod)."""
        return {
            name: (node_path.replace(USER_SERVER, user_server),
                   self.notebook_mounts[name].replace(USER_SERVER, user_server))
            for name, node_path in self.host_paths.items()
        }


def make_host_path(path: Path) -> None:
    """A hostPath directory as the kubelet makes it (``DirectoryOrCreate``): root's, 0755,
    as is each parent it makes on the way."""
    for directory in [*reversed(path.parents), path]:
        if not directory.exists():
            directory.mkdir(mode=0o755)
            directory.chmod(0o755)  # whatever the umask


@dataclass(frozen=True)
class Node:
    """This machine as the cluster's node: the agent's socket, run and state directories
    and the container runtime's records, under ``root`` (the test's directory) rather than
    at the manifest's paths."""

    root: Path
    spec: DaemonSetPods

    @property
    def socket_dir(self) -> Path:
        return self.root / "agent-socket"

    @property
    def socket(self) -> Path:
        return self.socket_dir / Path(self.spec.socket).name

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def bundles(self) -> Path:
        """containerd's bundles, one directory per container, named by its id."""
        return self.root / "bundles"

    def volume(self, node_path: str, pod_path: str) -> tuple[Path, str]:
        """The directory of this node's for a pod's hostPath volume at ``node_path`` (in the
        agent's socket directory or in its run directory), and where the pod mounts it: at
        ``pod_path``, except one in the run directory, at this node's path, as on a node
        the pod mounts it at the node's (the agent and the kernel name a kernel's log by
        one path)."""
        path = Path(node_path)
        socket_dir, run_dir = Path(self.spec.socket).parent, Path(self.spec.run_dir)
        if path == socket_dir or socket_dir in path.parents:
            return self.socket_dir / path.relative_to(socket_dir), pod_path
        assert path == run_dir or run_dir in path.parents, (
            f"{node_path} is in none of the agent's directories")
        assert pod_path == node_path, f"the pods mount {node_path} at {pod_path}"
        here = self.run_dir / path.relative_to(run_dir)
        return here, str(here)

    def agent_args(self, options: Sequence[str] = ()) -> list[str]:
        """The DaemonSet's arguments of the agent, the node's paths in them moved here, and
        where the runtime's records are; then ``options``, an operator's own limits, which
        win over the manifest's (of an option given twice, the agent takes the last)."""
        args = list(self.spec.agent_args)
        for option, path in (("--socket", self.socket), ("--run-dir", self.run_dir),
                             ("--state-dir", self.state_dir)):
            if option in args:
                args[args.index(option) + 1] = str(path)
            else:
                args += [option, str(path)]
        return [*args, "--container-bundles", f"{self.bundles}/{{id}}", *options]


# What starts the agent's process: ``subprocess.Popen``, or a tracer's start that watches
# it and everything it starts (``testkit.root_file_calls.RootFileCalls.start``).
Start = Callable[..., subprocess.Popen[bytes]]


class NodeAgent:
    """``jupyter gpu-snapshot agent`` as the DaemonSet runs it, on this machine as the node
    and in its namespaces, with ``options`` after the manifest's, started by ``start``; its
    output in ``log_path``."""

    def __init__(self, node: Node, options: Sequence[str] = (),
                 start: Start = subprocess.Popen) -> None:
        self.node = node
        self.log_path = node.root / "agent.log"
        for directory in (node.socket_dir, node.run_dir, node.state_dir, node.bundles):
            make_host_path(directory)
        with open(self.log_path, "wb") as log:
            # `jupyter gpu-snapshot` is this module, run by the image's interpreter. A
            # session of its own: ``end`` kills what it runs too.
            self.process = start(
                [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "agent",
                 *node.agent_args(options)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=image_environment(), start_new_session=True)

    def wait_listening(self) -> None:
        deadline = time.monotonic() + AGENT_START_SECONDS
        while not self.node.socket.is_socket():
            assert self.process.poll() is None and time.monotonic() < deadline, (
                f"the node agent does not listen on {self.node.socket} (exit status "
                f"{self.process.returncode}; the end of its log is in the captured output)")
            time.sleep(0.2)

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def namespaces_shared_with(self, pid: int) -> list[str]:
        """The kinds of the agent's namespaces that process ``pid`` is in too."""
        def inode(owner: int, kind: str) -> int:
            return os.stat(f"/proc/{owner}/ns/{kind}").st_ino

        return [kind for kind in NAMESPACE_KINDS
                if inode(pid, kind) == inode(self.process.pid, kind)]

    def end(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class NotebookPod(Pod):
    """A user's pod whose one container, the notebook, has the values' environment: every
    process started in it gets it, as the runtime gives a container's environment to each
    process it starts there (``kubectl exec`` too)."""

    def __init__(self, name: str, workdir: Path, volumes: Mapping[Path, str],
                 env: Mapping[str, str], devices: Sequence[str] = ()) -> None:
        self.env = dict(env)
        super().__init__(name, workdir, volumes, devices)

    def argv(self, *command: str, workdir: str = "/", user: str | None = None) -> list[str]:
        assignments = [f"{name}={value}" for name, value in self.env.items()]
        return super().argv("env", *assignments, *command, workdir=workdir, user=user)


@dataclass
class NodeAgentUser(PodUser):
    """A user of the hub whose pods the node's one agent serves: their home volume and
    their pods (made by ``next_pod``: no agent of their own, unlike ``new_pod``'s), all
    run as the one uid ``unix_user`` has."""

    spec: DaemonSetPods

    @property
    def pod_name(self) -> str:
        """The name of each of the user's pods in Kubernetes (the chart's
        ``jupyter-{user_server}``): the agent keeps the user's snapshots by it."""
        return f"jupyter-{self.name}"

    @property
    def node(self) -> Node:
        return Node(self.workdir, self.spec)

    @property
    def store(self) -> Path:
        """The user's snapshots in the agent's state, by their pod's namespace and name."""
        return self.node.state_dir / "pods" / HUB_NAMESPACE / self.pod_name / "snapshots"

    def volumes(self) -> dict[Path, str]:
        """The volumes of each of the user's pods: this node's directory -> where the pod
        mounts it (the home volume, then the values' hostPaths)."""
        volumes = {self.home: self.spec.home}
        for node_path, pod_path in self.spec.pod_volumes(self.name).values():
            here, inside = self.node.volume(node_path, pod_path)
            volumes[here] = inside
        return volumes

    def next_pod(self, devices: tuple[str, ...] = ()) -> Pod:
        """A new pod of the user's, as the hub makes it from the values, with ``devices``
        (the GPUs the device plugin allocates it); and the runtime's record of its
        container, by which the agent knows whose it is. Blocking: called in a thread."""
        node = self.node
        volumes = self.volumes()
        for here in volumes:
            if here != self.home:
                make_host_path(here)
        pod = NotebookPod(self.pod_name, self.workdir / "pods", volumes, self.spec.env,
                          devices)
        self.made.append(pod)
        write_runtime_record(pod, node.bundles, HUB_NAMESPACE, self.pod_name)
        return pod

    def ask_agent(self, pod: Pod, op: str, args: dict[str, Any],
                  socket: str | None = None) -> dict[str, Any]:
        """One request to the node's agent, sent by hand from the user's pod, as the user,
        at the socket the container's environment names; the agent's reply."""
        return super().ask_agent(pod, op, args, socket or self.spec.env[SOCKET_VARIABLE])


@contextlib.contextmanager
def node_agent_users(
    tmp_path: Path, unix_user: UnixUser, agent_options: Sequence[str] = (),
    start: Start = subprocess.Popen,
) -> Iterator[tuple[NodeAgent, NodeAgentUser, NodeAgentUser]]:
    """The node's agent, started by ``start``, listening, with ``agent_options`` after the
    manifest's arguments (``--disk-quota 1``: they win), and Alice and Bob, both running as
    ``unix_user``'s uid as the values' one ``uid`` for all has them (the uid must have a
    name here). Their pods are deleted and the agent killed at the end, whatever happened,
    and the end of its log printed: pytest shows it with a failed test."""
    # The agent trusts the runtime's records only in directories that none but root can
    # change, from / down.
    os.chmod(tmp_path, 0o755)
    spec = DaemonSetPods.read(DAEMONSET, VALUES)
    assert spec.uid != 0
    agent = NodeAgent(Node(tmp_path, spec), agent_options, start)
    try:
        agent.wait_listening()
        with pods(tmp_path / "pods") as made:
            alice, bob = (NodeAgentUser(name, unix_user, spec, tmp_path, made)
                          for name in ("alice", "bob"))
            for user in (alice, bob):
                user.make_volumes()
            yield agent, alice, bob
    finally:
        agent.end()
        print(f"The end of the node agent's log ({agent.log_path}):\n{agent.log_tail()}")
