"""A shared-filesystem path as the remote store: fsspec's local filesystem, no S3 at all."""

from __future__ import annotations

import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore, RemoteStoreError
from testkit.remote_snapshots import make_snapshot, tree_bytes

MiB = 1 << 20


@pytest.mark.parametrize("key", [None, bytes(range(32))], ids=["plain", "encrypted"])
def test_shared_path_round_trip(tmp_path, key):
    shared = tmp_path / "shared" / "snapshots"
    local = SnapshotStore(tmp_path / "a")
    # Larger than a part: streamed through fs.open in parts rather than put whole.
    snap = make_snapshot(local, {"pages-1.img": 3 * MiB + 5, "core-1.img": 10})
    RemoteStore(str(shared), key=key, part_bytes=MiB).upload(snap.path)
    assert (shared / snap.id / "remote-manifest.json").is_file()
    assert (shared / snap.id).stat().st_mode & 0o777 == 0o700

    node_b = RemoteStore(f"file://{shared}", key=key)
    assert [s.id for s in node_b.list()] == [snap.id]
    path = node_b.download(snap.id, tmp_path / "b")
    assert tree_bytes(path) == tree_bytes(snap.path)

    (shared / snap.id / "pages-1.img").write_bytes(b"short")
    with pytest.raises(RemoteStoreError, match=r"pages-1\.img has 5 bytes"):
        node_b.download(snap.id, tmp_path / "c")
    node_b.delete(snap.id)
    assert node_b.list() == [] and not (shared / snap.id).exists()


def test_empty_shared_path_lists_nothing(tmp_path):
    assert RemoteStore(str(tmp_path / "nothing-here")).list() == []


@pytest.mark.parametrize("key", [None, bytes(range(32))], ids=["plain", "encrypted"])
def test_shared_path_keeps_pages_by_content(tmp_path, key):
    shared = tmp_path / "shared" / "snapshots"
    local = SnapshotStore(tmp_path / "a")
    snap = make_snapshot(local, {"pages-1.img": 3 * MiB, "core-1.img": 10})
    # Larger than a part: the pack streams through fs.open in parts.
    uploaded = RemoteStore(str(shared), key=key, part_bytes=MiB).upload(snap.path, local=local)
    assert uploaded.chunked
    assert (shared / "packs").stat().st_mode & 0o777 == 0o700
    store_b = SnapshotStore(tmp_path / "b")
    path = RemoteStore(f"file://{shared}", key=key).download(snap.id, store_b)
    assert (path / "pages-1.img.chunks").is_file() and not (path / "pages-1.img").exists()
    store_b.verify(store_b.get(snap.id))
