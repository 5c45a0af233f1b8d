"""The remote store keeps pages by content, against a real S3 server (SeaweedFS).

Two saves of one kernel share most of their pages, at other offsets. The second upload
sends only its new pages; node B (its own store, the same signing key) fetches only the
pages it lacks, and gets chunked snapshots that its store assembles and checks as its own.
Each scenario runs with encryption off and on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.packs import (
    CHUNKS_DIR,
    ID_BYTES,
    IDS_SUFFIX,
    PAGE,
    ids_in_order,
)
from jupyter_gpu_snapshot.core.store.remote import RemoteStore, RemoteStoreError
from jupyter_gpu_snapshot.core.store.remote import upload as upload_module
from jupyter_gpu_snapshot.core.store.remote.objects import REMOTE_MANIFEST
from jupyter_gpu_snapshot.core.store.remote.packs import PACKS_DIR, RECORD_BYTES, RemotePacks
from jupyter_gpu_snapshot.core.store.remote.pages import PageUpload
from jupyter_gpu_snapshot.core.store.remote.sealing import RECORD_OVERHEAD
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from testkit.remote_snapshots import kill_upload_midway, make_snapshot

KEY = bytes(range(32))
MARKER = b"PLAINTEXT-MARKER-0123456789abcdef"


def _pages(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    pages = [rng.bytes(PAGE) for _ in range(count)]
    pages[0] = MARKER * (PAGE // len(MARKER)) + bytes(PAGE % len(MARKER))
    return pages


def _image(pages: list[bytes], zero_pages: int) -> bytes:
    return b"".join(pages) + bytes(zero_pages * PAGE)


@pytest.fixture(params=["plain", "sealed"])
def key(request: pytest.FixtureRequest) -> bytes | None:
    return KEY if request.param == "sealed" else None


def _remote(url: str, options: dict[str, Any], key: bytes | None, **kwargs: Any) -> RemoteStore:
    return RemoteStore(url, options, key=key, part_bytes=5 << 20, **kwargs)


def _pack_objects(remote: RemoteStore) -> dict[str, int]:
    """The pack objects in the bucket (name → size), straight from the S3 API."""
    bucket, prefix, _ = remote.fs.split_path(f"{remote.root}/{PACKS_DIR}")
    reply = remote.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"].rsplit("/", 1)[-1]: int(o["Size"]) for o in reply.get("Contents", [])}


def _stored(pages: int, sealed: bool) -> int:
    """What a pack of ``pages`` pages takes in the bucket."""
    plain = pages * PAGE
    return plain + (-(-plain // RECORD_BYTES)) * RECORD_OVERHEAD if sealed else plain


def _local_pack_pages(store: SnapshotStore) -> list[int]:
    packs = sorted((store.root / CHUNKS_DIR).glob(f"*{IDS_SUFFIX}"))
    return [p.stat().st_size // ID_BYTES for p in packs]


def _counting_reads(remote: RemoteStore) -> list[int]:
    """Count the bytes each read of a pack object brings (ranged GETs)."""
    fetched: list[int] = []
    cat_file = remote.fs.cat_file

    def counted(path: str, *args: Any, **kwargs: Any) -> bytes:
        data: bytes = cat_file(path, *args, **kwargs)
        if str(path).endswith(".pack"):
            fetched.append(len(data))
        return data

    remote.fs.cat_file = counted
    return fetched


def _two_saves(store: SnapshotStore) -> tuple[Snapshot, Snapshot, int]:
    """Two saves of one kernel: the second has its pages at other offsets, 40 new ones
    and more zero pages. Returns both and the number of new pages."""
    first = _pages(1500, seed=1)
    new = _pages(40, seed=2)[1:]
    second = new[:20] + first[700:] + new[20:] + first[:700]
    snap1 = make_snapshot(store, {"pages-1.img": _image(first, 300), "core-1.img": 777})
    snap2 = make_snapshot(store, {"pages-1.img": _image(second, 500), "core-1.img": 778})
    return snap1, snap2, len(new)


def _assembled(store: SnapshotStore, snapshot_id: str) -> bytes:
    snapshot = store.get(snapshot_id)
    store.verify(snapshot)  # assembles the files from the packs and checks every digest
    with store.opened_images(snapshot) as (directory, _):
        return (directory / "pages-1.img").read_bytes()


def test_second_upload_sends_only_new_pages_and_node_b_fetches_only_what_it_lacks(
    remote_url, s3_options, tmp_path, key
):
    sealed = key is not None
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, snap2, new_pages = _two_saves(store_a)
    assert (snap1.path / "pages-1.img.chunks").is_file()
    remote_a = _remote(remote_url, s3_options, key)

    remote_a.upload(snap1.path, local=store_a)
    after_first = _pack_objects(remote_a)
    assert sum(after_first.values()) == _stored(1500, sealed) + 1500 * 16 + (
        RECORD_OVERHEAD if sealed else 0)
    sent: list[tuple[int, int]] = []
    uploaded = remote_a.upload(snap2.path, lambda d, t: sent.append((d, t)), local=store_a)
    new_objects = {n: s for n, s in _pack_objects(remote_a).items() if n not in after_first}
    # One new pack and its ids: the 39 new pages only.
    assert sorted(new_objects.values()) == sorted([
        _stored(new_pages, sealed), new_pages * 16 + (RECORD_OVERHEAD if sealed else 0)])
    assert uploaded.remote_manifest["new_page_bytes"] == new_pages * PAGE
    assert uploaded.chunked and len(uploaded.remote_manifest["packs"]) == 2
    assert uploaded.size_bytes == snap2.manifest["files"]["pages-1.img"]["size"] + 778 + len(
        (snap2.path / "manifest.json").read_bytes())
    assert sent[-1][0] == sent[-1][1]
    # No object name is a digest of content: packs have random names.
    for name in _pack_objects(remote_a):
        stem = name.rsplit(".", 1)[0]
        assert stem.endswith(RemotePacks(remote_a).key_id or "") if sealed else "." not in stem
    if sealed:
        every = b"".join(remote_a.fs.cat_file(f"{remote_a.root}/{PACKS_DIR}/{n}")
                         for n in _pack_objects(remote_a))
        assert MARKER not in every
        ids = (snap1.path / "pages-1.img.chunks").read_bytes()
        assert ids[16:48] not in every  # the ids are sealed too

    # Node B: its own store, the same signing key (the default key file).
    store_b = SnapshotStore(tmp_path / "node-b")
    remote_b = _remote(remote_url, s3_options, key)
    fetched = _counting_reads(remote_b)
    remote_b.download(snap1.id, store_b)
    assert _local_pack_pages(store_b) == [1500]
    # Its new pack holds the pages in the file's order: assembling copies long runs.
    (ids_file,) = (store_b.root / CHUNKS_DIR).glob(f"*{IDS_SUFFIX}")
    recipe = (snap1.path / "pages-1.img.chunks").read_bytes()
    assert ids_file.read_bytes() == ids_in_order([recipe]).tobytes()
    first_fetch = sum(fetched)
    assert _stored(1500, sealed) <= first_fetch <= _stored(1500, sealed) + RECORD_BYTES
    fetched.clear()
    remote_b.download(snap2.id, store_b)
    # Only the new pages came, in whole records when sealed.
    assert sorted(_local_pack_pages(store_b)) == [new_pages, 1500]
    assert _stored(new_pages, sealed) <= sum(fetched) <= _stored(
        new_pages, sealed) + 2 * (RECORD_BYTES + RECORD_OVERHEAD)
    assert sorted(p.name for p in (store_b.root / snap2.id).iterdir()) == [
        "core-1.img", "manifest.json", "pages-1.img.chunks"]
    for snap in (snap1, snap2):
        assert _assembled(store_b, snap.id) == _assembled(store_a, snap.id)
    assert [p.name for p in store_b.root.iterdir() if p.name.startswith(".partial")] == []
    # A collection on node B keeps what its downloaded snapshots need.
    store_b.collect_garbage()
    assert _assembled(store_b, snap2.id) == _assembled(store_a, snap2.id)


def test_a_whole_file_remote_snapshot_still_comes_down(remote_url, s3_options, tmp_path, key):
    old = SnapshotStore(tmp_path / "node-a", chunk_images=False)
    snap = make_snapshot(old, {"pages-1.img": _image(_pages(400, 3), 10)})
    remote = _remote(remote_url, s3_options, key)
    uploaded = remote.upload(snap.path)
    assert not uploaded.chunked and uploaded.remote_manifest["remote_format"] == 1
    store_b = SnapshotStore(tmp_path / "node-b")
    path = remote.download(snap.id, store_b)
    assert (path / "pages-1.img").read_bytes() == (snap.path / "pages-1.img").read_bytes()
    store_b.verify(store_b.get(snap.id))


def test_a_failure_before_the_manifest_leaves_nothing_listed(
    remote_url, s3_options, tmp_path, key, monkeypatch
):
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, snap2, _ = _two_saves(store_a)
    remote = _remote(remote_url, s3_options, key)
    remote.upload(snap1.path, local=store_a)
    before = _pack_objects(remote)

    def refused(self: Any, remote_manifest: dict[str, Any]) -> None:
        raise OSError("the network went away")

    monkeypatch.setattr(upload_module._Upload, "_put_remote_manifest", refused)
    with pytest.raises(RemoteStoreError, match="network went away"):
        remote.upload(snap2.path, local=store_a)
    monkeypatch.undo()
    assert [s.id for s in remote.list()] == [snap1.id]
    assert _pack_objects(remote) == before  # its new pack was taken back
    assert remote.upload(snap2.path, local=store_a).chunked
    assert [s.id for s in remote.list()] == [snap1.id, snap2.id]


def test_a_killed_chunked_upload_is_never_listed_and_breaks_no_later_one(
    remote_url, s3_options, tmp_path, key
):
    store_a = SnapshotStore(tmp_path / "node-a")
    rng = np.random.default_rng(5)
    snap = make_snapshot(store_a, {"pages-1.img": rng.bytes(40 << 20), "core-1.img": 99})
    kill_upload_midway(remote_url, s3_options, snap.path, key)

    remote = _remote(remote_url, s3_options, key)
    assert remote.list() == []
    assert not remote.fs.exists(remote.path(snap.id, REMOTE_MANIFEST))
    # Young leftovers stay (an upload may be running); the upload then goes through.
    remote.clean_incomplete(older_than=3600)
    uploaded = remote.upload(snap.path, local=store_a)
    assert [s.id for s in remote.list()] == [snap.id]
    # A clean-up without grace keeps what the listed snapshot needs, nothing else.
    remote.clean_incomplete(older_than=0)
    stems = {n.rsplit(".", 1)[0] for n in _pack_objects(remote)}
    assert stems == set(uploaded.remote_manifest["packs"])
    store_b = SnapshotStore(tmp_path / "node-b")
    remote.download(snap.id, store_b)
    assert _assembled(store_b, snap.id) == (rng_bytes := _assembled(store_a, snap.id))
    assert len(rng_bytes) == 40 << 20


def test_remote_packs_go_when_no_remote_snapshot_needs_them(
    remote_url, s3_options, tmp_path, key
):
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, snap2, _ = _two_saves(store_a)
    remote = _remote(remote_url, s3_options, key)
    first = remote.upload(snap1.path, local=store_a).remote_manifest["packs"]
    second = remote.upload(snap2.path, local=store_a).remote_manifest["packs"]
    assert set(first) < set(second)
    remote.delete(snap1.id)
    assert remote.collect_packs(cutoff=0.0) == []  # within the grace: kept
    remote.clean_incomplete(older_than=0)
    assert {n.rsplit(".", 1)[0] for n in _pack_objects(remote)} == set(second)
    # The second snapshot still comes down whole on a node that has nothing.
    store_c = SnapshotStore(tmp_path / "node-c")
    remote.download(snap2.id, store_c)
    assert _assembled(store_c, snap2.id) == _assembled(store_a, snap2.id)
    # A delete collects too, past its grace.
    remote.pack_grace = 0.0
    remote.delete(snap2.id)
    assert _pack_objects(remote) == {}


def test_a_page_altered_in_the_bucket_is_refused(remote_url, s3_options, tmp_path, key):
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, _, _ = _two_saves(store_a)
    remote = _remote(remote_url, s3_options, key)
    remote.upload(snap1.path, local=store_a)
    (pack,) = [n for n in _pack_objects(remote) if n.endswith(".pack")]
    path = f"{remote.root}/{PACKS_DIR}/{pack}"
    data = bytearray(remote.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    remote.fs.pipe_file(path, bytes(data))
    store_b = SnapshotStore(tmp_path / "node-b")
    expected = "does not authenticate" if key else "does not match its id"
    with pytest.raises(SnapshotError, match=expected):  # a DecryptionError when sealed
        remote.download(snap1.id, store_b)
    assert not (store_b.root / snap1.id).exists()
    assert [p.name for p in store_b.root.iterdir() if p.name.startswith(".partial")] == []



def test_node_b_fetches_part_of_a_pack_by_range(remote_url, s3_options, tmp_path, key):
    sealed = key is not None
    store_a = SnapshotStore(tmp_path / "node-a")
    first = _pages(1500, seed=1)
    snap = make_snapshot(store_a, {"pages-1.img": _image(first, 0)})
    remote = _remote(remote_url, s3_options, key)
    remote.upload(snap.path, local=store_a)
    # Node B saved a kernel of its own that holds the first 700 of those pages.
    store_b = SnapshotStore(tmp_path / "node-b")
    make_snapshot(store_b, {"pages-1.img": _image(first[:700], 0)})
    remote_b = _remote(remote_url, s3_options, key)
    fetched = _counting_reads(remote_b)
    remote_b.download(snap.id, store_b)
    assert sorted(_local_pack_pages(store_b)) == [700, 800]
    # Ranged reads of the one remote pack: the 800 pages, and when sealed the start of the
    # record the first of them lies in.
    assert _stored(800, sealed) <= sum(fetched) <= _stored(800, sealed) + RECORD_BYTES
    assert _assembled(store_b, snap.id) == b"".join(first)


def test_a_plain_chunked_snapshot_comes_down_on_a_node_with_a_key(
    remote_url, s3_options, tmp_path
):
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, snap2, _ = _two_saves(store_a)
    _remote(remote_url, s3_options, None).upload(snap1.path, local=store_a)
    # The store turned on encryption after the first upload: the next upload seals its
    # pages in a pack of its own, and both come down on a node with the key.
    sealed = _remote(remote_url, s3_options, KEY).upload(snap2.path, local=store_a)
    assert sealed.remote_manifest["new_page_bytes"] == 1539 * PAGE
    store_b = SnapshotStore(tmp_path / "node-b")
    for snap in (snap1, snap2):
        _remote(remote_url, s3_options, KEY).download(snap.id, store_b)
        assert _assembled(store_b, snap.id) == _assembled(store_a, snap.id)


def test_a_pack_left_by_an_upload_cut_off_before_its_manifest_serves_the_next_one(
    remote_url, s3_options, tmp_path, key, monkeypatch
):
    """As a kill right before the remote manifest: the new pack and its ids are up, no
    manifest names them, and nothing took them back."""
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, _, _ = _two_saves(store_a)
    remote = _remote(remote_url, s3_options, key)

    def cut(self: Any, remote_manifest: dict[str, Any]) -> None:
        raise KeyboardInterrupt  # no Exception: as a kill, nothing is retried

    monkeypatch.setattr(upload_module._Upload, "_put_remote_manifest", cut)
    monkeypatch.setattr(PageUpload, "undo", lambda self: None)
    with pytest.raises(KeyboardInterrupt):
        remote.upload(snap1.path, local=store_a)
    monkeypatch.undo()
    assert remote.list() == []
    left = {n.rsplit(".", 1)[0] for n in _pack_objects(remote)}
    assert len(left) == 1
    # The next upload finds every page in that pack and sends none again.
    uploaded = remote.upload(snap1.path, local=store_a)
    assert uploaded.remote_manifest["new_page_bytes"] == 0
    assert set(uploaded.remote_manifest["packs"]) == left
    store_b = SnapshotStore(tmp_path / "node-b")
    remote.download(snap1.id, store_b)
    assert _assembled(store_b, snap1.id) == _assembled(store_a, snap1.id)


def test_an_upload_whose_reused_pack_is_collected_meanwhile_is_not_listed(
    remote_url, s3_options, tmp_path, key, monkeypatch
):
    store_a = SnapshotStore(tmp_path / "node-a")
    snap1, snap2, _ = _two_saves(store_a)
    remote = _remote(remote_url, s3_options, key)
    (old_pack,) = remote.upload(snap1.path, local=store_a).remote_manifest["packs"]
    put = upload_module._Upload._put_remote_manifest

    def collected_meanwhile(self: Any, remote_manifest: dict[str, Any]) -> None:
        # Another node deleted snap1 and collected its pack while this upload reused it.
        RemotePacks(remote).remove(old_pack)
        put(self, remote_manifest)

    monkeypatch.setattr(upload_module._Upload, "_put_remote_manifest", collected_meanwhile)
    with pytest.raises(RemoteStoreError, match=f"pack {old_pack} .* was removed"):
        remote.upload(snap2.path, local=store_a)
    monkeypatch.undo()
    assert snap2.id not in [s.id for s in remote.list()]
    # Uploaded again, it sends the pages it can no longer find.
    again = remote.upload(snap2.path, local=store_a)
    assert old_pack not in again.remote_manifest["packs"]
    store_b = SnapshotStore(tmp_path / "node-b")
    remote.download(snap2.id, store_b)
    assert _assembled(store_b, snap2.id) == _assembled(store_a, snap2.id)
