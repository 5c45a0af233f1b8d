"""Encryption at rest: what goes into the bucket is sealed; only the right key brings it back."""

from __future__ import annotations

import os

import pytest

from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import MANIFEST
from jupyter_gpu_snapshot.core.store.remote import (
    ChunkSealer,
    DecryptionError,
    RemoteStore,
    RemoteStoreError,
    load_key,
)
from testkit.remote_snapshots import make_snapshot, tree_bytes

MiB = 1 << 20
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.fixture
def sealed(remote_url, s3_options, tmp_path):
    """A snapshot uploaded with KEY (in small chunks and parts, so there are many of both)."""
    local = SnapshotStore(tmp_path / "a")
    marker = b"PLAINTEXT-MARKER-" * 1000
    pages = os.urandom(MiB) + marker + os.urandom(6 * MiB)
    snap = make_snapshot(local, {"pages-1.img": pages, "core-1.img": 500, "empty.img": 0})
    remote = RemoteStore(remote_url, s3_options, key=KEY, part_bytes=5 * MiB, chunk_bytes=256 << 10)
    remote.upload(snap.path)
    return snap, remote, marker


def test_sealed_round_trip(sealed, remote_url, s3_options, tmp_path):
    snap, remote, marker = sealed
    stored = remote.fs.cat_file(remote.path(snap.id, "pages-1.img"))
    assert marker[:32] not in stored
    assert b"secret-hmac-key" not in remote.fs.cat_file(remote.path(snap.id, MANIFEST))
    node_b = RemoteStore(remote_url, s3_options, key=KEY)
    [listed] = node_b.list()
    assert listed.encrypted and listed.manifest == snap.manifest
    path = node_b.download(snap.id, tmp_path / "b")
    assert tree_bytes(path) == tree_bytes(snap.path)
    SnapshotStore(tmp_path / "b").verify(SnapshotStore(tmp_path / "b").get(snap.id))


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (OTHER_KEY, "encrypted with another key"),
        (None, "is encrypted and no key is configured"),
    ],
    ids=["another-key", "no-key"],
)
def test_wrong_or_missing_key_is_refused(sealed, remote_url, s3_options, tmp_path, key, expected):
    snap, _, _ = sealed
    node_b = RemoteStore(remote_url, s3_options, key=key)
    [listed] = node_b.list()  # still listed: its id and size are not secret
    assert listed.encrypted and listed.manifest is None
    assert listed.summary()["readable"] is False
    with pytest.raises(RemoteStoreError, match=expected) as caught:
        node_b.download(snap.id, tmp_path / "b")
    assert caught.value.hint
    assert not (tmp_path / "b").exists() or list((tmp_path / "b").iterdir()) == []


def _swap_records(data: bytes, record: int) -> bytes:
    return data[record : 2 * record] + data[:record] + data[2 * record :]


@pytest.mark.parametrize("tamper", ["flip", "swap-chunks", "swap-files"])
def test_tampered_ciphertext_is_refused(sealed, tmp_path, tamper):
    snap, remote, _ = sealed
    record = (256 << 10) + 28
    pages = remote.path(snap.id, "pages-1.img")
    data = remote.fs.cat_file(pages)
    if tamper == "flip":
        data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    elif tamper == "swap-chunks":
        data = _swap_records(data, record)
    else:  # the first record of another file in place of this one's
        other = remote.fs.cat_file(remote.path(snap.id, "core-1.img"))
        data = other + data[len(other) :]
    remote.fs.pipe_file(pages, data)
    with pytest.raises(DecryptionError, match=r"pages-1\.img .* does not authenticate"):
        remote.download(snap.id, tmp_path / "b")
    assert not (tmp_path / "b" / snap.id).exists()


def test_sealer_binds_index_name_and_size():
    sealer = ChunkSealer(KEY, "20261122T120000Z-0123abcd", chunk_bytes=4)
    records = sealer.seal_run("pages-1.img", 0, 10, b"0123456789")
    assert len(records) == sealer.stored_size(10) == 10 + 3 * 28
    assert sealer.open_run("pages-1.img", 0, 10, records) == b"0123456789"
    wrong_places = [("pages-2.img", 0, 10), ("pages-1.img", 1, 10), ("pages-1.img", 0, 8)]
    for name, index, size in wrong_places:
        with pytest.raises(DecryptionError):
            sealer.open_run(name, index, size, records)
    other_snapshot = ChunkSealer(KEY, "20261122T120000Z-ffffffff", chunk_bytes=4)
    with pytest.raises(DecryptionError):
        other_snapshot.open_run("pages-1.img", 0, 10, records)


def test_key_file_rules(tmp_path):
    hex_key = tmp_path / "hex.key"
    hex_key.write_text(KEY.hex() + "\n")
    hex_key.chmod(0o600)
    assert load_key(hex_key) == KEY
    raw = tmp_path / "raw.key"
    raw.write_bytes(KEY)
    raw.chmod(0o600)
    assert load_key(raw) == KEY
    raw.chmod(0o644)
    with pytest.raises(SnapshotError, match="can be read by other users"):
        load_key(raw)
    short = tmp_path / "short.key"
    short.write_bytes(b"too short")
    short.chmod(0o600)
    with pytest.raises(SnapshotError, match="must hold 32 raw bytes or 64 hex digits"):
        load_key(short)
    link = tmp_path / "link.key"
    link.symlink_to(hex_key)
    with pytest.raises(SnapshotError, match="not a regular file"):
        load_key(link)
    with pytest.raises(SnapshotError, match="cannot read the key file"):
        load_key(tmp_path / "missing.key")
