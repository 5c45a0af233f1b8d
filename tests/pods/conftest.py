"""The node agent as a privileged sidecar of each user's pod, played from the Zero to
JupyterHub values file ``deploy/kubernetes/jupyterhub-agent-sidecar.yaml``.

Each user's pod has two containers built from the same image (``testkit.pods``): the
notebook, where the user's server runs as the user, without privileges; and the agent, root,
sharing the pod's network, pid (``shareProcessNamespace``), uts, ipc and cgroup namespaces.
They share the user's home volume and an emptyDir that holds the agent's socket; the
agent's store and key are on a volume of the agent's container only. Alice and Bob run as
one uid, as Zero to JupyterHub does by default (``hub_users``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from jupyter_gpu_snapshot.agent_client.protocol import DEFAULT_SOCKET, decode, encode
from testkit.pods import REPO, Container, Pod, pods
from testkit.processes import free_port
from testkit.unix_users import UnixUser

from ..agent.conftest import ASK_KERNEL, COMMAND_SECONDS, START_KERNEL
from ..server.conftest import ServerProcess, base_environment

FRAGMENT = REPO / "deploy" / "kubernetes" / "jupyterhub-agent-sidecar.yaml"
# Run as the user: the request on stdin sent to the agent at the socket ``argv[1]``, its
# replies printed, one a line. Only the standard library: a request costs no import of
# the package.
ASK_AGENT = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
    "s.sendall(sys.stdin.buffer.read()); sys.stdout.buffer.write(s.makefile('rb').read())"
)
HOME_VOLUME = "volume-{username}{servername}"  # the chart's name of the user's home volume
NOTEBOOK = "project/train.ipynb"
AGENT_START_SECONDS = 60.0
STATE = (
    "import os, random, socket; random.seed(11); "
    "trained = {'epoch': 5, 'pod': socket.gethostname(), 'uid': os.getuid()}"
)


@dataclass(frozen=True)
class SidecarPods:
    """What the Zero to JupyterHub fragment says of the users' pods."""

    uid: int
    home: str  # the home volume's mount path, in both containers
    volumes: dict[str, str]  # name -> kind: "emptyDir" or "hostPath"
    notebook_mounts: dict[str, str]  # volume name -> mount path
    agent_mounts: dict[str, str]
    agent_args: tuple[str, ...]
    gpus: int  # the agent's container's: the kernels run there

    @classmethod
    def read(cls, path: Path) -> SidecarPods:
        singleuser = yaml.safe_load(path.read_text())["singleuser"]
        # The pods here share one pid namespace between their containers.
        assert singleuser["extraPodConfig"]["shareProcessNamespace"] is True
        storage = singleuser["storage"]
        (agent,) = singleuser["extraContainers"]
        assert agent["command"] == ["jupyter", "gpu-snapshot", "agent"], agent["command"]
        assert agent["securityContext"] == {"runAsUser": 0, "privileged": True}
        volumes = {}
        for volume in storage["extraVolumes"]:
            (kind,) = set(volume) - {"name"}
            volumes[volume["name"]] = kind
        return cls(
            uid=int(singleuser["uid"]),
            home=storage["homeMountPath"],
            volumes=volumes,
            notebook_mounts={m["name"]: m["mountPath"] for m in storage["extraVolumeMounts"]},
            agent_mounts={m["name"]: m["mountPath"] for m in agent["volumeMounts"]},
            agent_args=tuple(agent["args"]),
            gpus=int(agent.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)),
        )

    def notebook_volume_at(self, mount_path: Path) -> str:
        """The name of the volume the notebook container mounts at ``mount_path``."""
        return next(name for name, path in self.notebook_mounts.items()
                    if Path(path) == mount_path)

    @property
    def state_dir(self) -> str:
        return self.agent_args[self.agent_args.index("--state-dir") + 1]


@dataclass(frozen=True)
class PodKernel:
    """A kernel the user started in a pod: its root's pid in the pod and on the node."""

    kernel_id: str
    pod_pid: int
    node_pid: int
    connection_file: str


