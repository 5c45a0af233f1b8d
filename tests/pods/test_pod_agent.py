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
import random
import shutil
import subprocess
import sys
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot._constants import format_bytes
from jupyter_gpu_snapshot.agent_client.protocol import DEFAULT_SOCKET
from jupyter_gpu_snapshot.cli.main import parse_bytes
from testkit.gpu_check import no_gpu_reason
from testkit.pods import gpu_devices
from testkit.processes import kernel_pids, kernel_processes

from .conftest import NOTEBOOK, STATE, PodUser, pid_in_pod, pod_command_lines, run
from .test_pod_restore import restored_on_the_gpu, saved_on_the_gpu


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
    for pid in (pid_in_pod(kernel_pid), kernel_pid):
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
    snapshot_id = await saved_on_the_gpu(server, kernel_id, ws, figures)
    first.delete()

    second, _agent = await asyncio.to_thread(alice.new_pod, devices)
    server = await alice.server_in(second)
    kernel_pid = await restored_on_the_gpu(
        server, snapshot_id, kernel_id, kernel_ids, (NOTEBOOK, "project/other.ipynb"), second,
        figures)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid


