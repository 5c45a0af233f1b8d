"""Node A saves, node B restores: two real Jupyter servers, sharing only a bucket and a key.

Node A is a Jupyter server with the extension in this machine's namespaces. Node B is a
second server in its own network namespace (reaching the S3 server over a veth pair), with
its own hostname and, through its own mount namespace, its own empty store and runtime
directories at the same paths (as on another node built from the same image). The two share
the S3 bucket (a real SeaweedFS, listening on the veth address only) and the signing key
file. The kernel is real, saved and restored with CRIU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json
from testkit.gpu_check import no_gpu_reason
from testkit.processes import free_port, kernel_processes, kill_kernels
from testkit.remote_snapshots import make_snapshot
from testkit.seaweed import SeaweedServer, serving

from ..server.conftest import ServerProcess, server_environment

BUCKET = "cluster"
NOTEBOOK = "project/train.ipynb"
# Node B's namespaces: its hostname, then a private tmpfs over its store and runtime dirs.
NODE_B_SETUP = (
    'hostname "$0" && mount -t tmpfs -o mode=0700 tmpfs "$1" '
    '&& mount -t tmpfs -o mode=0700 tmpfs "$2" && shift 2 && exec "$@"'
)


@dataclass
class Network:
    """A network namespace for node B (``path``, held by a sleeping process), joined to this
    one by a veth pair."""

    path: str
    host_ip: str
    node_b_ip: str


def _ip(*args: str, within: str | None = None) -> None:
    enter = [] if within is None else ["nsenter", f"--net={within}"]
    subprocess.run([*enter, "ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    if shutil.which("ip") is None:
        pytest.fail("the ip command is missing: install iproute2 (make system)")
    tag = uuid.uuid4().hex[:6]
    host_end, b_end = f"jgsa{tag}", f"jgsb{tag}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    # Held by a process, not named by 'ip netns add': that one mounts the namespace under
    # /run/netns, and every kernel started meanwhile by another test would carry that mount
    # in its mount namespace, to be bound back at its restore after this one has gone.
    # It says so once it is in the new namespace.
    holder = subprocess.Popen(["unshare", "--net", "sh", "-c", "echo in; exec sleep infinity"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "in\n"
        path = f"/proc/{holder.pid}/ns/net"
        network = Network(path, f"{subnet}.1", f"{subnet}.2")
        _ip("link", "add", host_end, "type", "veth", "peer", "name", b_end)
        _ip("link", "set", b_end, "netns", str(holder.pid))
        _ip("addr", "add", f"{network.host_ip}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("addr", "add", f"{network.node_b_ip}/30", "dev", b_end, within=path)
        _ip("link", "set", b_end, "up", within=path)
        _ip("link", "set", "lo", "up", within=path)
        yield network
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host_end)  # takes its peer with it
        holder.kill()
        holder.communicate()


@pytest.fixture(scope="module")
def s3(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A real S3 server on the host end of the veth pair: both nodes reach it there."""
    with serving(tmp_path_factory.mktemp("seaweed-cluster"), BUCKET, network.host_ip) as server:
        yield server


@dataclass
class Cluster:
    env: dict[str, str]
    home: Path
    store_dir: Path
    runtime_dir: Path
    remote_url: str
    network: Network
    s3: SeaweedServer
    servers: list[ServerProcess] = field(default_factory=list)
    kernel_ids: list[str] = field(default_factory=list)

    async def start_node_a(self) -> ServerProcess:
        return await self._started(ServerProcess(self.home, self.env, free_port(), "node-a"))

    async def start_node_b(self) -> ServerProcess:
        launcher = (
            # nsenter, not 'ip netns exec': that one remounts /sys, and the kernel's
            # mounts under it (cgroups) must be there for criu.
            "nsenter", f"--net={self.network.path}",
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", NODE_B_SETUP, "node-b", str(self.store_dir), str(self.runtime_dir),
        )  # fmt: skip
        return await self._started(ServerProcess(
            self.home, self.env, free_port(), "node-b", self.network.node_b_ip, launcher
        ))

    async def _started(self, server: ServerProcess) -> ServerProcess:
        self.servers.append(server)
        await server.ready()
        return server

    def remote(self, **options: Any) -> RemoteStore:
        return RemoteStore(self.remote_url, dict(self.s3.storage_options(), **options))


