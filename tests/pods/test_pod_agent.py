"""Users without root, in pods: the node agent as a privileged sidecar of each user's pod.

Each user's pod has two containers built from the same image (``testkit.pods``): the
notebook, where the user's server runs as the user, without privileges; and the agent, root,
sharing the pod's network, pid (``shareProcessNamespace``), uts, ipc and cgroup namespaces.
They share the user's home volume and an emptyDir that holds the agent's socket; the
agent's store and key are on a volume of the agent's container only. Both users run as the
same uid, as Zero to JupyterHub does by default: each reaches only their own pod's agent,
whose store is their own.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
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

from jupyter_gpu_snapshot._constants import format_bytes
from jupyter_gpu_snapshot.agent_client.protocol import DEFAULT_SOCKET, decode, encode
from jupyter_gpu_snapshot.cli.main import parse_bytes
from testkit.gpu_check import no_gpu_reason
from testkit.pods import REPO, Container, Pod, gpu_devices, pods
from testkit.processes import free_port, kernel_pids, kernel_processes
from testkit.unix_users import UnixUser

from ..server.conftest import ServerProcess, base_environment
from .test_pod_restore import GPU_CHECK, GPU_STATE

FRAGMENT = REPO / "deploy" / "kubernetes" / "jupyterhub-agent-sidecar.yaml"
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

    @property
    def state_dir(self) -> str:
        return self.agent_args[self.agent_args.index("--state-dir") + 1]


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

    def new_pod(self, devices: tuple[str, ...] = ()) -> tuple[Pod, Container]:
        """A pod for the user, as the fragment makes it, its agent listening: the notebook
        container is the pod's first, the agent a sidecar, given ``devices`` (the GPUs the
        device plugin allocates it). Blocking: called in a thread."""
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
        agent = pod.add_container(
            "agent", {hosts[n]: p for n, p in spec.agent_mounts.items()}, devices)
        with open(self.workdir / f"{pod.name}-agent.log", "wb") as log:
            # `jupyter gpu-snapshot` is this module, run by the image's interpreter.
            process = subprocess.Popen(
                agent.argv(sys.executable, "-m", "jupyter_gpu_snapshot.cli", "agent",
                           *spec.agent_args),
                stdout=log, stderr=subprocess.STDOUT, env=_image_environment())
        self.agents.append(process)
        # The server finds the agent at its default socket, in the mounted emptyDir.
        socket_volume = next(n for n, p in spec.notebook_mounts.items()
                             if Path(p) == DEFAULT_SOCKET.parent)
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

    def ask_agent(self, pod: Pod, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """One request to the agent, sent by hand from the user's server container, as
        the user; the agent's last reply line."""
        code = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); "
            f"s.connect({str(DEFAULT_SOCKET)!r}); s.sendall(sys.stdin.buffer.read()); "
            "sys.stdout.buffer.write(s.makefile('rb').read())"
        )
        done = subprocess.run(
            pod.argv(sys.executable, "-c", code, workdir=self.spec.home,
                     user=self.unix_user.name),
            input=encode({"op": op, "args": args}), capture_output=True, timeout=120,
            check=True)
        reply: dict[str, Any] = decode(done.stdout.splitlines()[-1])
        return reply

    def end(self) -> None:
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


def test_a_users_kernel_goes_through_their_pods_agent_into_their_next_pod(
    hub_users: tuple[PodUser, PodUser],
) -> None:
    run(hub_users, _through_the_sidecar(*hub_users))


