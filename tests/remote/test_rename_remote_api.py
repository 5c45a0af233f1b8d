"""PATCH snapshots/{id} on a server with a remote store: the remote copy takes the new name;
a remote-only snapshot, or a name a remote snapshot has, is refused; a remote that does not
answer leaves the local rename done and the response says the remote copy keeps its old
name. The server reaches SeaweedFS through a gate, shut to make it unreachable."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from testkit.network_gate import NetworkGate
from testkit.remote_snapshots import make_snapshot
from testkit.seaweed import SeaweedServer

from ..server.conftest import ServerProcesses
from .test_server_uploads import _on_servers, _server_env
from .test_upload_retry import _settings_through

SNAPSHOTS = ("gpu-snapshot", "snapshots")


def test_rename_over_rest_reaches_the_remote_copy_or_says_it_did_not(
    tmp_path: Path, seaweed: SeaweedServer, gate: NetworkGate, remote_url: str,
    s3_options: dict[str, Any], criu_path: str,
) -> None:
    key_file = tmp_path / "signing.key"
    env = _server_env(tmp_path, criu_path, snapshot_on_shutdown=False,
                      signing_key_file=str(key_file),
                      **_settings_through(gate, seaweed, remote_url))
    store = SnapshotStore(tmp_path / "snapshots", key_file)
    remote = RemoteStore(remote_url, s3_options)
    shared = make_snapshot(store, {"pages-1.img": 1 << 20}, name="shared")
    remote.upload(shared.path)
    elsewhere = make_snapshot(SnapshotStore(tmp_path / "node-b", key_file),
                              {"pages-1.img": 1 << 20}, name="from-node-b")
    remote.upload(elsewhere.path)
    gate.open()

    async def scenario(node: ServerProcesses) -> None:
        server = await node.start("rename")
        api = server.api

        renamed = await api.ok("PATCH", *SNAPSHOTS, shared.id, body={"name": "renamed"})
        assert renamed["name"] == "renamed", renamed
        assert renamed["remote_rename"]["status"] == "renamed", renamed
        names = {s.id: s.name for s in await asyncio.to_thread(remote.list)}
        assert names == {shared.id: "renamed", elsewhere.id: "from-node-b"}
        listed = {s["name"]: s["location"] for s in await api.snapshots()}
        assert listed == {"renamed": "both", "from-node-b": "remote"}, listed

        code, error = await api.call("PATCH", *SNAPSHOTS, elsewhere.id, body={"name": "x"})
        assert code == 400 and f"exists only in {remote_url}" in error["message"], error
        assert f"gpu-snapshot download {elsewhere.id}" in error["message"], error
        code, error = await api.call(
            "PATCH", *SNAPSHOTS, shared.id, body={"name": "from-node-b"}
        )
        assert code == 400 and f"exists already in {remote_url}" in error["message"], error

        gate.shut()  # the remote store cannot be reached
        # The answer comes once every retry failed: s3fs's, inside the store's own, for the
        # listing and the rename. That takes longer than a client's default timeout.
        local = await api.ok("PATCH", *SNAPSHOTS, shared.id, body={"name": "offline"},
                             request_timeout=300)
        assert local["name"] == "offline", local
        outcome = local["remote_rename"]
        assert outcome["status"] == "failed", outcome
        message = outcome["error"]["message"]
        assert f"its copy in {remote_url} keeps its old name" in message, message
        assert "rename it to 'offline' again once" in message.lower(), message
        assert store.get("offline").id == shared.id
        assert f"renamed to 'offline' here, but its copy in {remote_url}" in server.log

        gate.open()
        again = await api.ok("PATCH", *SNAPSHOTS, shared.id, body={"name": "offline"})
        assert again["remote_rename"]["status"] == "renamed", again
        names = {s.id: s.name for s in await asyncio.to_thread(remote.list)}
        assert names[shared.id] == "offline"

    _on_servers(tmp_path, env, scenario)