@pytest.fixture
def cluster(
    tmp_path: Path, network: Network, s3: SeaweedServer, criu_path: str
) -> Iterator[Cluster]:
    """One configuration for both nodes: the same paths, the same bucket, the same key."""
    kernel_dir = tmp_path / "data" / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps(kernel_json()))
    store_dir = tmp_path / "snapshots"
    remote_url = f"s3://{BUCKET}/users/alice-{uuid.uuid4().hex[:8]}"
    env = server_environment(
        tmp_path, kernel_dir.parent, store_dir, criu_path,
        snapshot_on_shutdown=False,
        remote_url=remote_url,
        remote_endpoint_url=s3.endpoint_url,
        remote_options={"key": s3.storage_options()["key"],
                        "secret": s3.storage_options()["secret"]},
    )
    store_dir.mkdir(mode=0o700)
    runtime_dir = Path(env["JUPYTER_RUNTIME_DIR"])
    runtime_dir.mkdir(mode=0o700)
    cluster = Cluster(env, tmp_path, store_dir, runtime_dir, remote_url, network, s3)
    try:
        yield cluster
    finally:
        for server in cluster.servers:
            kernels = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)] \
                if server.proc.poll() is None else []
            server.kill()
            for pid in kernels:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()
        kill_kernels(cluster.kernel_ids)


def test_a_kernel_saved_on_node_a_comes_back_on_node_b(cluster: Cluster) -> None:
    asyncio.run(_saved_on_a_restored_on_b(cluster))


async def _saved_on_a_restored_on_b(cluster: Cluster) -> None:
    node_a = await cluster.start_node_a()
    kernel_id, ws = await node_a.open_notebook_kernel(cluster.kernel_ids, NOTEBOOK)
    await ws.execute(
        "import random, socket; random.seed(3); "
        "trained = {'epoch': 12, 'host': socket.gethostname()}"
    )
    ws.close()

    job = await node_a.api.succeeded(await node_a.api.save(kernel_id, stop=True))
    upload = job["result"]["upload"]
    assert upload["status"] == "uploaded", upload
    snapshot_id = job["snapshot_id"]
    listed = {s["id"]: s for s in await node_a.api.snapshots()}
    assert listed[snapshot_id]["location"] == "both", listed
    # Kept by content in the bucket too: node B fetches its pages, not whole images.
    uploaded = cluster.remote().get(snapshot_id)
    assert uploaded.chunked and uploaded.remote_manifest["packs"], uploaded.remote_manifest
    node_a.kill()  # node A is gone for good, its kernel with it
    assert kernel_processes(kernel_id) == []

    node_b = await cluster.start_node_b()
    # Node B starts empty: it knows the snapshot from the bucket only.
    (found,) = await node_b.api.snapshots()
    assert found["id"] == snapshot_id and found["location"] == "remote", found
    assert found["status"] == "ok" and found["notebook_path"] == NOTEBOOK
    latest = await node_b.api.snapshots(notebook_path=NOTEBOOK, latest="true")
    assert [s["id"] for s in latest] == [snapshot_id]

    new_id = await node_b.restore_into_notebook(snapshot_id, cluster.kernel_ids, NOTEBOOK)
    ws = await node_b.kernel(new_id)
    # Node A runs in this machine's namespaces: its hostname is this one's.
    assert (await ws.execute("print(trained['epoch'], trained['host'])")).split() == [
        "12", socket.gethostname(),
    ]
    # Its RNG state came along; it now runs on node B.
    expected = repr(random.Random(3).random())
    assert (await ws.execute("print(random.random())")).strip() == expected
    assert (await ws.execute("print(socket.gethostname())")).strip() == "node-b"
    # The magic in the restored kernel asks node B's server, and says where it lives.
    listing = await ws.execute("%gpu_snapshot list")
    rows = [line.split() for line in listing.splitlines()]
    assert any("LOCATION" in row for row in rows), listing
    assert any(snapshot_id in row and "both" in row for row in rows), listing
    ws.close()
    (found,) = await node_b.api.snapshots()
    assert found["location"] == "both", found

    # Deleting node B's copy only; the bucket keeps it, and it is listed as remote.
    await node_b.api.ok(
        "DELETE", "gpu-snapshot", "snapshots", snapshot_id, params={"where": "local"},
        expect=204,
    )
    (found,) = await node_b.api.snapshots()
    assert found["location"] == "remote", found
    await node_b.api.ok("DELETE", "gpu-snapshot", "snapshots", snapshot_id, expect=204)
    assert await node_b.api.snapshots() == []
    assert cluster.remote().list() == []


