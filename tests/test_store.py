"""The store on its own: atomic publication, listing, names, stale directories, checksums."""

from __future__ import annotations

import json
import os

import pytest

from jupyter_gpu_snapshot.core.errors import InvalidRequest, NotFound, SnapshotError
from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.store import (
    TREE_CHUNK,
    SnapshotStore,
    new_snapshot_id,
    sha256_file,
    validate_name,
)


def _commit(store: SnapshotStore, name: str, payload: bytes = b"x" * 1000) -> str:
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    (partial / "pages-1.img").write_bytes(payload)
    store.commit(partial, {"id": snapshot_id, "name": name, "created": 1.0, "kernel": {}})
    return snapshot_id


def test_partial_directories_are_never_listed(tmp_path):
    store = SnapshotStore(tmp_path / "s")
    partial = store.begin(new_snapshot_id())
    (partial / "pages-1.img").write_bytes(b"half")
    assert store.list() == []
    done = _commit(store, "done")
    assert [s.id for s in store.list()] == [done]


def test_stale_partials_of_dead_processes_are_cleaned(tmp_path):
    store = SnapshotStore(tmp_path / "s")
    mine_id = new_snapshot_id()
    with store.locks.hold(snapshot_key(mine_id), "mine", "test"):
        mine = store.begin(mine_id)
        # A save whose process died before its dump began (no draft): nothing to keep.
        stale = store.begin(new_snapshot_id())
        removed = store.clean_stale()
        assert removed == [stale] and mine.exists()


def test_lookup_by_name_and_id_and_delete(tmp_path):
    store = SnapshotStore(tmp_path / "s")
    first = _commit(store, "first")
    assert store.get("first").id == first
    assert store.get(first).name == "first"
    store.delete("first")
    with pytest.raises(NotFound):
        store.get(first)


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/b", "", ".x", "x.", "a..b", "é", "x" * 65])
def test_invalid_names(bad):
    with pytest.raises(InvalidRequest):
        validate_name(bad)


def test_manifest_format_and_checksums(tmp_path):
    store = SnapshotStore(tmp_path / "s")
    snapshot = store.get(_commit(store, "m"))
    manifest = json.loads((snapshot.path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["files"]["pages-1.img"]["size"] == 1000
    store.verify(snapshot)
    (snapshot.path / "stray").write_text("?")
    with pytest.raises(SnapshotError, match="unexpected files"):
        store.verify(snapshot)


def test_large_files_hash_by_chunks_and_any_byte_counts(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(TREE_CHUNK * 2 + 123)
    before = sha256_file(big)
    with open(big, "r+b") as f:
        f.seek(TREE_CHUNK + 7)
        f.write(b"\x01")
    assert sha256_file(big) != before
    assert len(before) == 64 and os.path.getsize(big) == TREE_CHUNK * 2 + 123
