"""The store on its own: atomic publication, listing, names, stale directories, digests,
signatures, the manifest's schema, and a store that trusts no one else's files."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import InvalidRequest, NotFound, SnapshotError
from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.recovery import recover_store
from jupyter_gpu_snapshot.core.safe_fs import UnsafeStore
from jupyter_gpu_snapshot.core.store import SnapshotStore, digest
from jupyter_gpu_snapshot.core.store.manifest import FORMAT_VERSION, ManifestPolicy
from jupyter_gpu_snapshot.core.store.signing import SigningKey
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id, validate_name
from tests.conftest import run

CONNECTION = {
    "transport": "tcp", "ip": "127.0.0.1", "key": "k" * 36, "signature_scheme": "hmac-sha256",
    "shell_port": 50001, "iopub_port": 50002, "stdin_port": 50003, "control_port": 50004,
    "hb_port": 50005,
}


def _store(tmp_path: Path, log_dir: Path | None = None) -> SnapshotStore:
    logs = log_dir or tmp_path / "runtime" / "gpu_snapshot"
    return SnapshotStore(
        tmp_path / "s", tmp_path / "keys" / "signing.key", ManifestPolicy(lambda: logs)
    )


def _commit(store: SnapshotStore, name: str, payload: bytes = b"x" * 1000) -> str:
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    (partial / "pages-1.img").write_bytes(payload)
    log = str(store.policy.kernel_log_dir()) + "/kernel-abc.log"  # type: ignore[misc]
    kernel = {"name": "python3-snapshot", "connection_info": dict(CONNECTION),
              "log_files": [log], "notebook_path": "work/n.ipynb"}
    store.commit(partial, {"id": snapshot_id, "name": name, "created": 1.0, "kernel": kernel})
    return snapshot_id


def _manifest(store: SnapshotStore, snapshot_id: str) -> dict[str, Any]:
    return dict(json.loads((store.root / snapshot_id / "manifest.json").read_text()))


def _rewrite(store: SnapshotStore, snapshot_id: str, manifest: dict[str, Any],
             sign: bool = False) -> None:
    if sign:
        manifest["signature"] = store.key.sign(manifest)
    (store.root / snapshot_id / "manifest.json").write_text(json.dumps(manifest))


def _refused_restore(store: SnapshotStore, ref: str) -> SnapshotError:
    """Restore must fail before criu: the engine's criu does not even exist."""
    from jupyter_gpu_snapshot.core.criu import CriuRunner

    engine = SnapshotEngine(store, CriuRunner("/nonexistent/criu"))
    with pytest.raises(SnapshotError) as err:
        run(engine.restore(ref))
    assert "criu not found" not in err.value.message
    return err.value


def test_partial_directories_are_never_listed(tmp_path):
    store = _store(tmp_path)
    partial = store.begin(new_snapshot_id())
    (partial / "pages-1.img").write_bytes(b"half")
    assert store.list() == []
    done = _commit(store, "done")
    assert [s.id for s in store.list()] == [done]


def test_stale_partials_of_dead_processes_are_cleaned(tmp_path):
    store = _store(tmp_path)
    mine_id = new_snapshot_id()
    with store.locks.hold(snapshot_key(mine_id), "mine", "test"):
        mine = store.begin(mine_id)
        # A save whose process died before its dump began (no draft): nothing to keep.
        stale = store.begin(new_snapshot_id())
        removed = recover_store(store).removed
        assert removed == [stale] and mine.exists()


def test_lookup_by_name_and_id_and_delete(tmp_path):
    store = _store(tmp_path)
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


def test_manifest_is_signed_and_lists_every_file(tmp_path):
    store = _store(tmp_path)
    snapshot = store.get(_commit(store, "m"))
    manifest = _manifest(store, snapshot.id)
    assert manifest["format"] == FORMAT_VERSION
    assert manifest["digest"] == digest.preferred_algorithm()
    assert manifest["files"]["pages-1.img"]["size"] == 1000
    assert manifest["signature"]["algorithm"] == "HMAC-SHA256"
    assert (tmp_path / "keys" / "signing.key").stat().st_mode & 0o777 == 0o600
    store.verify(snapshot)
    (snapshot.path / "stray").write_text("?")
    with pytest.raises(SnapshotError, match="unexpected files"):
        store.verify(snapshot)