def test_node_b_refuses_a_snapshot_signed_with_another_key(cluster: Cluster) -> None:
    asyncio.run(_foreign_snapshot_refused(cluster))


async def _foreign_snapshot_refused(cluster: Cluster) -> None:
    # A well-formed snapshot, signed by a node whose key node B does not share.
    foreign = SnapshotStore(cluster.home / "foreign-store", cluster.home / "foreign.key")
    snapshot = make_snapshot(foreign, {"pages-1.img": 1 << 20}, name="planted")
    cluster.remote().upload(snapshot.path)

    node_b = await cluster.start_node_b()
    (found,) = await node_b.api.snapshots()
    assert found["id"] == snapshot.id and found["location"] == "remote", found
    assert found["status"] == "damaged" and "another key" in found["problem"], found
    kernels_before = await node_b.api.kernel_ids()

    job = await node_b.api.wait(await node_b.api.restore(snapshot.id, path=NOTEBOOK))
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["step"] == "verify", error
    assert "another key" in error["message"] and "signing_key_file" in error["hint"], error
    # Nothing ran and nothing was kept: no kernel, and the snapshot is still remote only.
    assert await node_b.api.kernel_ids() == kernels_before
    (found,) = await node_b.api.snapshots()
    assert found["location"] == "remote", found
    assert "nothing of it was fetched, run or kept" in error["message"]


GPU_STATE = """
import torch
x = torch.arange(20_000_000, device="cuda", dtype=torch.float32)
total = float(x.sum())
"""


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason() is not None, reason=f"GPU test: {no_gpu_reason()}")
def test_a_gpu_kernel_saved_on_node_a_comes_back_on_node_b(cluster: Cluster) -> None:
    asyncio.run(_gpu_kernel_on_b(cluster))


async def _gpu_kernel_on_b(cluster: Cluster) -> None:
    node_a = await cluster.start_node_a()
    kernel_id, ws = await node_a.open_notebook_kernel(cluster.kernel_ids, NOTEBOOK)
    await ws.execute(GPU_STATE, timeout=300)
    ws.close()
    job = await node_a.api.succeeded(await node_a.api.save(kernel_id, stop=True))
    assert job["result"]["upload"]["status"] == "uploaded", job["result"]["upload"]
    assert job["result"]["gpu"]["moved_bytes"] > 0, job["result"]["gpu"]
    node_a.kill()

    node_b = await cluster.start_node_b()
    (found,) = await node_b.api.snapshots()
    assert found["location"] == "remote", found
    new_id = await node_b.restore_into_notebook(found["id"], cluster.kernel_ids, NOTEBOOK)
    ws = await node_b.kernel(new_id)
    out = await ws.execute("print(float(x.sum()) == total, x.device)", timeout=120)
    assert out.split() == ["True", "cuda:0"], out
    ws.close()
