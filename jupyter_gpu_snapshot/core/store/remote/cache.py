"""The local store as a cache of remote snapshots: a size cap and least-recently-used eviction.

Only snapshots that also exist remotely may be evicted, and never one in use (the caller
names those), so eviction never loses a snapshot. A snapshot's last use is its directory's
mtime, set by ``touch``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

from ..snapshot import Snapshot
from ..store import SnapshotStore


class SnapshotCache:
    """Keeps the snapshots in ``store`` under ``max_bytes`` (0: no cap) by evicting the LRU."""

    def __init__(self, store: SnapshotStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes

    def touch(self, snapshot_id: str) -> None:
        """Mark a snapshot used now; called after a download and before a restore."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.store.root / snapshot_id)

    def last_used(self, snapshot: Snapshot) -> float:
        try:
            return os.stat(snapshot.path).st_mtime
        except FileNotFoundError:
            return 0.0

    def usage(self) -> int:
        return sum(s.size_bytes for s in self.store.list())

    def evict(
        self,
        remote_ids: Collection[str],
        protected: Collection[str] = (),
        incoming_bytes: int = 0,
    ) -> list[str]:
        """Delete least recently used snapshots until ``incoming_bytes`` more fit under the cap.

        Called before a download (with its size) and after an upload. Only ids in
        ``remote_ids`` (present remotely) are candidates, and none in ``protected`` (being
        restored, uploaded or otherwise in use). Returns the evicted ids, oldest use first;
        the cap may stay exceeded when nothing else may go.
        """
        if self.max_bytes <= 0:
            return []
        snapshots = self.store.list()
        used = sum(s.size_bytes for s in snapshots)
        candidates = sorted(
            (s for s in snapshots if s.id in remote_ids and s.id not in protected),
            key=self.last_used,
        )
        evicted: list[str] = []
        for snapshot in candidates:
            if used + incoming_bytes <= self.max_bytes:
                break
            self.store.delete(snapshot.id)
            used -= snapshot.size_bytes
            evicted.append(snapshot.id)
        return evicted
