"""A rename reaches the remote copy: the re-signed manifest goes up under a new object, then
the remote manifest that points to it; another node sees the old name or the new one, never
a mix. A remote-only snapshot is refused; a remote that does not answer leaves the local
rename done and says what to do."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot._constants import ENV_REMOTE_URL, ENV_SIGNING_KEY
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import MANIFEST
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from jupyter_gpu_snapshot.core.store.remote.objects import REMOTE_MANIFEST
from jupyter_gpu_snapshot.node.local_engine import LocalEngine
from jupyter_gpu_snapshot.node.snapshots import Found, NodeSnapshots
from jupyter_gpu_snapshot.server.remote_sync import RemoteSync
from testkit.remote_snapshots import make_snapshot
from testkit.seaweed import SeaweedServer


def _objects(remote: RemoteStore, snapshot_id: str) -> list[str]:
    remote.fs.invalidate_cache()
    return sorted(str(p).rsplit("/", 1)[-1] for p in remote.fs.find(remote.path(snapshot_id)))


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_a_rename_reaches_the_remote_copy_and_node_b_restores_it_by_the_new_name(
    tmp_path: Path, remote_url: str, s3_options: dict[str, Any], encrypted: bool
) -> None:
    key = os.urandom(32) if encrypted else None
    store_a = SnapshotStore(tmp_path / "node-a", tmp_path / "shared.key")
    remote_a = RemoteStore(remote_url, s3_options, key=key)
    snapshot = make_snapshot(store_a, {"pages-1.img": 3 << 20}, name="before")
    remote_a.upload(snapshot.path)
    old_remote = remote_a.read_remote_manifest(snapshot.id)
    assert old_remote is not None

    renamed = store_a.rename("before", "after")
    copy = remote_a.rename_copy(renamed.path)

    assert copy is not None and copy.name == "after"
    remote_b = RemoteStore(remote_url, dict(s3_options), key=key)
    assert [s.name for s in remote_b.list()] == ["after"]
    # A reader that read the remote manifest before the rename still gets the old,
    # whole manifest: the old object stays until the next rename.
    before = json.loads(remote_b.fetch_object(snapshot.id, old_remote, MANIFEST))
    assert before["name"] == "before"
    store_b = SnapshotStore(tmp_path / "node-b", tmp_path / "shared.key")
    remote_b.download(snapshot.id, store_b)
    downloaded = store_b.get("after")
    assert downloaded.trusted and downloaded.id == snapshot.id
    store_b.verify(downloaded)
    assert (store_b.root / snapshot.id / MANIFEST).read_bytes() == (
        renamed.path / MANIFEST
    ).read_bytes()

    # A second rename removes the manifest object two renames back, and no more.
    first_object = copy.remote_manifest["objects"][MANIFEST]["object"]
    again = remote_a.rename_copy(store_a.rename("after", "again").path)
    assert again is not None and again.name == "again"
    second_object = again.remote_manifest["objects"][MANIFEST]["object"]
    assert _objects(remote_a, snapshot.id) == sorted(
        [first_object, second_object, "pages-1.img.chunks", REMOTE_MANIFEST]  # its recipe
    )
    assert [s.name for s in remote_b.list()] == ["again"]


def test_node_b_s_listing_shows_the_new_name(
    tmp_path: Path, remote_url: str, s3_options: dict[str, Any]
) -> None:
    async def scenario() -> None:
        store_a = SnapshotStore(tmp_path / "node-a", tmp_path / "shared.key")
        store_b = SnapshotStore(tmp_path / "node-b", tmp_path / "shared.key")
        node_a = NodeSnapshots(LocalEngine(store_a), RemoteStore(remote_url, s3_options))
        sync_a = RemoteSync(node_a)
        sync_b = RemoteSync(NodeSnapshots(LocalEngine(store_b),
                                          RemoteStore(remote_url, dict(s3_options))))
        snapshot = make_snapshot(store_a, {"pages-1.img": 1 << 20}, name="before")
        assert (await sync_a.upload(snapshot, lambda _p: None, ()))["status"] == "uploaded"
        assert (await sync_b.listing(fresh=True)).snapshots[snapshot.id].name == "before"

        _, outcome = node_a.rename(Found(snapshot, True), "after")

        assert outcome["status"] == "renamed", outcome
        listed = (await sync_b.listing(fresh=True)).snapshots[snapshot.id]
        assert listed.name == "after" and listed.trusted
        # A snapshot never uploaded has no remote copy to rename.
        local_only = make_snapshot(store_a, {"pages-1.img": 1 << 10}, name="here")
        _, outcome = node_a.rename(Found(local_only, True), "still-here")
        assert outcome is not None and outcome["status"] == "none"

    asyncio.run(scenario())


def _cli(env: dict[str, str], store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )


def _env(seaweed: SeaweedServer, url: str, key_file: Path, endpoint: str = "") -> dict[str, str]:
    options = seaweed.storage_options()
    return {
        ENV_REMOTE_URL: url,
        ENV_SIGNING_KEY: str(key_file),
        "AWS_ENDPOINT_URL": endpoint or seaweed.endpoint_url,
        "AWS_ACCESS_KEY_ID": str(options["key"]),
        "AWS_SECRET_ACCESS_KEY": str(options["secret"]),
        "AWS_MAX_ATTEMPTS": "1",
    }


def test_cli_rename_renames_the_remote_copy_and_refuses_a_remote_only_one(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    key_file = tmp_path / "signing.key"
    env = _env(seaweed, remote_url, key_file)
    store_a = SnapshotStore(tmp_path / "node-a", key_file)
    snapshot = make_snapshot(store_a, {"pages-1.img": 1 << 20}, name="before")
    assert _cli(env, store_a.root, "upload", "before").returncode == 0

    done = _cli(env, store_a.root, "rename", "before", "after")
    assert done.returncode == 0, done.stderr
    assert f"renamed its copy in {remote_url}" in done.stdout
    assert [s.name for s in RemoteStore(remote_url, s3_options).list()] == ["after"]

    refused = _cli(env, tmp_path / "node-b", "rename", snapshot.id, "elsewhere")
    assert refused.returncode == 2
    assert f"exists only in {remote_url}" in refused.stderr
    assert f"gpu-snapshot download {snapshot.id}" in refused.stderr
    assert [s.name for s in RemoteStore(remote_url, s3_options).list()] == ["after"]


def test_cli_rename_with_the_remote_unreachable_renames_here_and_says_what_to_do(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    key_file = tmp_path / "signing.key"
    store_a = SnapshotStore(tmp_path / "node-a", key_file)
    snapshot = make_snapshot(store_a, {"pages-1.img": 1 << 20}, name="before")
    RemoteStore(remote_url, s3_options).upload(snapshot.path)
    # Nothing listens on this port: the remote store cannot be reached.
    unreachable = _env(seaweed, remote_url, key_file, endpoint="http://127.0.0.1:9")

    result = _cli(unreachable, store_a.root, "rename", "before", "after")

    assert result.returncode == 1, result.stderr
    assert store_a.get("after").id == snapshot.id  # the local rename is done
    message = " ".join(result.stderr.split())
    assert f"its copy in {remote_url} keeps its old name" in message, message
    assert f"Run 'jupyter gpu-snapshot rename {snapshot.id} after' again" in message, message
    assert [s.name for s in RemoteStore(remote_url, s3_options).list()] == ["before"]

    # Once the remote answers, the same command renames the remote copy too.
    again = _cli(_env(seaweed, remote_url, key_file), store_a.root, "rename", snapshot.id,
                 "after")
    assert again.returncode == 0, again.stderr
    assert [s.name for s in RemoteStore(remote_url, s3_options).list()] == ["after"]
