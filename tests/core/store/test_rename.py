"""Renaming a snapshot: the manifest is re-signed and replaced atomically, under the
snapshot's and the new name's locks; the name is checked as a save checks it; nothing but
what this node signed is ever re-signed."""

from __future__ import annotations

import json

import pytest

from jupyter_gpu_snapshot.core.errors import Busy, InvalidRequest, NotFound, SnapshotError
from jupyter_gpu_snapshot.core.locks import name_key, snapshot_key
from tests.core.store.test_store import _commit, _manifest, _rewrite, _store


def test_rename_re_signs_the_manifest_and_keeps_everything_else(tmp_path):
    store = _store(tmp_path)
    snapshot_id = _commit(store, "before")
    old = _manifest(store, snapshot_id)

    renamed = store.rename("before", "after")

    assert renamed.id == snapshot_id and renamed.name == "after" and renamed.trusted
    new = _manifest(store, snapshot_id)
    assert new["name"] == "after" and new["signature"] != old["signature"]
    unchanged = {k: v for k, v in old.items() if k not in ("name", "signature")}
    assert {k: v for k, v in new.items() if k not in ("name", "signature")} == unchanged
    assert store.key.problem(new) is None
    store.verify(store.get("after"))  # the images still match the re-signed manifest
    assert [s.name for s in store.list()] == ["after"]
    with pytest.raises(NotFound):
        store.get("before")
    # Nothing of the rename is left in the snapshot's directory.
    assert sorted(p.name for p in (tmp_path / "s" / snapshot_id).iterdir()) == [
        "manifest.json", "pages-1.img"
    ]


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".x", "x.", "x" * 65])
def test_an_invalid_name_is_refused_and_changes_nothing(tmp_path, bad):
    store = _store(tmp_path)
    snapshot_id = _commit(store, "kept")
    before = _manifest(store, snapshot_id)
    with pytest.raises(InvalidRequest, match="invalid snapshot name"):
        store.rename(snapshot_id, bad)
    assert _manifest(store, snapshot_id) == before


def test_a_taken_name_is_refused(tmp_path):
    store = _store(tmp_path)
    first = _commit(store, "first")
    _commit(store, "second")
    with pytest.raises(InvalidRequest, match="exists already"):
        store.rename(first, "second")
    assert store.get(first).name == "first"
    # Renaming to its own name is no change.
    assert store.rename(first, "first").name == "first"


@pytest.mark.parametrize("lock", ["snapshot", "name"])
def test_busy_while_another_operation_holds_the_snapshot_or_the_name(tmp_path, lock):
    store = _store(tmp_path)
    snapshot_id = _commit(store, "held")
    key = snapshot_key(snapshot_id) if lock == "snapshot" else name_key("wanted")
    with store.locks.hold(key, "test", "test", note="restore"), pytest.raises(Busy):
        store.rename(snapshot_id, "wanted")
    assert store.get(snapshot_id).name == "held"


def test_a_tampered_manifest_is_never_re_signed(tmp_path):
    store = _store(tmp_path)
    snapshot_id = _commit(store, "victim")
    manifest = _manifest(store, snapshot_id)
    manifest["kernel"]["argv"] = ["/bin/sh", "-c", "evil"]
    _rewrite(store, snapshot_id, manifest)  # signature no longer matches
    with pytest.raises(SnapshotError):
        store.rename(snapshot_id, "laundered")
    assert json.loads((tmp_path / "s" / snapshot_id / "manifest.json").read_text()) == manifest


def test_cli_rename(tmp_path):
    from jupyter_gpu_snapshot._constants import ENV_SIGNING_KEY
    from tests.cli.test_cli import cli

    store = _store(tmp_path)
    snapshot_id = _commit(store, "cli-before")
    env = {ENV_SIGNING_KEY: str(tmp_path / "keys" / "signing.key"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    out = cli(store.root, "rename", "cli-before", "cli-after", env=env)
    assert f"renamed cli-before to cli-after ({snapshot_id})" in out.stdout
    assert store.get("cli-after").id == snapshot_id
    refused = cli(store.root, "rename", "cli-after", "bad/name", env=env, check=False)
    assert refused.returncode != 0 and "invalid snapshot name" in refused.stderr