@pytest.mark.parametrize("algorithm", digest.ALGORITHMS)
def test_digests_see_one_changed_byte_in_any_chunk(tmp_path, algorithm):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(digest.TREE_CHUNK * 2 + 123)

    def of() -> str:
        fd = os.open(big, os.O_RDONLY)
        try:
            return digest.digest_files([(fd, big.stat().st_size)], algorithm)[0]
        finally:
            os.close(fd)

    before = of()
    with open(big, "r+b") as f:
        f.seek(digest.TREE_CHUNK + 7)
        f.write(b"\x01")
    assert of() != before and len(before) == 64


# -- authenticity ----------------------------------------------------------------------------
def test_altered_manifest_is_damaged_and_never_restored(tmp_path):
    store = _store(tmp_path)
    good, bad = _commit(store, "good"), _commit(store, "bad")
    manifest = _manifest(store, bad)
    manifest["files"]["pages-1.img"]["digest"] = "0" * 64  # e.g. after editing the image
    _rewrite(store, bad, manifest)
    listed = {s.id: s for s in store.catalog()}
    assert listed[good].status == "ok"
    assert listed[bad].status == "damaged" and "altered" in (listed[bad].problem or "")
    assert [s.id for s in store.list()] == [good]
    summary = listed[bad].summary()
    assert summary["status"] == "damaged" and summary["kernel"] == {"connection_info": {}}
    with pytest.raises(NotFound):
        store.get("bad")  # names come from trusted manifests only
    error = _refused_restore(store, bad)
    assert error.step == "verify" and "damaged" in error.message and "altered" in error.message
    store.delete(bad)  # a damaged snapshot can still be deleted by id
    assert [s.id for s in store.catalog()] == [good]


def test_snapshot_signed_with_another_key_is_refused(tmp_path):
    store = _store(tmp_path)
    other = SnapshotStore(store.root, tmp_path / "other.key", store.policy)
    theirs = _commit(other, "theirs")
    snapshot = store.get(theirs)
    assert snapshot.status == "damaged" and "another key" in (snapshot.problem or "")
    assert "another key" in _refused_restore(store, theirs).message


