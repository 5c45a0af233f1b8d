"""Users without root, in pods: one node agent for the whole node, a DaemonSet in the
node's PID namespace (``tests/pods/daemonset.py`` plays its manifest and the hub's values).

The agent launches each user's kernel inside the user's own container, saves it there and
restores it into the user's next pod, running its own criu in that container. The users'
servers run as the user, unprivileged, in pods with nothing privileged in them. Alice and
Bob run as one uid, as Zero to JupyterHub does by default: the agent tells them apart by
pod, as the container runtime records it, so each reaches only their own kernels and
snapshots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from testkit.gpu_check import no_gpu_reason
from testkit.pods import gpu_devices
from testkit.processes import kernel_pids, kernel_processes
from testkit.unix_users import UnixUser

from .conftest import pid_in_pod, pod_command_lines, run
from .daemonset import NodeAgent, NodeAgentUser, node_agent_users
from .test_pod_restore import (
    MAGIC_NOTEBOOK,
    REST_NOTEBOOK,
    STATE,
    _session_of,
    check_state,
    restored_on_the_gpu,
    saved_on_the_gpu,
)

Node = tuple[NodeAgent, NodeAgentUser, NodeAgentUser]
NOT_YOURS = "not a kernel the node agent launched or restored for you"


@pytest.fixture
def node(
    tmp_path: Path, unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
) -> Iterator[Node]:
    """The node's agent; Alice and Bob, both running as Alice's Unix user's uid."""
    with node_agent_users(tmp_path, unix_users[0]) as made:
        yield made


def test_a_users_kernel_goes_through_the_node_agent_into_their_next_pod(node: Node) -> None:
    agent, alice, bob = node
    run((alice, bob), _through_the_node_agent(agent, alice, bob))


async def _through_the_node_agent(agent: NodeAgent, alice: NodeAgentUser,
                                  bob: NodeAgentUser) -> None:
    first = await asyncio.to_thread(alice.next_pod)
    server = await alice.server_in(first)
    kernel_ids: list[str] = []
    rest_kernel, ws = await server.open_notebook_kernel(kernel_ids, REST_NOTEBOOK)
    await ws.execute(STATE.format(epoch=12))
    (kernel_pid,) = kernel_pids(rest_kernel)
    # Launched by the agent on the node, yet in her pod, as her uid, in none of the
    # agent's namespaces.
    assert first.holds(kernel_pid)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid
    shared = agent.namespaces_shared_with(kernel_pid)
    assert shared == [], f"the kernel is in the agent's {shared} namespaces"
    saved = await server.api.succeeded(await server.api.save(rest_kernel, name="by-rest"))
    rest_snapshot = saved["snapshot_id"]
    # In the agent's state, kept by her pod's namespace and name.
    assert (alice.store / rest_snapshot / "manifest.json").is_file()
    magic_kernel, magic_ws = await server.open_notebook_kernel(kernel_ids, MAGIC_NOTEBOOK)
    await magic_ws.execute(STATE.format(epoch=30))
    said = await magic_ws.execute("%gpu_snapshot save by-magic", timeout=120)
    assert "by-magic" in said, said

    first.delete()
    assert kernel_processes(rest_kernel) == [] and kernel_processes(magic_kernel) == []

    # Her next pod: other containers, the same pod name, so the same snapshots.
    second = await asyncio.to_thread(alice.next_pod)
    server = await alice.server_in(second)
    restored = await server.restore_into_notebook(rest_snapshot, kernel_ids, REST_NOTEBOOK)
    await check_state(server, restored, rest_kernel, second, epoch=12)
    (kernel_pid,) = kernel_pids(rest_kernel)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid
    shared = agent.namespaces_shared_with(kernel_pid)
    assert shared == [], f"the restored kernel is in the agent's {shared} namespaces"
    # With the magic, from a fresh kernel of the other notebook: the notebook's session
    # switches to the restored kernel, and the cell's kernel is shut down unanswered.
    fresh, fresh_ws = await server.open_notebook_kernel(kernel_ids, MAGIC_NOTEBOOK)
    unanswered = asyncio.ensure_future(fresh_ws.execute("%gpu_snapshot restore by-magic"))
    switched = await _session_of(server, MAGIC_NOTEBOOK, not_kernel=fresh)
    unanswered.cancel()
    kernel_ids.append(switched)
    await check_state(server, switched, magic_kernel, second, epoch=30)

    # Bob, with the same uid, in his own pod: none of her snapshots is his to list or
    # restore, and none of her kernels his to save, by the pid her pod gives it or by the
    # node's.
    bobs_pod = await asyncio.to_thread(bob.next_pod)
    bobs_server = await bob.server_in(bobs_pod)
    assert await bobs_server.api.snapshots() == []
    refusals = [
        await asyncio.to_thread(bob.ask_agent, bobs_pod, "save", {"target": {"pid": pid}})
        for pid in (pid_in_pod(kernel_pid), kernel_pid)
    ]
    assert [(r.get("error") or {}).get("code") for r in refusals] == ["refused"] * 2, refusals
    assert all(NOT_YOURS in r["error"]["cause"] for r in refusals), refusals
    code, error = await bobs_server.api.call(
        "POST", "gpu-snapshot", "snapshots", rest_snapshot, "restore",
        body={"path": REST_NOTEBOOK})
    assert code == 404 and error["step"] == "lookup", error
    assert not [p for p in pod_command_lines(bobs_pod) if "ipykernel" in " ".join(p)]
    assert second.holds(kernel_pid), "her kernel did not outlive his requests"


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}")
def test_a_gpu_kernel_goes_through_the_node_agent_into_the_users_next_pod(
    node: Node, figures: dict[str, Any],
) -> None:
    """PyTorch, CuPy and JAX on the GPU the device plugin gives the user's pod, saved
    through her server by the node's agent (criu, its CUDA plugin and the plugin's
    stand-in run in her container), the pod deleted, restored into her next pod; then a
    kernel the agent launches there after the restore computes on the GPU too."""
    agent, alice, _bob = node
    run((alice,), _gpu_through_the_node_agent(agent, alice, figures))


async def _gpu_through_the_node_agent(agent: NodeAgent, alice: NodeAgentUser,
                                      figures: dict[str, Any]) -> None:
    devices = gpu_devices(alice.spec.gpus)
    first = await asyncio.to_thread(alice.next_pod, devices)
    server = await alice.server_in(first)
    kernel_ids: list[str] = []
    kernel_id, ws = await server.open_notebook_kernel(kernel_ids, REST_NOTEBOOK)
    snapshot_id = await saved_on_the_gpu(server, kernel_id, ws, figures)
    first.delete()

    second = await asyncio.to_thread(alice.next_pod, devices)
    server = await alice.server_in(second)
    kernel_pid = await restored_on_the_gpu(
        server, snapshot_id, kernel_id, kernel_ids, (REST_NOTEBOOK, MAGIC_NOTEBOOK), second,
        figures)
    assert psutil.Process(kernel_pid).uids().real == alice.unix_user.uid
    assert agent.namespaces_shared_with(kernel_pid) == []
