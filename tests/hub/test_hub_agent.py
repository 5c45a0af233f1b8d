"""A shared node as JupyterHub runs one: a root hub, two users whose servers run as
themselves without privileges, and the node agent (root) doing their snapshots.

Everything is real and goes the way a user's does: the notebook's kernel is started by the
user's server (its provisioner asks the agent), cells run over the kernel's websocket
through the hub's proxy, saves and restores go through the user's REST API and the
``%gpu_snapshot`` magic, and the hub stops a server as its idle culler does.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from ..agent.conftest import Agent, cli, start_node_agent, stop_node_agent
from ..conftest import run
from ..server.conftest import KernelSocket
from .conftest import Hub, UnixUser

KERNEL = "python3-snapshot"
JOB_SECONDS = 240.0


@pytest.fixture(scope="module")
def node_agent(unix_users: tuple[UnixUser, UnixUser], user_paths: dict[Path, int]
               ) -> Iterator[Agent]:
    directory = Path(tempfile.mkdtemp(prefix="jgs-hub-agent-"))
    os.chmod(directory, 0o711)
    agent = start_node_agent(directory / "agent")
    try:
        yield agent
    finally:
        stop_node_agent(agent)
        subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
def hub_environment(node_agent: Agent) -> dict[str, str]:
    return {"JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET": str(node_agent.socket)}


class UserServer:
    """One user's server, reached through the hub's proxy with their token."""

    def __init__(self, hub: Hub, user: UnixUser) -> None:
        self.hub = hub
        self.user = user
        self.token = hub.user_token(user)

    def call(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        response = self.hub.user_api(self.user, method, path, json=body, token=self.token)
        assert response.status_code == expect, (
            f"{method} {path} as {self.user.name}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    def open_notebook(self, path: str) -> str:
        session = self.call("POST", "api/sessions", {
            "path": path, "type": "notebook", "name": path, "kernel": {"name": KERNEL}},
            expect=201)
        return str(session["kernel"]["id"])

    def kernel_of(self, path: str) -> str:
        sessions = self.call("GET", "api/sessions")
        return next(str(s["kernel"]["id"]) for s in sessions if s["path"] == path)

    def execute(self, kernel_id: str, code: str, timeout: float = 120.0) -> str:
        url = (self.hub.url.replace("http", "ws", 1)
               + f"/user/{self.user.name}/api/kernels/{kernel_id}/channels")

        async def go() -> str:
            ws = await websocket_connect(HTTPRequest(
                url, headers={"Authorization": f"token {self.token}"}, request_timeout=60))
            socket = KernelSocket(ws)
            try:
                return await socket.execute(code, timeout)
            finally:
                socket.close()

        return run(go())

    def job(self, job: dict[str, Any], expect: str = "succeeded") -> dict[str, Any]:
        deadline = time.monotonic() + JOB_SECONDS
        while job["status"] == "running":
            assert time.monotonic() < deadline, f"job did not end: {job}"
            time.sleep(0.2)
            job = self.call("GET", f"gpu-snapshot/jobs/{job['id']}")
        assert job["status"] == expect, job.get("error")
        return job

    def snapshots(self, **params: str) -> list[dict[str, Any]]:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return list(self.call("GET", f"gpu-snapshot/snapshots?{query}")["snapshots"])


def running_server(hub: Hub, user: UnixUser) -> UserServer:
    """The user's server, started when a test before left none (it runs alone too)."""
    if hub.server(user) is None:
        hub.start_server(user)
    return UserServer(hub, user)


