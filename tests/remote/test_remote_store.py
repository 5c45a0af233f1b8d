"""Upload, download, list and delete against a real S3 server (SeaweedFS) through s3fs.

Node A and node B are two cache directories and two RemoteStore clients sharing only the
bucket. Damage is done to the real objects in the bucket, then the download must refuse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core.errors import NotFound, SnapshotError
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import MANIFEST
from jupyter_gpu_snapshot.core.store.remote import RemoteStore, RemoteStoreError
from jupyter_gpu_snapshot.core.store.remote.objects import REMOTE_MANIFEST
from testkit.remote_snapshots import kill_upload_midway, make_snapshot, tree_bytes

MiB = 1 << 20


def _store(url: str, options: dict[str, Any], **kwargs: Any) -> RemoteStore:
    return RemoteStore(url, options, **kwargs)


def _keys(remote: RemoteStore, snapshot_id: str) -> list[str]:
    """The object keys under a snapshot's prefix, straight from the S3 API."""
    bucket, prefix, _ = remote.fs.split_path(remote.path(snapshot_id))
    reply = remote.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix + "/")
    return [o["Key"] for o in reply.get("Contents", [])]


def _nothing_partial(cache: Path) -> None:
    if cache.exists():
        assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_round_trip_to_a_second_cache(remote_url, s3_options, cache_a, cache_b):
    local = SnapshotStore(cache_a)
    snap = make_snapshot(local, {"pages-1.img": 3 * MiB + 17, "core-1.img": 1234, "empty.img": 0})
    ups: list[tuple[int, int]] = []
    remote_a = _store(remote_url, s3_options)
    uploaded = remote_a.upload(snap.path, progress=lambda d, t: ups.append((d, t)))
    assert uploaded.id == snap.id and uploaded.manifest == snap.manifest
    assert ups[-1][0] == ups[-1][1] == sum(p.stat().st_size for p in snap.path.iterdir())

    # Node B: its own client and an empty cache; it sees the snapshot and brings it back.
    remote_b = _store(remote_url, s3_options)
    listed = remote_b.list()
    assert [s.id for s in listed] == [snap.id]
    assert listed[0].summary()["name"] == snap.name
    assert "secret-hmac-key" not in json.dumps(listed[0].summary())
    downs: list[tuple[int, int]] = []
    path = remote_b.download(snap.id, cache_b, progress=lambda d, t: downs.append((d, t)))
    assert path == cache_b / snap.id
    assert tree_bytes(path) == tree_bytes(snap.path)
    assert downs[-1][0] == downs[-1][1] > 0
    store_b = SnapshotStore(cache_b)
    store_b.verify(store_b.get(snap.id))  # the local store's own check agrees
    assert oct(path.stat().st_mode & 0o777) == "0o700"
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in path.iterdir())
    _nothing_partial(cache_b)
    # A second upload of the same snapshot leaves the remote copy as it is.
    assert remote_a.upload(snap.path).remote_manifest == uploaded.remote_manifest


def test_multipart_parts_go_up_in_parallel(remote_url, s3_options, cache_a, cache_b):
    local = SnapshotStore(cache_a)
    snap = make_snapshot(local, {"pages-1.img": 23 * MiB + 5, "pages-2.img": 11 * MiB})
    remote = _store(remote_url, s3_options, part_bytes=5 * MiB, workers=4)
    remote.upload(snap.path)
    info = remote.fs.info(remote.path(snap.id, "pages-1.img"))
    # S3 gives a multipart object an ETag "<md5 of part md5s>-<number of parts>".
    assert info["ETag"].strip('"').endswith("-5"), info
    path = _store(remote_url, s3_options, workers=3).download(snap.id, cache_b)
    assert tree_bytes(path) == tree_bytes(snap.path)


def test_killed_upload_is_never_listed(remote_url, s3_options, cache_a):
    # Whole files, as snapshots from before the content-addressed store are kept; a killed
    # chunked upload is in test_remote_chunks.py.
    local = SnapshotStore(cache_a, chunk_images=False)
    snap = make_snapshot(local, {"pages-1.img": 40 * MiB, "core-1.img": 1000})
    kill_upload_midway(remote_url, s3_options, snap.path)

    remote = _store(remote_url, s3_options)
    assert _keys(remote, snap.id), "nothing was uploaded before the kill"
    assert remote.list() == []
    with pytest.raises(NotFound, match=snap.id):
        remote.download(snap.id, cache_a.parent / "node-b")
    # Leftovers are young, so a cleanup with a grace period keeps them; without, they go.
    assert remote.clean_incomplete(older_than=3600) == []
    assert remote.clean_incomplete(older_than=0) == [snap.id]
    assert _keys(remote, snap.id) == []
    bucket, prefix, _ = remote.fs.split_path(remote.root)
    uploads = remote.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    assert uploads.get("Uploads", []) == []
    # The local snapshot was never touched, and uploads cleanly afterwards.
    local.verify(local.get(snap.id))
    assert [s.id for s in remote.list()] == [] and remote.upload(snap.path).id == snap.id


