"""The local store as a cache: a size cap, least recently used first, and nothing lost."""

from __future__ import annotations

import os

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import SnapshotCache
from testkit.remote_snapshots import make_snapshot


def _aged(store: SnapshotStore, sizes: list[int]) -> list[str]:
    """Snapshots of ``sizes`` bytes, the first used longest ago."""
    ids = []
    for age, size in zip(range(len(sizes), 0, -1), sizes, strict=True):
        snap = make_snapshot(store, {"pages-1.img": size})
        os.utime(snap.path, (snap.created - age * 100, snap.created - age * 100))
        ids.append(snap.id)
    return ids


def test_evicts_least_recently_used_until_it_fits(tmp_path):
    store = SnapshotStore(tmp_path / "cache")
    oldest, middle, newest = _aged(store, [1000, 1000, 1000])
    cache = SnapshotCache(store, max_bytes=2500)
    assert cache.usage() == 3000  # the image bytes, as the manifests give them
    assert cache.evict(remote_ids={oldest, middle, newest}) == [oldest]
    assert {s.id for s in store.list()} == {middle, newest}
    # Touching marks a snapshot used: the other one goes first next time.
    cache.touch(middle)
    assert cache.evict(remote_ids={middle, newest}, incoming_bytes=1500) == [newest]


def test_never_evicts_protected_or_local_only_snapshots(tmp_path):
    store = SnapshotStore(tmp_path / "cache")
    in_use, local_only, evictable = _aged(store, [1000, 1000, 1000])
    cache = SnapshotCache(store, max_bytes=100)
    evicted = cache.evict(remote_ids={in_use, evictable}, protected={in_use})
    assert evicted == [evictable]
    # Over the cap still, but what is left is in use or exists nowhere else.
    assert {s.id for s in store.list()} == {in_use, local_only}
    assert cache.usage() > cache.max_bytes


def test_no_cap_evicts_nothing(tmp_path):
    store = SnapshotStore(tmp_path / "cache")
    ids = _aged(store, [1000, 1000])
    assert SnapshotCache(store, max_bytes=0).evict(remote_ids=set(ids)) == []
    assert len(store.list()) == 2
