"""A snapshot whose upload failed is uploaded again without anyone asking: at the next server
start and after the next save whose upload succeeded, one at a time, as ``upload`` jobs.

The server reaches the S3 server through a gate that drops every connection while it is
shut, as a remote store that is down or out of reach; opening it brings the remote back.
Snapshots kept local on purpose (never owed an upload) stay local.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote.pending import PendingUploads
from testkit.network_gate import NetworkGate
from testkit.remote_snapshots import make_snapshot
from testkit.seaweed import SeaweedServer

from ..server.conftest import ServerProcess, ServerProcesses
from .test_server_uploads import NOTEBOOK, _on_servers, _remote_settings, _server_env


def _settings_through(gate: NetworkGate, seaweed: SeaweedServer, url: str) -> dict[str, Any]:
    settings = _remote_settings(seaweed, url)
    settings["remote_endpoint_url"] = gate.url
    # One try per call: a shut gate fails an upload in seconds.
    settings["remote_options"]["config_kwargs"] = {
        "retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 20,
    }
    return settings


async def _jobs(server: ServerProcess, kind: str) -> list[dict[str, Any]]:
    data = await server.api.ok("GET", "gpu-snapshot", "jobs")
    return [j for j in data["jobs"] if j["kind"] == kind]


async def _until(what: str, check: Any, server: ServerProcess, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not in {timeout} s\n{server.log}"
        await asyncio.sleep(0.3)


async def _locations(server: ServerProcess) -> dict[str, str]:
    return {s["name"]: s["location"] for s in await server.api.snapshots()}


def test_an_owed_upload_goes_up_at_the_next_server_start(
    tmp_path: Path, seaweed: SeaweedServer, gate: NetworkGate, remote_url: str, criu_path: str
) -> None:
    key_file = tmp_path / "signing.key"
    settings = _settings_through(gate, seaweed, remote_url)
    env = _server_env(tmp_path, criu_path, snapshot_on_shutdown=False,
                      signing_key_file=str(key_file), **settings)
    store = SnapshotStore(tmp_path / "snapshots", key_file)
    owed = make_snapshot(store, {"pages-1.img": 2 << 20}, name="owed")
    PendingUploads(store).mark(owed.id)  # as a save whose upload failed leaves it
    make_snapshot(store, {"pages-1.img": 1 << 20}, name="kept-here")
    images = {p.name: p.read_bytes() for p in owed.path.iterdir()}

    async def scenario(node: ServerProcesses) -> None:
        first = await node.start("retry-1")
        failed = await _until(
            "a failed upload job", lambda: _failed_upload_jobs(first), first
        )
        assert failed[0]["snapshot_id"] == owed.id and failed[0]["kernel_id"] is None
        assert remote_url in failed[0]["error"]["message"], failed[0]
        assert (await _locations(first))["owed"] == "local"
        assert PendingUploads(store).ids() == [owed.id]
        first.kill()

        gate.open()  # the remote store is back
        second = await node.start("retry-2")

        async def uploaded() -> bool:
            return (await _locations(second)).get("owed") == "both"

        await _until("owed listed as both", uploaded, second)
        (job,) = await _jobs(second, "upload")
        assert job["status"] == "succeeded" and job["snapshot_id"] == owed.id, job
        assert (await _locations(second))["kept-here"] == "local"
        assert PendingUploads(store).ids() == []
        assert f"uploading {owed.id} to {remote_url} again" in second.log
        # The local copy is as it was.
        assert {p.name: p.read_bytes() for p in owed.path.iterdir()} == images

    _on_servers(tmp_path, env, scenario)


async def _failed_upload_jobs(server: ServerProcess) -> list[dict[str, Any]]:
    return [j for j in await _jobs(server, "upload") if j["status"] == "failed"]


def test_an_owed_upload_goes_up_after_the_next_save_whose_upload_succeeds(
    tmp_path: Path, seaweed: SeaweedServer, gate: NetworkGate, remote_url: str, criu_path: str
) -> None:
    settings = _settings_through(gate, seaweed, remote_url)
    env = _server_env(tmp_path, criu_path, snapshot_on_shutdown=False, **settings)
    _on_servers(tmp_path, env, lambda node: _retried_after_a_save(node, gate))


async def _retried_after_a_save(node: ServerProcesses, gate: NetworkGate) -> None:
    server = await node.start("retry-save")
    kernel_id, ws = await server.open_notebook_kernel(node.kernel_ids, NOTEBOOK)
    await ws.execute("state = 1")
    job = await server.api.succeeded(await server.api.save(kernel_id, name="first"))
    assert job["result"]["upload"]["status"] == "failed", job["result"]

    gate.open()  # the remote store is back
    job = await server.api.succeeded(await server.api.save(kernel_id, name="second"))
    assert job["result"]["upload"]["status"] == "uploaded", job["result"]["upload"]

    async def both() -> bool:
        return await _locations(server) == {"first": "both", "second": "both"}

    await _until("first listed as both", both, server)
    (retry,) = await _jobs(server, "upload")
    assert retry["status"] == "succeeded" and retry["reason"] == "retry", retry
    assert (await ws.execute("print(state)")).strip() == "1"
    ws.close()
