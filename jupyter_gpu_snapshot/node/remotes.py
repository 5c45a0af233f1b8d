"""The remote store and the local cache, built from ``c.GPUSnapshot``, and what the server
and the CLI both show of them.

Callers that move snapshots between nodes call ``make_remote_store`` (None when no
remote_url is set) and ``make_snapshot_cache``; core/store/remote/ itself knows nothing of settings.
"""

from __future__ import annotations

from typing import Any

from ..config import GPUSnapshot
from ..core.store import (
    DAMAGED,
    RemoteSnapshot,
    RemoteStore,
    Snapshot,
    SnapshotCache,
    SnapshotStore,
    describe,
    load_key,
)

# What the server's remote listing holds and says of a failure (``describe``: an error of
# the object store as one line).
__all__ = [
    "BOTH", "LOCAL", "REMOTE", "RemoteSnapshot", "RemoteStore", "describe", "judge_remote",
    "make_remote_store", "make_snapshot_cache", "merge_locations", "remote_storage_options",
]

# Where a snapshot lives, as listings say it.
LOCAL, REMOTE, BOTH = "local", "remote", "both"


def remote_storage_options(settings: GPUSnapshot) -> dict[str, Any]:
    options: dict[str, Any] = dict(settings.remote_options)
    if settings.remote_endpoint_url:
        options.setdefault("endpoint_url", settings.remote_endpoint_url)
    return options


def make_remote_store(settings: GPUSnapshot | None = None) -> RemoteStore | None:
    settings = settings or GPUSnapshot()
    if not settings.remote_url:
        return None
    key_file = settings.remote_encryption_key_file
    return RemoteStore(
        settings.remote_url,
        remote_storage_options(settings),
        key=load_key(key_file) if key_file else None,
        part_bytes=settings.remote_part_bytes,
        workers=settings.remote_workers,
    )


def make_snapshot_cache(settings: GPUSnapshot | None = None) -> SnapshotCache:
    settings = settings or GPUSnapshot()
    return SnapshotCache(SnapshotStore(settings.store_dir), settings.remote_cache_max_bytes)


def judge_remote(store: SnapshotStore, remote: RemoteSnapshot) -> Snapshot:
    """A remote snapshot as a ``Snapshot`` of ``store``, its status by that store's key:
    one signed with another key, or unreadable here, is ``damaged`` and says why."""
    if remote.manifest is None:
        cause = (
            "it is encrypted with a key this node does not have"
            if remote.encrypted else "its manifest cannot be read"
        )
        return Snapshot(remote.id, store.root / remote.id, {}, DAMAGED, cause)
    return store.judge(remote.id, remote.manifest)


def merge_locations(
    local: list[dict[str, Any]], remote: dict[str, Snapshot], url: str | None
) -> list[dict[str, Any]]:
    """Local summaries with their ``location`` and ``remote_url``, plus the summaries of
    the snapshots that exist only remotely; oldest first."""
    merged = []
    for summary in local:
        where = BOTH if summary["id"] in remote else LOCAL
        merged.append({**summary, "location": where, "remote_url": url if where == BOTH else None})
    local_ids = {s["id"] for s in local}
    for snapshot_id, snapshot in remote.items():
        if snapshot_id not in local_ids:
            merged.append({**snapshot.summary(), "location": REMOTE, "remote_url": url})
    merged.sort(key=lambda s: (s.get("created") or 0.0, s["id"]))
    return merged