def test_unsigned_snapshot_needs_trust(tmp_path):
    store = _store(tmp_path)
    old = _commit(store, "old")
    manifest = _manifest(store, old)
    # What a format-1 save wrote: a sha256 per file and no signature.
    payload = (store.root / old / "pages-1.img").read_bytes()
    import hashlib

    legacy = {k: v for k, v in manifest.items() if k not in ("signature", "digest", "files")}
    legacy.update(format=1, files={"pages-1.img": {
        "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}})
    _rewrite(store, old, legacy)
    snapshot = store.get(old)
    assert snapshot.status == "unsigned" and snapshot.summary()["name"] == "old"
    assert store.list() == []
    assert f"gpu-snapshot trust {old}" in _refused_restore(store, old).message
    trusted = store.trust(old)
    assert trusted.status == "ok" and store.get("old").trusted
    store.verify(store.get(old))


def test_unsigned_snapshot_with_a_changed_file_is_not_trusted(tmp_path):
    store = _store(tmp_path)
    old = _commit(store, "old")
    manifest = _manifest(store, old)
    legacy = {k: v for k, v in manifest.items() if k not in ("signature", "digest", "files")}
    legacy.update(format=1, files={"pages-1.img": {"size": 1000, "sha256": "0" * 64}})
    _rewrite(store, old, legacy)
    with pytest.raises(SnapshotError, match="does not match its sha256"):
        store.trust(old)
    assert store.get(old).status == "unsigned"


def test_unsigned_snapshot_with_an_unlisted_file_is_not_trusted(tmp_path):
    store = _store(tmp_path)
    old = _commit(store, "old")
    legacy = {k: v for k, v in _manifest(store, old).items()
              if k not in ("signature", "digest", "files")}
    legacy.update(format=1, files={"pages-1.img": {"size": 0, "sha256": "0" * 64}})
    _rewrite(store, old, legacy)
    (store.root / old / "planted.img").write_bytes(b"x")
    with pytest.raises(SnapshotError, match="unexpected files: planted"):
        store.trust(old)
    assert store.get(old).status == "unsigned"


def test_signing_key_others_can_read_is_refused(tmp_path):
    store = _store(tmp_path)
    _commit(store, "a")
    os.chmod(store.key_file, 0o644)
    with pytest.raises(SnapshotError, match="others may read it"):
        SigningKey.load(store.key_file)


# -- the manifest's schema: a signed manifest still may not escape ----------------------------
def _log_edit(path: str) -> Any:
    return lambda m: m["kernel"].__setitem__("log_files", [path])


def _conn_edit(key: str, value: Any) -> Any:
    return lambda m: m["kernel"]["connection_info"].__setitem__(key, value)


def _files_edit(name: str) -> Any:
    return lambda m: m["files"].__setitem__(name, {"size": 5, "digest": "0" * 64})


ESCAPES = {
    "log file in /etc": (_log_edit("/etc/evil-{token}/kernel-x.log"), "kernel-log directory"),
    "log file named like a system file": (_log_edit("/etc/evil-{token}"), "kernel-ID.log"),
    "relative log file": (_log_edit("../../evil-{token}/kernel-x.log"), "absolute"),
    "log file with ..": (_log_edit("{logs}/../../evil-{token}/kernel-x.log"), "normalised"),
    "files key up the tree": (_files_edit("../../../etc/hostname"), "files"),
    "absolute files key": (_files_edit("/etc/shadow"), "files"),
    "ipc transport": (_conn_edit("transport", "ipc"), "transport"),
    "port as text": (_conn_edit("shell_port", "50001"), "shell_port"),
    "ip that is a path": (_conn_edit("ip", "/tmp/kernel"), "IP address"),
    "extra connection field": (_conn_edit("extra", 1), "connection_info"),
    "notebook outside the root": (
        lambda m: m["kernel"].__setitem__("notebook_path", "../../../etc/passwd.ipynb"),
        "notebook_path"),
    "newer format": (lambda m: m.__setitem__("format", FORMAT_VERSION + 1), "format"),
    "node file with a relative path": (
        lambda m: m.__setitem__("node", {"mapped_files": {"algorithm": "blake3", "files": [
            {"path": "lib/x.so", "size": 1, "digest": "0" * 64}]}}), "node"),
}


@pytest.mark.parametrize("attack", ESCAPES, ids=list(ESCAPES))
def test_signed_manifest_that_escapes_is_damaged(tmp_path, attack):
    store = _store(tmp_path)
    good, bad = _commit(store, "good"), _commit(store, "bad")
    token = secrets.token_hex(4)
    edit, reason = ESCAPES[attack]
    manifest = _manifest(store, bad)
    edit(manifest)
    logs = str(store.policy.kernel_log_dir())  # type: ignore[misc]
    text = json.dumps(manifest).replace("{token}", token).replace("{logs}", logs)
    _rewrite(store, bad, json.loads(text), sign=True)  # as if the key had leaked
    listed = {s.id: s for s in store.catalog()}
    assert listed[good].status == "ok"
    assert listed[bad].status == "damaged" and reason in (listed[bad].problem or "")
    error = _refused_restore(store, bad)
    assert error.step == "verify" and reason in error.message
    assert not list(Path("/etc").glob(f"evil-{token}*"))
    assert not list(tmp_path.parent.parent.glob(f"evil-{token}*"))
    assert not list(Path.cwd().parent.parent.glob(f"evil-{token}*"))


def test_broken_manifests_never_break_the_listing(tmp_path):
    store = _store(tmp_path)
    good = _commit(store, "good")
    for content in ("{not json", "[]", json.dumps({"format": 2}), "x" * (5 << 20)):
        broken = _commit(store, "b" + secrets.token_hex(3))
        (store.root / broken / "manifest.json").write_text(content)
    (store.root / new_snapshot_id()).mkdir()  # no manifest at all
    statuses = sorted(s.status for s in store.catalog())
    assert statuses == ["damaged"] * 5 + ["ok"] and [s.id for s in store.list()] == [good]
    assert all(s.summary()["problem"] for s in store.catalog() if s.status == "damaged")


# -- a private store -------------------------------------------------------------------------
def test_store_owned_by_another_user_is_refused(tmp_path):
    store = _store(tmp_path)
    _commit(store, "a")
    os.chown(store.root, 65534, 65534)
    for action in (store.list, lambda: store.begin(new_snapshot_id()), lambda: store.get("a")):
        with pytest.raises(UnsafeStore, match="owned by uid 65534"):
            action()
    assert any("65534" in p for p in store.audit())


def test_group_writable_store_or_parent_is_refused(tmp_path):
    store = _store(tmp_path)
    _commit(store, "a")
    os.chmod(store.root, 0o770)
    with pytest.raises(UnsafeStore, match="needs 700"):
        store.list()
    os.chmod(store.root, 0o700)
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(UnsafeStore, match="writable by group and others"):
            store.list()
        os.chmod(tmp_path, 0o1777)  # sticky, like /tmp: nobody may rename what is ours
        assert [s.name for s in store.list()] == ["a"]
    finally:
        os.chmod(tmp_path, 0o700)


def test_store_parents_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = SnapshotStore(tmp_path / "a" / "b" / "s", tmp_path / "k" / "key")
        store.ensure()
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "b", store.root):
        assert path.stat().st_mode & 0o777 == 0o700, path


def test_planted_logs_link_is_never_written_through(tmp_path):
    store = _store(tmp_path)
    store.ensure()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store.root / "logs").symlink_to(elsewhere)
    log = tmp_path / "criu.log"
    log.write_text("(00.1) Error (x.c:1): boom\n")
    with pytest.raises(OSError):
        store.keep_log(log, "restore")
    kept = SnapshotEngine(store)._keep_log(log, "restore")
    assert kept is not None and not kept.is_relative_to(store.root)
    kept.unlink()
    assert list(elsewhere.iterdir()) == []
    assert any("logs is a symbolic link" in p for p in store.audit())


def test_symlinked_snapshot_directory_is_neither_listed_restored_nor_deleted(tmp_path):
    store = _store(tmp_path)
    real = _commit(store, "real")
    outside = tmp_path / "outside"
    os.rename(store.root / real, outside)
    (store.root / real).symlink_to(outside)
    assert store.catalog() == []
    with pytest.raises(NotFound, match="symbolic link"):
        store.get(real)
    with pytest.raises(NotFound, match="symbolic link"):
        store.delete(real)
    _refused_restore(store, real)
    assert (outside / "manifest.json").exists()
    assert sorted(os.listdir(store.root)) == [real]  # no .deleting- link left behind
    assert any("symbolic link" in p for p in store.audit())


def test_configured_store_path_may_be_a_link_to_a_private_store(tmp_path):
    store = _store(tmp_path)
    first = _commit(store, "first")
    linked = SnapshotStore(tmp_path / "link", store.key_file, store.policy)
    (tmp_path / "link").symlink_to(store.root)
    assert [s.id for s in linked.list()] == [first]
    linked.verify(linked.get("first"))
    assert linked.audit() == []


def test_the_autosave_policies_file_beside_the_snapshots_is_no_snapshot(tmp_path: Path):
    store = _store(tmp_path)
    kept = _commit(store, "kept")
    (store.root / ".autosave-policies.json").write_text('{"n.ipynb": {"enabled": false}}')
    engine = SnapshotEngine(store)
    assert [s.id for s in engine.catalog()] == [kept]
    assert [s.id for s in engine.list()] == [kept]
    assert store.audit() == []
    report = recover_store(store)
    assert report.removed == [] and report.kept == []
    assert (store.root / ".autosave-policies.json").is_file()