def test_each_user_saves_and_restores_their_notebook_through_the_agent(
        hub: Hub, node_agent: Agent, unix_users: tuple[UnixUser, UnixUser]):
    alice, bob = unix_users
    servers = {}
    for user, value in ((alice, 41), (bob, 7)):
        hub.start_server(user)
        server = servers[user.name] = UserServer(hub, user)
        kernel_id = server.open_notebook("work.ipynb")
        assert server.execute(kernel_id, f"x = {value}; import os; print(os.getuid())"
                              ).strip() == str(user.uid)
        # REST: a save that ends the kernel, then a restore into the notebook, which gets
        # the restored kernel.
        saved = server.job(server.call(
            "POST", f"gpu-snapshot/kernels/{kernel_id}/snapshots", {"name": "rest", "stop": True},
            202))
        restored = server.job(server.call(
            "POST", f"gpu-snapshot/snapshots/{saved['snapshot_id']}/restore",
            {"path": "work.ipynb"}, 202))
        new_kernel = restored["result"]["kernel_id"]
        assert server.kernel_of("work.ipynb") == new_kernel
        assert server.execute(new_kernel, "print(x + 1)").strip() == str(value + 1)
        # The cells are recorded through the agent too, and a replay brings them back in
        # a fresh kernel; a portable copy is refused there, saying why.
        assert saved["result"]["fallback"] == ["replay"], saved["result"]
        replayed = server.job(server.call(
            "POST", f"gpu-snapshot/snapshots/{saved['snapshot_id']}/restore",
            {"path": "replayed.ipynb", "fallback": "replay"}, 202))
        report = replayed["result"]["fallback"]
        assert [cell["status"] for cell in report["replayed"]] == ["ok"], report
        said = server.execute(replayed["result"]["kernel_id"], "print(x)")
        assert "its work did (replay):" in said and said.strip().endswith(str(value)), said
        refused = server.job(server.call(
            "POST", f"gpu-snapshot/kernels/{new_kernel}/snapshots", {"portable": True}, 202),
            expect="failed")
        assert "node agent" in refused["error"]["message"], refused["error"]
        # The magic, from the restored kernel itself.
        said = server.execute(new_kernel, "%gpu_snapshot save magic")
        assert "magic" in said, said
        names = {s["name"] for s in server.snapshots()}
        assert {"rest", "magic"} <= names

    alices = {s["id"] for s in servers[alice.name].snapshots()}
    bobs = {s["id"] for s in servers[bob.name].snapshots()}
    assert alices and bobs and not alices & bobs
    # Bob's token on Alice's server is refused by her server; Bob's server asked for one of
    # Alice's snapshots answers from Bob's store, where it is not.
    refused = hub.user_api(alice, "GET", "gpu-snapshot/snapshots",
                           token=servers[bob.name].token)
    assert refused.status_code == 403
    one_of_alices = next(iter(alices))
    missing = hub.user_api(bob, "POST", f"gpu-snapshot/snapshots/{one_of_alices}/restore",
                           json={"path": "work.ipynb"}, token=servers[bob.name].token)
    assert missing.status_code == 404, missing.text
    # Each user's server sees its kernels as snapshot-ready: nothing it lacks (it is not
    # root) keeps them from being saved.
    for user in (alice, bob):
        for kernel in servers[user.name].call("GET", "api/kernels"):
            status = servers[user.name].call(
                "GET", f"gpu-snapshot/kernels/{kernel['id']}/status")
            assert status["ready"] is True, status


def test_a_server_the_hub_stops_saves_its_kernels_and_its_next_start_restores_them(
        hub: Hub, node_agent: Agent, unix_users: tuple[UnixUser, UnixUser]):
    alice, _ = unix_users
    server = running_server(hub, alice)
    kernel_id = server.open_notebook("long-run.ipynb")
    server.execute(kernel_id, "state = 'kept across the cull'")
    hub.stop_server(alice)  # as jupyterhub-idle-culler does
    hub.start_server(alice)
    server = UserServer(hub, alice)
    offered = [s for s in server.snapshots(notebook_path="long-run.ipynb")
               if s["reason"] == "shutdown"]
    assert offered, server.snapshots()
    restored = server.job(server.call(
        "POST", f"gpu-snapshot/snapshots/{offered[-1]['id']}/restore",
        {"path": "long-run.ipynb"}, 202))
    assert server.execute(restored["result"]["kernel_id"], "print(state)").strip() == (
        "kept across the cull")
    agent_log = node_agent.log()
    assert f"for {alice.name}" in agent_log


