"""A user's kernel saved in a pod on one node comes back in their next pod on another node,
through the remote store, as Zero to JupyterHub runs it with
``deploy/kubernetes/jupyterhub-root-servers.yaml`` and ``jupyterhub-remote-store.yaml``
merged after it.

The S3 server (a real SeaweedFS) listens on an address every pod reaches through its
default route, as a cluster's Service. The user's Secret (signing and encryption keys, S3
credentials) is a volume of both pods. The first pod's home volume stays behind with its
node: the second pod gets an empty one, so the snapshot can come only from the bucket.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.pods import REPO, Pod, pods, service_address
from testkit.processes import free_port, kernel_pids
from testkit.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer, serving

from ..server.conftest import ServerProcess, base_environment
from .test_pod_restore import FRAGMENT, REST_NOTEBOOK, STATE, UserServers

REMOTE_FRAGMENT = REPO / "deploy" / "kubernetes" / "jupyterhub-remote-store.yaml"
USERNAME = "alice"
UPLOAD_SECONDS = 120.0


@dataclass(frozen=True)
class RemoteValues:
    """What the remote-store fragment adds to the users' servers."""

    env: dict[str, str]
    secret_name: str
    secret_mount: str
    secret_mode: int

    @classmethod
    def read(cls, path: Path, username: str) -> RemoteValues:
        singleuser = yaml.safe_load(path.read_text())["singleuser"]
        storage = singleuser["storage"]
        (volume,) = storage["extraVolumes"]
        (mount,) = storage["extraVolumeMounts"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        return cls(
            env={k: str(v).replace("{username}", username)
                 for k, v in singleuser["extraEnv"].items()},
            secret_name=volume["secret"]["secretName"].replace("{username}", username),
            secret_mount=mount["mountPath"],
            secret_mode=int(volume["secret"]["defaultMode"]),
        )


@dataclass
class Node:
    """One node's view of Alice's pods: its own home volume for her (node-local)."""

    name: str
    home: Path


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[SeaweedServer]:
    values = RemoteValues.read(REMOTE_FRAGMENT, USERNAME)
    bucket_name = values.env["JUPYTER_GPU_SNAPSHOT_REMOTE_URL"].split("/")[2]
    with service_address() as address, serving(tmp_path / "seaweed", bucket_name,
                                               ip=address) as server:
        yield server


def test_a_kernel_saved_in_a_pod_on_one_node_comes_back_in_a_pod_on_another(
    tmp_path: Path, bucket: SeaweedServer,
) -> None:
    asyncio.run(_across_nodes(tmp_path, bucket))


async def _across_nodes(tmp_path: Path, bucket: SeaweedServer) -> None:
    spec = UserServers.read(FRAGMENT)
    values = RemoteValues.read(REMOTE_FRAGMENT, USERNAME)
    secret = _make_secret(tmp_path / values.secret_name, values.secret_mode)
    env = base_environment() | spec.env | values.env
    # The operator's one edit: the endpoint is this cluster's S3 service.
    env["AWS_ENDPOINT_URL"] = bucket.endpoint_url
    servers: list[ServerProcess] = []
    kernel_ids: list[str] = []

    async def server_in(pod: Pod) -> ServerProcess:
        server = ServerProcess(
            tmp_path, env, free_port(), pod.name, host=pod.ip,
            launcher=tuple(pod.argv(workdir=spec.workdir)),
            options=(*spec.options,
                     "--ServerApp.jpserver_extensions=jupyter_gpu_snapshot=True",
                     "--GPUSnapshot.snapshot_on_shutdown=False"),
        )
        servers.append(server)
        await server.ready()
        return server

    node_a, node_b = (Node(n, tmp_path / f"{n}-alice-home") for n in ("node-a", "node-b"))
    for node in (node_a, node_b):
        (node.home / "project").mkdir(parents=True)
    try:
        with pods(tmp_path / "pods") as made:
            first = Pod("jupyter-alice", tmp_path / "pods",
                        {node_a.home: spec.home, secret: values.secret_mount})
            made.append(first)
            server = await server_in(first)
            kernel_id, ws = await server.open_notebook_kernel(kernel_ids, REST_NOTEBOOK)
            await ws.execute(STATE.format(epoch=21))
            saved = await server.api.succeeded(await server.api.save(kernel_id, name="moved"))
            snapshot_id = saved["snapshot_id"]
            await _uploaded(server, snapshot_id)
            first.delete()

            second = Pod("jupyter-alice", tmp_path / "pods",
                         {node_b.home: spec.home, secret: values.secret_mount})
            made.append(second)
            server = await server_in(second)
            # Only the bucket holds it: node B's home has no store of hers.
            listed = {s["id"]: s for s in await server.api.snapshots()}
            assert listed[snapshot_id]["location"] == "remote", listed
            restored = await server.restore_into_notebook(snapshot_id, kernel_ids,
                                                          REST_NOTEBOOK)
            ws = await server.kernel(restored)
            said = await ws.execute("print(trained['epoch'], trained['pod'], "
                                    "socket.gethostname())")
            assert said.split() == ["21", first.name, second.name], said
            assert (await ws.execute("print(random.random())")).strip() == repr(
                random.Random(7).random())
            (kernel_pid,) = kernel_pids(kernel_id)
            assert second.holds(kernel_pid)
    finally:
        for running in servers:
            running.kill()


async def _uploaded(server: ServerProcess, snapshot_id: str) -> None:
    """Waits until the snapshot is both here and in the bucket."""
    deadline = time.monotonic() + UPLOAD_SECONDS
    while True:
        found: dict[str, Any] = {s["id"]: s for s in await server.api.snapshots()}
        if found.get(snapshot_id, {}).get("location") == "both":
            return
        assert time.monotonic() < deadline, found.get(snapshot_id)
        await asyncio.sleep(0.5)


def _make_secret(folder: Path, mode: int) -> Path:
    """The user's Secret as its volume shows it: each key a file of ``mode``."""
    folder.mkdir()
    files = {
        # As `openssl rand -hex 32` makes them (the fragment's recipe).
        "signing.key": os.urandom(32).hex().encode() + b"\n",
        "encryption.key": os.urandom(32).hex().encode() + b"\n",
        "aws-credentials": (f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                            f"aws_secret_access_key = {SECRET_KEY}\n").encode(),
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
        os.chmod(folder / name, mode)
    return folder