@dataclass
class PodUser:
    """One user of the hub: their home and snapshot volumes, and their pods (each with a
    notebook and an agent container), all run as the one uid ``unix_user`` has."""

    name: str
    unix_user: UnixUser
    spec: SidecarPods
    workdir: Path
    made: list[Pod]
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    servers: list[ServerProcess] = field(default_factory=list)
    holders: list[subprocess.Popen[str]] = field(default_factory=list)
    volumes_of: dict[str, dict[str, Path]] = field(default_factory=dict)  # pod -> volumes

    @property
    def home(self) -> Path:
        return self.workdir / f"{self.name}-home"

    @property
    def state(self) -> Path:
        return self.workdir / f"{self.name}-snapshots"

    @property
    def store(self) -> Path:
        """The store the agents of the user's pods keep (by the uid the user runs as)."""
        return self.state / "users" / str(self.unix_user.uid) / "snapshots"

    def make_volumes(self) -> None:
        (self.home / "project").mkdir(parents=True)
        for path in (self.home, self.home / "project"):
            os.chown(path, self.unix_user.uid, self.unix_user.gid)
        self.state.mkdir(mode=0o755)  # a hostPath the kubelet creates: root's

    def new_pod(self, devices: tuple[str, ...] = (),
                agent_options: tuple[str, ...] = ()) -> tuple[Pod, Container]:
        """A pod for the user, as the fragment makes it, its agent listening: the notebook
        container is the pod's first, the agent a sidecar, given ``devices`` (the GPUs the
        device plugin allocates it) and ``agent_options`` after the fragment's (an operator's
        own limits). Blocking: called in a thread."""
        spec = self.spec
        emptied = self.workdir / f"{self.name}-pod-{len(self.made)}"  # the pod's emptyDirs
        hosts = {HOME_VOLUME: self.home}
        for name, kind in spec.volumes.items():
            hosts[name] = emptied / name if kind == "emptyDir" else self.state
            hosts[name].mkdir(parents=True, exist_ok=True, mode=0o755)
        pod = Pod(f"jupyter-{self.name}", self.workdir / "pods",
                  {hosts[HOME_VOLUME]: spec.home}
                  | {hosts[n]: p for n, p in spec.notebook_mounts.items()})
        self.made.append(pod)
        self.volumes_of[pod.name] = hosts
        agent = pod.add_container(
            "agent", {hosts[n]: p for n, p in spec.agent_mounts.items()}, devices)
        with open(self.workdir / f"{pod.name}-agent.log", "wb") as log:
            # `jupyter gpu-snapshot` is this module, run by the image's interpreter.
            process = subprocess.Popen(
                agent.argv(sys.executable, "-m", "jupyter_gpu_snapshot.cli", "agent",
                           *spec.agent_args, *agent_options),
                stdout=log, stderr=subprocess.STDOUT, env=image_environment())
        self.agents.append(process)
        # The server finds the agent at its default socket, in the mounted emptyDir.
        socket_volume = spec.notebook_volume_at(DEFAULT_SOCKET.parent)
        deadline = time.monotonic() + AGENT_START_SECONDS
        while not (hosts[socket_volume] / DEFAULT_SOCKET.name).is_socket():
            assert process.poll() is None and time.monotonic() < deadline, (
                (self.workdir / f"{pod.name}-agent.log").read_text())
            time.sleep(0.2)
        return pod, agent

    async def server_in(self, pod: Pod) -> ServerProcess:
        """The user's server in the pod's notebook container, as the user."""
        env = base_environment()
        env.update(HOME=self.spec.home, USER=self.unix_user.name)
        server = ServerProcess(
            self.workdir, env, free_port(), pod.name, host=pod.ip,
            launcher=tuple(pod.argv(workdir=self.spec.home, user=self.unix_user.name)),
            options=("--ServerApp.jpserver_extensions=jupyter_gpu_snapshot=True",
                     "--GPUSnapshot.snapshot_on_shutdown=False"),
        )
        self.servers.append(server)
        await server.ready()
        return server

    def ask_agent(self, pod: Pod, op: str, args: dict[str, Any],
                  socket: str = str(DEFAULT_SOCKET)) -> dict[str, Any]:
        """One request to the agent at ``socket``, sent by hand from the user's server
        container, as the user; the agent's last reply line."""
        done = subprocess.run(
            pod.argv(sys.executable, "-c", ASK_AGENT, socket, workdir=self.spec.home,
                     user=self.unix_user.name),
            input=encode({"op": op, "args": args}), capture_output=True, timeout=120,
            check=True)
        reply: dict[str, Any] = decode(done.stdout.splitlines()[-1])
        return reply

    def environment(self) -> dict[str, str]:
        """What the user's commands in their notebook container run with."""
        return image_environment() | {
            "HOME": self.spec.home, "USER": self.unix_user.name, "LOGNAME": self.unix_user.name,
            # Kernel specs from the image only. Connection files in the home volume, which
            # the agent's container (where the kernels run) mounts too: a KernelManager of
            # its own writes them to a temporary file.
            "JUPYTER_PLATFORM_DIRS": "1", "JUPYTER_RUNTIME_DIR": f"{self.spec.home}/.runtime",
            "TMPDIR": self.spec.home,
        }

    def run_in(self, pod: Pod, *argv: str, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        """``argv`` in the pod's notebook container, as the user, from their home."""
        done = subprocess.run(
            pod.argv(*argv, workdir=self.spec.home, user=self.unix_user.name),
            env=self.environment(), capture_output=True, text=True, timeout=COMMAND_SECONDS,
            check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} in {pod.name} ended {done.returncode}:\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    def cli(self, pod: Pod, *args: str, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """``jupyter gpu-snapshot ARGS`` in the pod's notebook container, as the user."""
        return self.run_in(pod, sys.executable, "-m", "jupyter_gpu_snapshot.cli", *args,
                           check=check)

    def start_kernel(self, pod: Pod) -> PodKernel:
        """A snapshot-ready kernel the user starts in the pod (jupyter_client and our
        provisioner, which asks the pod's agent), held as a server holds it, ``x = 41``."""
        holder = subprocess.Popen(
            pod.argv(sys.executable, "-c", START_KERNEL, workdir=self.spec.home,
                     user=self.unix_user.name),
            env=self.environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.holders.append(holder)
        assert holder.stdout is not None and holder.stderr is not None
        line = holder.stdout.readline()
        if not line:
            holder.wait(timeout=COMMAND_SECONDS)
            raise AssertionError(f"{self.name}'s kernel did not start:\n{holder.stderr.read()}")
        found = json.loads(line)
        root = int(found["root_pid"])
        (node_pid,) = [p.pid for p in psutil.process_iter()
                       if pod.holds(p.pid) and pid_in_pod(p.pid) == root]
        return PodKernel(found["kernel_id"], root, node_pid, found["connection_file"])

    def ask_kernel(self, pod: Pod, kernel: PodKernel, expression: str) -> str:
        said = self.run_in(pod, sys.executable, "-c", ASK_KERNEL, kernel.connection_file,
                           expression)
        return said.stdout.strip().splitlines()[-1]

    def end(self) -> None:
        # The holders' processes in the pods end with their pods; their launchers here.
        for holder in self.holders:
            holder.kill()
            holder.wait()
            for pipe in (holder.stdin, holder.stdout, holder.stderr):
                if pipe is not None:
                    pipe.close()
        for server in self.servers:
            server.kill()
        for agent in self.agents:
            agent.kill()
            agent.wait()


@pytest.fixture
def hub_users(
    tmp_path: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> Iterator[tuple[PodUser, PodUser]]:
    """Alice and Bob, both running as one uid, as the fragment's one ``uid`` for all has
    them (Alice's Unix user's here: the uid must have a name on this machine)."""
    os.chmod(tmp_path, 0o755)
    spec = SidecarPods.read(FRAGMENT)
    assert spec.uid != 0
    shared_uid = unix_users[0]
    with pods(tmp_path / "pods") as made:
        users = (PodUser("alice", shared_uid, spec, tmp_path, made),
                 PodUser("bob", shared_uid, spec, tmp_path, made))
        for user in users:
            user.make_volumes()
        yield users


def run(users: tuple[PodUser, ...], scenario: Coroutine[Any, Any, None]) -> None:
    async def guarded() -> None:
        try:
            await scenario
        finally:
            for user in users:
                user.end()

    asyncio.run(guarded())




def image_environment() -> dict[str, str]:
    """What the image's entrypoint gives its processes: a PATH, and where its Python
    packages are when they are not in the interpreter's own site (a carried install)."""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH")}


def pid_in_pod(pid: int) -> int | None:
    """The pid process ``pid`` (of the node) has in its pod's pid namespace; None for a
    process of the node's (a launcher that entered the pod's other namespaces only) and
    for one that ended."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return None
    (nspids,) = [line.split()[1:] for line in lines if line.startswith("NSpid:")]
    # The node's pid, the pod's, then the kernel's own.
    return int(nspids[1]) if len(nspids) > 1 else None


def pod_command_lines(pod: Pod) -> list[list[str]]:
    """The command lines of the processes running in ``pod``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if pod.holds(proc.pid):
            found.append(proc.info.get("cmdline") or [])
    return found