def test_a_kernel_hibernates_and_wakes_through_the_agent(
        hub: Hub, node_agent: Agent, unix_users: tuple[UnixUser, UnixUser]):
    _, bob = unix_users
    server = running_server(hub, bob)
    kernel_id = server.open_notebook("idle.ipynb")
    server.execute(kernel_id, "y = 5")
    server.call("POST", f"gpu-snapshot/kernels/{kernel_id}/hibernate", {}, expect=202)
    deadline = time.monotonic() + JOB_SECONDS
    while True:
        sleeping = {k["kernel_id"]: k for k in server.call("GET", "gpu-snapshot/hibernation")
                    ["kernels"]}
        if sleeping.get(kernel_id, {}).get("state") == "hibernated":
            break
        assert time.monotonic() < deadline, sleeping
        time.sleep(0.2)
    kernels = {k["id"]: k for k in server.call("GET", "api/kernels")}
    assert kernels[kernel_id]["execution_state"] == "hibernated"
    # The next cell wakes it, restored by the agent into the same kernel id.
    assert server.execute(kernel_id, "print(y * 2)").strip() == "10"
    assert f"for {bob.name}" in node_agent.log()


def test_every_face_reads_the_agents_store(
        hub: Hub, node_agent: Agent, unix_users: tuple[UnixUser, UnixUser]):
    """Through the agent, the sidebar's store, autosave's disk admission, the GPU preview
    and the CLI all answer from the agent's store for the user, never from the user's own
    directory (which holds no snapshot)."""
    alice, _ = unix_users
    store = str(node_agent.store_of(alice))
    if hub.server(alice) is not None:
        hub.stop_server(alice)
    # Autosaves every second of activity that no disk could take: each one is refused by
    # the admission, which names the store whose free space it read.
    hub.start_server(alice, args=[
        "--GPUSnapshot.autosave=True", "--GPUSnapshot.autosave_interval_minutes=0.02",
        f"--GPUSnapshot.autosave_min_free_bytes={1 << 60}"])
    server = UserServer(hub, alice)
    listing = server.call("GET", "gpu-snapshot/snapshots")
    assert listing["store"]["path"] == store, listing["store"]
    assert isinstance(listing["store"]["free_bytes"], int), listing["store"]

    kernel_id = server.open_notebook("faces.ipynb")
    server.execute(kernel_id, "z = 3")
    deadline = time.monotonic() + JOB_SECONDS
    while True:
        state = server.call("GET", f"gpu-snapshot/kernels/{kernel_id}/autosave")
        if "autosave_min_free_bytes" in str(state.get("last_skip")):
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    assert f"free in {store}," in state["last_skip"], state

    saved = server.job(server.call(
        "POST", f"gpu-snapshot/kernels/{kernel_id}/snapshots", {"name": "faces"}, 202))
    snapshot_id = saved["snapshot_id"]
    # The preview of a restore's GPUs is the agent's (its reading of the GPUs:
    # tests/agent/test_gpu_tier.py); a CPU kernel's snapshot has no device to place.
    preview = server.call("GET", f"gpu-snapshot/snapshots/{snapshot_id}/gpus")
    assert preview["problem"] is None and preview["devices"] == [], preview
    hub.stop_server(alice)

    # The CLI, as Alice: her snapshots, the agent's store and its usage; recovery and trust
    # are the agent's business, and say so.
    listed = json.loads(cli(alice, node_agent, "list", "--json").stdout)
    assert snapshot_id in {s["id"] for s in listed}
    usage = json.loads(cli(alice, node_agent, "du", "--json").stdout)
    assert usage["path"] == store and snapshot_id in {s["id"] for s in usage["snapshots"]}
    recover = cli(alice, node_agent, "recover")
    assert "the node agent recovers its store itself" in recover.stdout
    trust = cli(alice, node_agent, "trust", snapshot_id, "--yes", check=False)
    assert "signed by this node already" in trust.stdout, trust