def _damage_missing(remote: RemoteStore, sid: str) -> str:
    remote.fs.rm_file(remote.path(sid, "pages-1.img"))
    return "pages-1.img is missing"


def _damage_truncated(remote: RemoteStore, sid: str) -> str:
    data = remote.fs.cat_file(remote.path(sid, "pages-1.img"))
    remote.fs.pipe_file(remote.path(sid, "pages-1.img"), data[: len(data) // 2])
    return "pages-1.img has .* bytes, expected .*truncated"


def _damage_flipped(remote: RemoteStore, sid: str) -> str:
    data = bytearray(remote.fs.cat_file(remote.path(sid, "pages-1.img")))
    data[len(data) // 3] ^= 0xFF
    remote.fs.pipe_file(remote.path(sid, "pages-1.img"), bytes(data))
    return "pages-1.img does not match its (sha256|blake3) digest"


def _damage_manifest(remote: RemoteStore, sid: str) -> str:
    path = remote.path(sid, MANIFEST)
    manifest = json.loads(remote.fs.cat_file(path))
    manifest["name"] = "renamed"
    remote.fs.pipe_file(path, json.dumps(manifest).encode())
    return "manifest.json"


DAMAGES = {
    "missing": _damage_missing,
    "truncated": _damage_truncated,
    "flipped": _damage_flipped,
    "manifest": _damage_manifest,
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_remote_object_is_refused(damage, remote_url, s3_options, cache_a, cache_b):
    local = SnapshotStore(cache_a, chunk_images=False)  # damage to whole files
    snap = make_snapshot(local, {"pages-1.img": 6 * MiB, "core-1.img": 999})
    remote = _store(remote_url, s3_options, part_bytes=5 * MiB)
    remote.upload(snap.path)
    expected = DAMAGES[damage](remote, snap.id)
    with pytest.raises(RemoteStoreError, match=expected) as caught:
        _store(remote_url, s3_options).download(snap.id, cache_b)
    assert caught.value.step == "download" and caught.value.hint
    # Nothing partial in node B's cache, and node A's snapshot is as it was.
    assert not (cache_b / snap.id).exists()
    _nothing_partial(cache_b)
    assert SnapshotStore(cache_b).list() == []
    local.verify(local.get(snap.id))


def test_delete_unlists_first_and_removes_everything(remote_url, s3_options, cache_a):
    local = SnapshotStore(cache_a)
    keep = make_snapshot(local, {"pages-1.img": 1000})
    doomed = make_snapshot(local, {"pages-1.img": 2000})
    remote = _store(remote_url, s3_options)
    remote.upload(keep.path)
    remote.upload(doomed.path)
    assert {s.id for s in remote.list()} == {keep.id, doomed.id}
    remote.delete(doomed.id)
    assert [s.id for s in _store(remote_url, s3_options).list()] == [keep.id]
    assert _keys(remote, doomed.id) == []
    with pytest.raises(NotFound):
        remote.delete(doomed.id)
    assert {s.id for s in local.list()} == {keep.id, doomed.id}  # local copies stay


def test_blake3_manifest_is_checked_by_its_named_algorithm(remote_url, s3_options, tmp_path):
    from blake3 import blake3

    local = SnapshotStore(tmp_path / "a", chunk_images=False)
    snap = make_snapshot(local, {"pages-1.img": 2 * MiB})
    # A manifest of the BLAKE3 kind: the algorithm named once, each file's digest under it.
    manifest = dict(snap.manifest, digest="blake3")
    data = (snap.path / "pages-1.img").read_bytes()
    manifest["files"] = {"pages-1.img": {"size": len(data), "blake3": blake3(data).hexdigest()}}
    os.chmod(snap.path / MANIFEST, 0o600)
    (snap.path / MANIFEST).write_text(json.dumps(manifest))
    remote = _store(remote_url, s3_options)
    remote.upload(snap.path)
    assert tree_bytes(remote.download(snap.id, tmp_path / "b")) == tree_bytes(snap.path)

    _damage_flipped(remote, snap.id)
    with pytest.raises(RemoteStoreError, match=r"pages-1\.img does not match its blake3 digest"):
        remote.download(snap.id, tmp_path / "c")


def test_unsafe_remote_names_are_refused(remote_url, s3_options, tmp_path):
    local = SnapshotStore(tmp_path / "a")
    snap = make_snapshot(local, {"pages-1.img": 100})
    remote = _store(remote_url, s3_options)
    remote.upload(snap.path)
    path = remote.path(snap.id, REMOTE_MANIFEST)
    for evil in ("../../escaped", "/etc/passwd", ".hidden", "a/b"):
        doc = json.loads(remote.fs.cat_file(path))
        doc["objects"][evil] = {"size": 1, "stored_size": 1, "sha256": "0" * 64}
        remote.fs.pipe_file(path, json.dumps(doc).encode())
        with pytest.raises(RemoteStoreError, match="refusing the object name"):
            remote.download(snap.id, tmp_path / "b")
        doc["objects"].pop(evil)
        remote.fs.pipe_file(path, json.dumps(doc).encode())
    # A rename's manifest object is named in the remote manifest too: the same rule holds.
    doc = json.loads(remote.fs.cat_file(path))
    doc["objects"]["manifest.json"]["object"] = "../other/manifest.json"
    remote.fs.pipe_file(path, json.dumps(doc).encode())
    with pytest.raises(RemoteStoreError, match="refusing the object name"):
        remote.download(snap.id, tmp_path / "b")
    assert not (tmp_path / "escaped").exists()
    with pytest.raises(RemoteStoreError, match="not a snapshot id"):
        remote.download("../../etc", tmp_path / "b")


def test_symlink_in_local_snapshot_is_not_uploaded(remote_url, s3_options, tmp_path):
    local = SnapshotStore(tmp_path / "a")
    snap = make_snapshot(local, {"pages-1.img": 100})
    (tmp_path / "secret").write_text("not part of any snapshot")
    os.symlink(tmp_path / "secret", snap.path / "link.img")
    remote = _store(remote_url, s3_options)
    with pytest.raises(RemoteStoreError, match="not a regular file"):
        remote.upload(snap.path)
    assert remote.list() == []


def test_upload_failure_leaves_local_snapshot_and_names_the_cause(s3_options, tmp_path):
    local = SnapshotStore(tmp_path / "a")
    snap = make_snapshot(local, {"pages-1.img": 6 * MiB})
    before = tree_bytes(snap.path)
    remote = _store("s3://no-such-bucket-here/prefix", s3_options, attempts=2, retry_delay=0.01)
    started = time.monotonic()
    with pytest.raises(SnapshotError, match=r"upload failed: .*no-such-bucket-here") as caught:
        remote.upload(snap.path)
    assert "local snapshot is intact" in str(caught.value)
    assert time.monotonic() - started < 30
    assert tree_bytes(snap.path) == before
    local.verify(local.get(snap.id))


def test_transient_errors_are_retried_permanent_ones_are_not(s3_options):
    remote = _store("s3://snapshots/x", s3_options, attempts=3, retry_delay=0.001)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert remote.retry("flaky", flaky) == "ok" and len(calls) == 3

    def gone() -> None:
        calls.append(1)
        raise FileNotFoundError("no such key")

    calls.clear()
    with pytest.raises(FileNotFoundError):
        remote.retry("gone", gone)
    assert len(calls) == 1


def test_download_after_a_killed_download_starts_afresh(remote_url, s3_options, tmp_path):
    local = SnapshotStore(tmp_path / "a")
    snap = make_snapshot(local, {"pages-1.img": 3 * MiB})
    remote = _store(remote_url, s3_options)
    remote.upload(snap.path)
    # What a downloader killed mid-way leaves: its partial directory, owned by a dead pid.
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        gone.wait()
    partial = tmp_path / "b" / f".partial-{snap.id}"
    partial.mkdir(parents=True)
    (partial / ".owner").write_text(str(gone.pid))
    (partial / "pages-1.img").write_bytes(b"half")
    path = remote.download(snap.id, tmp_path / "b")
    assert tree_bytes(path) == tree_bytes(snap.path)
    _nothing_partial(tmp_path / "b")
