"""The remote store and the local cache, built from ``c.GPUSnapshot``.

Callers that move snapshots between nodes call ``make_remote_store`` (None when no
remote_url is set) and ``make_snapshot_cache``; core/remote itself knows nothing of settings.
"""

from __future__ import annotations

from typing import Any

from .config import GPUSnapshot
from .core.remote import RemoteStore, SnapshotCache, load_key
from .core.store import SnapshotStore


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
