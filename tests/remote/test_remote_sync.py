"""The server's remote glue on a shared-path remote: the cached listing, judging by the key,
cache eviction after an upload, and the refusal of a foreign snapshot before download."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import Progress
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from jupyter_gpu_snapshot.node.local_engine import LocalEngine
from jupyter_gpu_snapshot.node.snapshots import NodeSnapshots
from jupyter_gpu_snapshot.server import remote_sync
from jupyter_gpu_snapshot.server.remote_sync import RemoteSync
from testkit.remote_snapshots import make_snapshot


def _sync(tmp_path: Path, node: str, cap: int = 0, seconds: float = 60.0) -> RemoteSync:
    store = SnapshotStore(tmp_path / node, tmp_path / "shared.key")
    remote = RemoteStore(str(tmp_path / "bucket"))
    return RemoteSync(NodeSnapshots(LocalEngine(store), remote, cap), listing_seconds=seconds)


def _store(sync: RemoteSync) -> SnapshotStore:
    """The local store of the node ``sync`` serves."""
    store = sync.node.engine.local_store
    assert store is not None
    return store


def test_listing_is_reused_until_it_is_stale_or_forgotten(tmp_path: Path) -> None:
    async def scenario() -> None:
        node_a, node_b = _sync(tmp_path, "a"), _sync(tmp_path, "b")
        first = make_snapshot(_store(node_a), {"pages-1.img": 1 << 16}, name="first")
        await node_a.upload(first, lambda _p: None, ())
        assert list((await node_b.listing()).snapshots) == [first.id]
        second = make_snapshot(_store(node_a), {"pages-1.img": 1 << 16}, name="second")
        await node_a.upload(second, lambda _p: None, ())
        # Within listing_seconds node B shows what it listed; a fresh listing sees both.
        assert list((await node_b.listing()).snapshots) == [first.id]
        assert set((await node_b.listing(fresh=True)).snapshots) == {first.id, second.id}
        assert all(s.trusted for s in (await node_b.listing()).snapshots.values())
        await node_a.delete(first.id)
        node_b.forget()
        assert list((await node_b.listing()).snapshots) == [second.id]

    asyncio.run(scenario())


def test_upload_reports_progress_and_evicts_the_least_recently_used_copy(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        # Room for one snapshot of 3 MiB: the older uploaded one goes, the new one stays.
        sync = _sync(tmp_path, "a", cap=4 << 20)
        older = make_snapshot(_store(sync), {"pages-1.img": 3 << 20}, name="older")
        assert (await sync.upload(older, lambda _p: None, ()))["status"] == "uploaded"
        newer = make_snapshot(_store(sync), {"pages-1.img": 3 << 20}, name="newer")
        seen: list[Progress] = []
        outcome = await sync.upload(newer, seen.append, {newer.id})
        assert outcome["status"] == "uploaded", outcome
        assert seen and seen[-1].phase == "uploading" and seen[-1].done == seen[-1].total > 0
        assert [s.id for s in _store(sync).list()] == [newer.id]
        assert set((await sync.listing()).snapshots) == {older.id, newer.id}

    asyncio.run(scenario())


def test_a_foreign_snapshot_is_judged_damaged_and_never_downloaded(tmp_path: Path) -> None:
    async def scenario() -> None:
        foreign_store = SnapshotStore(tmp_path / "foreign", tmp_path / "other.key")
        planted = make_snapshot(foreign_store, {"pages-1.img": 1 << 16}, name="planted")
        RemoteStore(str(tmp_path / "bucket")).upload(planted.path)
        sync = _sync(tmp_path, "b")
        judged = (await sync.listing()).snapshots[planted.id]
        assert judged.status == "damaged" and "another key" in str(judged.problem)
        with pytest.raises(SnapshotError) as refused:
            await sync.download(judged, lambda _p: None, ())
        assert refused.value.step == "verify" and "signing_key_file" in str(refused.value.hint)
        assert not (_store(sync).root / planted.id).exists()

    asyncio.run(scenario())


def test_an_upload_given_up_for_a_shutdown_leaves_nothing_listed(tmp_path: Path) -> None:
    async def scenario() -> None:
        sync = _sync(tmp_path, "a")
        snapshot = make_snapshot(_store(sync), {"pages-1.img": 3 << 20}, name="kept")
        sync.stopping.set()
        outcome = await sync.upload(snapshot, lambda _p: None, ())
        assert outcome["status"] == "failed" and outcome["error"]["code"] == "upload_stopped"
        assert (await sync.listing(fresh=True)).snapshots == {}
        _store(sync).verify(_store(sync).get(snapshot.id))  # the local snapshot is whole
        sync.stopping.clear()
        assert (await sync.upload(snapshot, lambda _p: None, ()))["status"] == "uploaded"

    asyncio.run(scenario())


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_remote_object_is_named_before_the_restore(
    tmp_path: Path, damage: str
) -> None:
    async def scenario() -> None:
        node_a, node_b = _sync(tmp_path, "a"), _sync(tmp_path, "b")
        # Not a whole number of pages: kept whole, as one object (packs: test_remote_chunks).
        snapshot = make_snapshot(_store(node_a), {"pages-1.img": (1 << 20) + 100}, name="cut")
        await node_a.upload(snapshot, lambda _p: None, ())
        image = tmp_path / "bucket" / snapshot.id / "pages-1.img"
        if damage == "missing":
            image.unlink()
        else:
            image.write_bytes(image.read_bytes()[: 1 << 19])
        with pytest.raises(SnapshotError) as refused:
            listed = (await node_b.listing(fresh=True)).snapshots[snapshot.id]
            await node_b.download(listed, lambda _p: None, ())
        expected = "is missing" if damage == "missing" else "(truncated or replaced)"
        assert "the object pages-1.img" in refused.value.cause, refused.value.cause
        assert expected in refused.value.cause, refused.value.cause
        assert _store(node_b).catalog() == []

    asyncio.run(scenario())


def test_a_remote_that_does_not_answer_never_holds_up_a_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_sync, "FIRST_LISTING_SECONDS", 0.5)

    async def scenario() -> None:
        with socket.socket() as silent:  # accepts connections, never answers
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            options = {
                "key": "k" * 20, "secret": "s" * 40, "skip_instance_cache": True,
                "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                "config_kwargs": {"read_timeout": 1, "connect_timeout": 1,
                                  "retries": {"max_attempts": 1}},
            }
            store = SnapshotStore(tmp_path / "b", tmp_path / "shared.key")
            sync = RemoteSync(NodeSnapshots(
                LocalEngine(store), RemoteStore("s3://bucket/alice", options, attempts=1)))
            # Answered at once: it says the remote listing is under way, not that it failed.
            listing = await sync.listing()
            assert listing.snapshots == {} and "still under way" in str(listing.error)
            failed = await sync.listing(fresh=True)  # waits for the answer: a timeout
            assert failed.snapshots == {} and "listing s3://bucket/alice failed" in str(
                failed.error
            ), failed.error

    asyncio.run(scenario())
