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
import json
import random
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json
from jupyter_gpu_snapshot.launch.provisioner import NSINIT
from testkit.pods import Pod, pods
from testkit.processes import free_port, kernel_processes

from ..server.conftest import ServerProcess, server_environment

REST_NOTEBOOK = "project/train.ipynb"
MAGIC_NOTEBOOK = "project/explore.ipynb"
STATE = (
    "import random, socket; random.seed(7); "
    "trained = {{'epoch': {epoch}, 'pod': socket.gethostname()}}"
)


@pytest.fixture
def volume(tmp_path: Path, criu_path: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """The user's volume and their server's environment, whose paths lie on it."""
    home = tmp_path / "alice"
    kernel_dir = home / "data" / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps(kernel_json()))
    store = home / "snapshots"
    store.mkdir(mode=0o700)
    env = server_environment(home, kernel_dir.parent, store, criu_path,
                             snapshot_on_shutdown=False)
    Path(env["JUPYTER_RUNTIME_DIR"]).mkdir(mode=0o700)
    yield home, env


def _server_in(pod: Pod, home: Path, env: dict[str, str]) -> ServerProcess:
    return ServerProcess(home, env, free_port(), pod.name, host=pod.ip,
                         launcher=tuple(pod.argv()))


def test_a_kernel_saved_in_a_deleted_pod_comes_back_in_the_users_next_pod(
    tmp_path: Path, volume: tuple[Path, dict[str, str]]
) -> None:
    home, env = volume
    with pods(tmp_path / "pods") as made:
        asyncio.run(_saved_in_one_pod_restored_in_the_next(tmp_path, home, env, made))


async def _saved_in_one_pod_restored_in_the_next(
    tmp_path: Path, home: Path, env: dict[str, str], made: list[Pod]
) -> None:
    servers: list[ServerProcess] = []
    try:
        await _save_delete_restore(tmp_path, home, env, made, servers)
    finally:
        for server in servers:
            server.kill()


async def _save_delete_restore(
    tmp_path: Path, home: Path, env: dict[str, str], made: list[Pod],
    servers: list[ServerProcess],
) -> None:
    kernel_ids: list[str] = []
    first = Pod("jupyter-alice", tmp_path / "pods", {home: str(home)})
    made.append(first)
    server = _server_in(first, home, env)
    servers.append(server)
    await server.ready()

    rest_kernel, ws = await server.open_notebook_kernel(kernel_ids, REST_NOTEBOOK)
    await ws.execute(STATE.format(epoch=12))
    (kernel_pid,) = _kernel_pids(rest_kernel)
    assert first.holds(kernel_pid), "the kernel does not run in the user's pod"
    saved = await server.api.succeeded(await server.api.save(rest_kernel, name="by-rest"))
    rest_snapshot = saved["snapshot_id"]

    magic_kernel, magic_ws = await server.open_notebook_kernel(kernel_ids, MAGIC_NOTEBOOK)
    await magic_ws.execute(STATE.format(epoch=30))
    said = await magic_ws.execute("%gpu_snapshot save by-magic", timeout=120)
    assert "by-magic" in said, said

    first.delete()  # the pod is gone, and every process in it
    assert kernel_processes(rest_kernel) == [] and kernel_processes(magic_kernel) == []

    second = Pod("jupyter-alice", tmp_path / "pods", {home: str(home)})
    made.append(second)
    assert second.ip != first.ip
    server = _server_in(second, home, env)
    servers.append(server)
    await server.ready()
    listed = {s["name"]: s for s in await server.api.snapshots()}
    assert listed["by-rest"]["id"] == rest_snapshot and listed["by-rest"]["status"] == "ok"

    # Through the REST API, into the notebook, as JupyterLab's dialog does.
    restored = await server.restore_into_notebook(rest_snapshot, kernel_ids, REST_NOTEBOOK)
    await _check_state(server, restored, rest_kernel, second, epoch=12)

    # Through the magic, from a fresh kernel of the other notebook.
    # The server shuts the cell's kernel down once the notebook has switched: the cell
    # never answers.
    fresh, fresh_ws = await server.open_notebook_kernel(kernel_ids, MAGIC_NOTEBOOK)
    cell = asyncio.ensure_future(fresh_ws.execute("%gpu_snapshot restore by-magic"))
    try:
        switched = await _session_of(server, MAGIC_NOTEBOOK, not_kernel=fresh)
    finally:
        cell.cancel()
    kernel_ids.append(switched)
    await _check_state(server, switched, magic_kernel, second, epoch=30)


async def _session_of(server: ServerProcess, path: str, not_kernel: str) -> str:
    """The kernel the notebook's session runs once it has switched from ``not_kernel``."""
    for _ in range(600):
        sessions = await server.api.ok("GET", "api", "sessions")
        kernel = next(s["kernel"]["id"] for s in sessions if s["path"] == path)
        if kernel != not_kernel:
            return str(kernel)
        await asyncio.sleep(0.2)
    raise AssertionError(f"the notebook {path} never switched to the restored kernel")


async def _check_state(
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
    (kernel_pid,) = _kernel_pids(saved_kernel)
    assert pod.holds(kernel_pid), "the restored kernel does not run in the new pod"


def _kernel_pids(kernel_id: str) -> list[int]:
    """The kernel processes of ``kernel_id``, without its launcher and namespace init."""
    found = []
    for pid in kernel_processes(kernel_id):
        cmdline = psutil.Process(pid).cmdline()
        if Path(cmdline[0]).name != "unshare" and str(NSINIT) not in cmdline:
            found.append(pid)
    return found
