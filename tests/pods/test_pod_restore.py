"""A user's kernel saved in their pod comes back in their next pod, as on Kubernetes.

Each pod is real containers' parts (``testkit.pods``): its own mount, pid, network, uts, ipc
and cgroup namespaces, its own root and cgroup, a veth address. The user's server runs in
the pod as a Zero to JupyterHub user server with root privileges does; its store, notebooks
and Jupyter directories are on the user's volume, mounted in each of their pods at the same
path (a persistent volume claim). The first pod is deleted (every process in it killed), a
new pod of the same user is made, and the kernels come back into it with real CRIU: one
through the REST API, one through ``%gpu_snapshot restore`` in a fresh kernel.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from testkit.gpu_check import no_gpu_reason
from testkit.pods import REPO, Pod, gpu_devices, pods
from testkit.processes import free_port, kernel_pids, kernel_processes

from ..server.conftest import KernelSocket, ServerProcess, base_environment

FRAGMENT = REPO / "deploy" / "kubernetes" / "jupyterhub-root-servers.yaml"
REST_NOTEBOOK = "project/train.ipynb"
MAGIC_NOTEBOOK = "project/explore.ipynb"
T = TypeVar("T")
STATE = (
    "import random, socket; random.seed(7); "
    "trained = {{'epoch': {epoch}, 'pod': socket.gethostname()}}"
)


@dataclass(frozen=True)
class UserServers:
    """What the Zero to JupyterHub fragment says of the users' servers and their pods."""

    home: str  # where the user's volume is mounted in each of their pods
    workdir: str
    options: tuple[str, ...]  # the server's command-line options
    env: dict[str, str]
    gpus: int

    @classmethod
    def read(cls, path: Path) -> UserServers:
        singleuser = yaml.safe_load(path.read_text())["singleuser"]
        container = singleuser["extraContainerConfig"]
        # What the pods here are: root, with every capability, in the node's namespaces'
        # children. A fragment asking for less is not what this test shows.
        assert singleuser["uid"] == 0, "the servers must run as root"
        assert container["securityContext"]["privileged"] is True
        command = singleuser["cmd"]
        assert command[0] == "jupyterhub-singleuser", command
        limits = singleuser["extraResource"]["limits"]
        return cls(
            home=singleuser["storage"]["homeMountPath"],
            workdir=container["workingDir"],
            options=tuple(command[1:]),
            env={str(k): str(v) for k, v in singleuser["extraEnv"].items()},
            gpus=int(limits.get("nvidia.com/gpu", 0)),
        )


@dataclass
class PodUser:
    """Alice: her home volume, and the pods and servers a test makes for her, all ended
    when it ends. ``volumes`` are her pods' further volumes (this machine's directory ->
    where the pod sees it)."""

    servers_spec: UserServers
    workdir: Path
    volume: Path
    made: list[Pod]
    servers: list[ServerProcess] = field(default_factory=list)
    kernel_ids: list[str] = field(default_factory=list)
    volumes: dict[Path, str] = field(default_factory=dict)

    def new_pod(self, devices: tuple[str, ...] = ()) -> Pod:
        pod = Pod("jupyter-alice", self.workdir,
                  {self.volume: self.servers_spec.home} | self.volumes, devices)
        self.made.append(pod)
        return pod

    def run(self, scenario: Coroutine[Any, Any, None]) -> None:
        asyncio.run(self.guarded(scenario))

    async def guarded(self, scenario: Awaitable[T]) -> T:
        """Awaits ``scenario``, then kills the servers it started (their websockets close
        on its event loop)."""
        try:
            return await scenario
        finally:
            for server in self.servers:
                server.kill()

    async def server_in(self, pod: Pod) -> ServerProcess:
        """The user's server in ``pod``, as the fragment starts it (jupyter server in
        place of jupyterhub-singleuser: no hub here)."""
        spec = self.servers_spec
        env = base_environment()
        env.update(spec.env)
        server = ServerProcess(
            self.workdir, env, free_port(), pod.name, host=pod.ip,
            launcher=tuple(pod.argv(workdir=spec.workdir)),
            options=(*spec.options,
                     "--ServerApp.jpserver_extensions=jupyter_gpu_snapshot=True",
                     "--GPUSnapshot.snapshot_on_shutdown=False"),
        )
        self.servers.append(server)
        await server.ready()
        return server


