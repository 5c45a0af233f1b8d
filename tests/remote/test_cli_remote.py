"""The CLI with a remote store: upload, where each snapshot lives, and deletes on either side.

Two stores stand for two nodes that share the signing key and the bucket; the CLI reaches
the bucket through the environment, as a node configured by its operator does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot._constants import ENV_REMOTE_URL, ENV_SIGNING_KEY
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from testkit.remote_snapshots import make_snapshot, tree_bytes
from testkit.seaweed import SeaweedServer

from ..conftest import KernelHandle, RestoredTrees, execute


def _cli(env: dict[str, str], store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return out


def _locations(env: dict[str, str], store: Path) -> dict[str, str]:
    listing: list[dict[str, Any]] = json.loads(_cli(env, store, "list", "--json").stdout)
    return {s["name"]: s["location"] for s in listing}


def _env(
    seaweed: SeaweedServer, url: str, s3_options: dict[str, Any], key_file: Path
) -> dict[str, str]:
    return {
        ENV_REMOTE_URL: url,
        ENV_SIGNING_KEY: str(key_file),
        "AWS_ENDPOINT_URL": seaweed.endpoint_url,
        "AWS_ACCESS_KEY_ID": str(s3_options["key"]),
        "AWS_SECRET_ACCESS_KEY": str(s3_options["secret"]),
    }


def test_cli_uploads_lists_locations_and_deletes_each_side(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    key_file = tmp_path / "signing.key"
    env = _env(seaweed, remote_url, s3_options, key_file)
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    store_a = SnapshotStore(node_a, key_file)
    shared = make_snapshot(store_a, {"pages-1.img": 3 << 20}, name="shared")
    make_snapshot(store_a, {"pages-1.img": 1 << 20}, name="only-here")

    _cli(env, node_a, "upload", "shared")
    assert _locations(env, node_a) == {"shared": "both", "only-here": "local"}
    # Node B has an empty store: it sees the uploaded one only, as remote.
    assert _locations(env, node_b) == {"shared": "remote"}
    human = _cli(env, node_b, "list").stdout.splitlines()
    assert "LOCATION" in human[0].split() and "remote" in human[1].split()

    _cli(env, node_a, "rm", "--where", "local", "shared")
    assert _locations(env, node_a) == {"shared": "remote", "only-here": "local"}
    _cli(env, node_b, "rm", shared.id)  # both sides: here, only the remote one
    assert _locations(env, node_a) == {"only-here": "local"}
    assert RemoteStore(remote_url, s3_options).list() == []


def test_cli_restore_downloads_a_remote_only_snapshot_first(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path,
    kernel: KernelHandle, restored: RestoredTrees,
) -> None:
    key_file = tmp_path / "signing.key"
    env = _env(seaweed, remote_url, s3_options, key_file)
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    kernel.execute("state = {'epoch': 7}")
    _cli(env, node_a, "save", "--pid", str(kernel.kernel_pid), "--name", "moving", "--stop")
    _cli(env, node_a, "upload", "moving")
    assert _locations(env, node_b) == {"moving": "remote"}

    result = json.loads(_cli(env, node_b, "restore", "moving", "--json").stdout)

    client = restored.connect(Path(result["connection_file"]), result["pid"])
    assert "{'epoch': 7}" in execute(client, "print(state)")
    assert _locations(env, node_b) == {"moving": "both"}
    SnapshotStore(node_b, key_file).verify(SnapshotStore(node_b, key_file).get("moving"))


def test_cli_restore_refuses_a_foreign_remote_snapshot_before_fetching_it(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    foreign = make_snapshot(
        SnapshotStore(tmp_path / "elsewhere", tmp_path / "other.key"), {"pages-1.img": 1 << 20},
        name="planted",
    )
    RemoteStore(remote_url, s3_options).upload(foreign.path)
    env = _env(seaweed, remote_url, s3_options, tmp_path / "signing.key")
    node_b = tmp_path / "node-b"

    for command in ("restore", "download"):
        refused = subprocess.run(
            [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(node_b),
             command, foreign.id],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )
        assert refused.returncode == 2, refused.stderr
        message = " ".join(refused.stderr.split())
        assert "is refused, nothing of it was fetched" in message, message
        assert "another key" in message, message
        assert not node_b.exists() or not any(node_b.iterdir())


def test_cli_download_fetches_into_the_store_without_restoring(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    key_file = tmp_path / "signing.key"
    env = _env(seaweed, remote_url, s3_options, key_file)
    shared = make_snapshot(SnapshotStore(tmp_path / "node-a", key_file),
                           {"pages-1.img": 3 << 20}, name="shared")
    RemoteStore(remote_url, s3_options).upload(shared.path)
    node_b = tmp_path / "node-b"

    out = _cli(env, node_b, "download", "shared")

    assert f"shared ({shared.id}) is in {node_b}" in out.stdout
    assert _locations(env, node_b) == {"shared": "both"}
    assert tree_bytes(node_b / shared.id) == tree_bytes(shared.path)


def test_cli_restore_names_a_remote_store_that_does_not_answer(
    seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    env = _env(seaweed, remote_url, s3_options, tmp_path / "signing.key")
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1")  # nothing there
    refused = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(tmp_path / "b"),
         "restore", "somewhere"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    assert refused.returncode == 2, refused.stderr
    message = " ".join(refused.stderr.split())
    assert f"and {remote_url} could not be asked" in message, message
    assert "Traceback" not in refused.stderr