async def _through_the_sidecar(alice: PodUser, bob: PodUser) -> None:
    first, _agent = await asyncio.to_thread(alice.new_pod)
    server = await alice.server_in(first)
    kernel_ids: list[str] = []
    kernel_id, ws = await server.open_notebook_kernel(kernel_ids, NOTEBOOK)
    await ws.execute(STATE)
    (kernel_pid,) = kernel_pids(kernel_id)
    # `check` in her server's container finds her pod's agent, and the limits it keeps.
    checked = await asyncio.to_thread(
        subprocess.run, first.argv(sys.executable, "-m", "jupyter_gpu_snapshot.cli", "check",
                                   workdir=alice.spec.home, user=alice.unix_user.name),
        capture_output=True, text=True, timeout=120, check=True)
    quota = parse_bytes(alice.spec.agent_args[alice.spec.agent_args.index("--disk-quota") + 1])
    assert f"{DEFAULT_SOCKET} answers" in checked.stdout, checked.stdout
    assert f"of {format_bytes(quota)}" in checked.stdout, checked.stdout
    # Launched by the agent, yet in the pod, running as the user.
    assert first.holds(kernel_pid)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid
    saved = await server.api.succeeded(await server.api.save(kernel_id, name="before-drain"))
    snapshot_id = saved["snapshot_id"]
    # The image is in the agent's store, which the notebook container does not mount.
    assert (alice.store / snapshot_id / "manifest.json").is_file()
    looked = await asyncio.to_thread(
        subprocess.run, first.argv("ls", alice.spec.state_dir, user=alice.unix_user.name),
        capture_output=True, text=True, timeout=60)
    assert looked.returncode != 0 and "No such file" in looked.stderr, looked

    first.delete()
    assert kernel_processes(kernel_id) == []

    second, _agent = await asyncio.to_thread(alice.new_pod)
    server = await alice.server_in(second)
    restored = await server.restore_into_notebook(snapshot_id, kernel_ids, NOTEBOOK)
    ws = await server.kernel(restored)
    said = await ws.execute("print(trained['epoch'], trained['uid'], socket.gethostname())")
    assert said.split() == ["5", str(alice.unix_user.uid), second.name], said
    assert (await ws.execute("print(random.random())")).strip() == repr(
        random.Random(11).random())
    (kernel_pid,) = kernel_pids(kernel_id)
    assert second.holds(kernel_pid)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid

    # Bob, with the same uid, in his own pod: his agent's store is his, and Alice's
    # snapshot is not there to list or restore.
    bobs_pod, _agent = await asyncio.to_thread(bob.new_pod)
    bobs_server = await bob.server_in(bobs_pod)
    # Nor is her kernel, by the pid her pod gives it or by the node's.
    for pid in (_pid_in_pod(kernel_pid), kernel_pid):
        said = await asyncio.to_thread(bob.ask_agent, bobs_pod, "save", {"target": {"pid": pid}})
        assert said["error"]["code"] == "refused", said
        assert "not a kernel the node agent launched or restored for you" in (
            said["error"]["cause"]), said
    assert await bobs_server.api.snapshots() == []
    code, error = await bobs_server.api.call(
        "POST", "gpu-snapshot", "snapshots", snapshot_id, "restore", body={"path": NOTEBOOK})
    assert code == 404 and error["step"] == "lookup", error
    # Her image planted into his agent's store (as only someone with the node's volumes
    # could): his agent did not sign it, so it is damaged and its restore refused before
    # anything of it runs.
    shutil.copytree(alice.store, bob.store, dirs_exist_ok=True)
    (planted,) = await bobs_server.api.snapshots()
    assert planted["status"] == "damaged" and "another key" in planted["problem"], planted
    job = await bobs_server.api.wait(await bobs_server.api.restore(snapshot_id, path=NOTEBOOK))
    assert job["status"] == "failed" and job["error"]["step"] == "verify", job
    assert not [p for p in pod_command_lines(bobs_pod) if "ipykernel" in " ".join(p)]


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}")
def test_a_gpu_kernel_goes_through_the_sidecar_into_the_users_next_pod(
    hub_users: tuple[PodUser, PodUser], figures: dict[str, Any],
) -> None:
    """PyTorch, CuPy and JAX on the GPU of the agent's container (where the kernels run),
    saved through the user's server, the pod deleted, restored into the next pod; then a
    kernel the agent launches in that pod after the restore has a working GPU too."""
    run(hub_users, _gpu_through_the_sidecar(hub_users[0], figures))


async def _gpu_through_the_sidecar(alice: PodUser, figures: dict[str, Any]) -> None:
    devices = gpu_devices(alice.spec.gpus)
    first, _agent = await asyncio.to_thread(alice.new_pod, devices)
    server = await alice.server_in(first)
    kernel_ids: list[str] = []
    kernel_id, ws = await server.open_notebook_kernel(kernel_ids, NOTEBOOK)
    await ws.execute(GPU_STATE, timeout=300)
    started = time.monotonic()
    job = await server.api.succeeded(await server.api.save(kernel_id, stop=True))
    figures["save_seconds"] = round(time.monotonic() - started, 2)
    assert job["result"]["gpu"]["moved_bytes"] > 0, job["result"]["gpu"]
    figures["gpu_bytes"] = job["result"]["gpu"]["moved_bytes"]
    first.delete()

    second, _agent = await asyncio.to_thread(alice.new_pod, devices)
    server = await alice.server_in(second)
    started = time.monotonic()
    restored = await server.restore_into_notebook(job["snapshot_id"], kernel_ids, NOTEBOOK)
    figures["restore_seconds"] = round(time.monotonic() - started, 2)
    ws = await server.kernel(restored)
    said = await ws.execute(GPU_CHECK, timeout=120)
    assert said.split() == ["True", "cuda:0", second.name], said
    (kernel_pid,) = kernel_pids(kernel_id)
    assert second.holds(kernel_pid)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid
    _other, other_ws = await server.open_notebook_kernel(kernel_ids, "project/other.ipynb")
    said = await other_ws.execute(
        "import torch; print(float(torch.ones(4, device='cuda').sum()))", timeout=300)
    assert said.strip() == "4.0", said


def _image_environment() -> dict[str, str]:
    """What the image's entrypoint gives its processes: a PATH, and where its Python
    packages are when they are not in the interpreter's own site (a carried install)."""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH")}


def _pid_in_pod(pid: int) -> int:
    """The pid process ``pid`` (of the node) has in its pod's pid namespace."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return int(line.split()[2])  # the node's, the pod's, then the kernel's own
    raise AssertionError(f"no NSpid for process {pid}")


def pod_command_lines(pod: Pod) -> list[list[str]]:
    """The command lines of the processes running in ``pod``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if pod.holds(proc.pid):
            found.append(proc.info.get("cmdline") or [])
    return found


