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
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.pods import REPO, pods, service_address
from testkit.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer, serving

from ..server.conftest import ServerProcess
from .test_pod_restore import FRAGMENT, REST_NOTEBOOK, STATE, PodUser, UserServers, check_state

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
    values = RemoteValues.read(REMOTE_FRAGMENT, USERNAME)
    secret = _make_secret(tmp_path / values.secret_name, values.secret_mode)
    spec = UserServers.read(FRAGMENT)
    # The operator's one edit: the endpoint is this cluster's S3 service.
    spec = replace(spec, env=spec.env | values.env | {"AWS_ENDPOINT_URL": bucket.endpoint_url})
    with pods(tmp_path / "pods") as made:
        # Alice's home volume on each node: hers stays with node A.
        node_a, node_b = (
            PodUser(spec, tmp_path / "pods", tmp_path / f"{node}-alice-home", made,
                    volumes={secret: values.secret_mount})
            for node in ("node-a", "node-b"))
        for alice in (node_a, node_b):
            (alice.volume / "project").mkdir(parents=True)
        saved_kernel, saved_in = await node_a.guarded(_saved_and_uploaded(node_a))
        await node_b.guarded(_restored_from_the_bucket(node_b, saved_kernel, saved_in))


async def _saved_and_uploaded(alice: PodUser) -> tuple[str, str]:
    """A kernel saved in a pod of node A, uploaded, the pod then deleted: the kernel's id
    and the pod's name."""
    pod = alice.new_pod()
    server = await alice.server_in(pod)
    kernel_id, ws = await server.open_notebook_kernel(alice.kernel_ids, REST_NOTEBOOK)
    await ws.execute(STATE.format(epoch=21))
    saved = await server.api.succeeded(await server.api.save(kernel_id, name="moved"))
    await _uploaded(server, saved["snapshot_id"])
    pod.delete()
    return kernel_id, pod.name


async def _restored_from_the_bucket(alice: PodUser, saved_kernel: str, saved_in: str
                                    ) -> None:
    pod = alice.new_pod()
    server = await alice.server_in(pod)
    # Only the bucket holds it: node B's home has no store of hers.
    (listed,) = await server.api.snapshots()
    assert listed["name"] == "moved" and listed["location"] == "remote", listed
    restored = await server.restore_into_notebook(listed["id"], alice.kernel_ids,
                                                  REST_NOTEBOOK)
    await check_state(server, restored, saved_kernel, pod, epoch=21)
    ws = await server.kernel(restored)
    assert (await ws.execute("print(trained['pod'])")).strip() == saved_in


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