@pytest.fixture
def alice(tmp_path: Path) -> Iterator[PodUser]:
    volume = tmp_path / "alice-home"
    (volume / "project").mkdir(parents=True)
    with pods(tmp_path / "pods") as made:
        yield PodUser(UserServers.read(FRAGMENT), tmp_path / "pods", volume, made)


def test_a_kernel_saved_in_a_deleted_pod_comes_back_in_the_users_next_pod(
    alice: PodUser,
) -> None:
    alice.run(_save_delete_restore(alice))


async def _save_delete_restore(alice: PodUser) -> None:
    first = alice.new_pod()
    server = await alice.server_in(first)
    rest_kernel, ws = await server.open_notebook_kernel(alice.kernel_ids, REST_NOTEBOOK)
    await ws.execute(STATE.format(epoch=12))
    (kernel_pid,) = kernel_pids(rest_kernel)
    assert first.holds(kernel_pid), "the kernel does not run in the user's pod"
    saved = await server.api.succeeded(await server.api.save(rest_kernel, name="by-rest"))
    rest_snapshot = saved["snapshot_id"]

    magic_kernel, magic_ws = await server.open_notebook_kernel(alice.kernel_ids,
                                                               MAGIC_NOTEBOOK)
    await magic_ws.execute(STATE.format(epoch=30))
    said = await magic_ws.execute("%gpu_snapshot save by-magic", timeout=120)
    assert "by-magic" in said, said

    first.delete()  # the pod is gone, and every process in it
    assert kernel_processes(rest_kernel) == [] and kernel_processes(magic_kernel) == []

    second = alice.new_pod()
    assert second.ip != first.ip
    server = await alice.server_in(second)
    listed = {s["name"]: s for s in await server.api.snapshots()}
    assert listed["by-rest"]["id"] == rest_snapshot and listed["by-rest"]["status"] == "ok"

    # Through the REST API, into the notebook, as JupyterLab's dialog does.
    restored = await server.restore_into_notebook(rest_snapshot, alice.kernel_ids,
                                                  REST_NOTEBOOK)
    await check_state(server, restored, rest_kernel, second, epoch=12)

    # Through the magic, from a fresh kernel of the other notebook. The server shuts the
    # cell's kernel down once the notebook has switched: the cell never answers.
    fresh, fresh_ws = await server.open_notebook_kernel(alice.kernel_ids, MAGIC_NOTEBOOK)
    cell = asyncio.ensure_future(fresh_ws.execute("%gpu_snapshot restore by-magic"))
    try:
        switched = await _session_of(server, MAGIC_NOTEBOOK, not_kernel=fresh)
    finally:
        cell.cancel()
    alice.kernel_ids.append(switched)
    await check_state(server, switched, magic_kernel, second, epoch=30)


async def _session_of(server: ServerProcess, path: str, not_kernel: str) -> str:
    """The kernel the notebook's session runs once it has switched from ``not_kernel``."""
    for _ in range(600):
        sessions = await server.api.ok("GET", "api", "sessions")
        kernel = next(s["kernel"]["id"] for s in sessions if s["path"] == path)
        if kernel != not_kernel:
            return str(kernel)
        await asyncio.sleep(0.2)
    raise AssertionError(f"the notebook {path} never switched to the restored kernel")


async def check_state(
    server: ServerProcess, kernel_id: str, saved_kernel: str, pod: Pod, *, epoch: int
) -> None:
    """The kernel ``kernel_id``, restored from a snapshot of ``saved_kernel``, has the
    saved state and runs in ``pod``."""
    ws = await server.kernel(kernel_id)
    said = await ws.execute("print(trained['epoch'], trained['pod'], socket.gethostname())")
    saved_epoch, saved_in, runs_in = said.split()
    assert int(saved_epoch) == epoch
    assert saved_in.startswith("jupyter-alice") and saved_in != pod.name
    assert runs_in == pod.name, "the restored kernel does not see its new pod's hostname"
    # The random generator's state came along too.
    generator = random.Random(7)
    assert (await ws.execute("print(random.random())")).strip() == repr(generator.random())
    # A restored tree keeps the command line of the kernel it was saved from.
    (kernel_pid,) = kernel_pids(saved_kernel)
    assert pod.holds(kernel_pid), "the restored kernel does not run in the new pod"


GPU_STATE = """
import os, socket
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
import torch, cupy, jax, jax.numpy as jnp
weights = torch.arange(50_000_000, device="cuda", dtype=torch.float32)
counts = cupy.arange(10_000_000, dtype=cupy.int64)
scaled = jnp.arange(5_000_000, dtype=jnp.float32) * 2
sums = (float(weights.sum()), int(counts.sum()), float(scaled.sum()))
"""
GPU_CHECK = (
    "print((float(weights.sum()), int(counts.sum()), float(scaled.sum())) == sums, "
    "weights.device, socket.gethostname())"
)


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}")
def test_a_gpu_kernel_saved_in_a_deleted_pod_comes_back_in_the_users_next_pod(
    alice: PodUser, figures: dict[str, Any]
) -> None:
    """PyTorch, CuPy and JAX on the pod's one GPU, saved, the pod deleted, restored into
    the next pod."""
    alice.run(_gpu_kernel_through_pods(alice, figures))


async def _gpu_kernel_through_pods(alice: PodUser, figures: dict[str, Any]) -> None:
    first = alice.new_pod(gpu_devices(alice.servers_spec.gpus))
    server = await alice.server_in(first)
    kernel_id, ws = await server.open_notebook_kernel(alice.kernel_ids, REST_NOTEBOOK)
    snapshot_id = await saved_on_the_gpu(server, kernel_id, ws, figures)
    first.delete()

    second = alice.new_pod(gpu_devices(alice.servers_spec.gpus))
    server = await alice.server_in(second)
    await restored_on_the_gpu(server, snapshot_id, kernel_id, alice.kernel_ids,
                              (REST_NOTEBOOK, MAGIC_NOTEBOOK), second, figures)


async def saved_on_the_gpu(server: ServerProcess, kernel_id: str, ws: KernelSocket,
                           figures: dict[str, Any]) -> str:
    """``GPU_STATE`` run in the kernel, which is then saved and stopped through the REST
    API; the snapshot's id. Its time and the GPU memory moved go into ``figures``."""
    await ws.execute(GPU_STATE, timeout=300)
    started = time.monotonic()
    job = await server.api.succeeded(await server.api.save(kernel_id, stop=True))
    figures["save_seconds"] = round(time.monotonic() - started, 2)
    assert job["result"]["gpu"]["moved_bytes"] > 0, job["result"]["gpu"]
    figures["gpu_bytes"] = job["result"]["gpu"]["moved_bytes"]
    return str(job["snapshot_id"])


async def restored_on_the_gpu(
    server: ServerProcess, snapshot_id: str, saved_kernel: str, kernel_ids: list[str],
    notebooks: tuple[str, str], pod: Pod, figures: dict[str, Any],
) -> int:
    """The snapshot of ``saved_on_the_gpu`` (of kernel ``saved_kernel``) restored into the
    first notebook: its GPU state equal, running in ``pod``; then a kernel started for the
    second notebook computes on the GPU too. The restored kernel's pid; its restore time
    goes into ``figures``."""
    notebook, other_notebook = notebooks
    started = time.monotonic()
    restored = await server.restore_into_notebook(snapshot_id, kernel_ids, notebook)
    figures["restore_seconds"] = round(time.monotonic() - started, 2)
    ws = await server.kernel(restored)
    said = await ws.execute(GPU_CHECK, timeout=120)
    assert said.split() == ["True", "cuda:0", pod.name], said
    # A restored tree keeps the command line of the kernel it was saved from.
    (kernel_pid,) = kernel_pids(saved_kernel)
    assert pod.holds(kernel_pid)
    # A kernel started in the new pod after the restore has a working GPU too.
    _other, other_ws = await server.open_notebook_kernel(kernel_ids, other_notebook)
    said = await other_ws.execute(
        "import torch; print(float(torch.ones(4, device='cuda').sum()))", timeout=300)
    assert said.strip() == "4.0", said
    return kernel_pid
