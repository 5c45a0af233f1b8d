"""The store's snapshots in memory: every manifest is read once, not once per request.

Listing a store means one ``scandir`` of its directory: snapshots appear and disappear by
renames there (``SnapshotStore.commit`` and ``delete``), whichever process makes them, so the
entries say what changed and only manifests of new entries are read. When the directory's
mtime and inode are those of the last look, not even the entries are read again.
"""

from __future__ import annotations

import builtins
import os
import threading
import time

from .errors import NotFound
from .store import Snapshot, SnapshotStore, is_snapshot_id, validate_name

# A coarse mtime can hide a change made within the same tick: a directory changed this
# recently is read again, whatever its mtime says.
_MTIME_TRUST_NS = 2_000_000_000


class SnapshotIndex:
    """Committed snapshots of one ``SnapshotStore``, kept up to date. Thread-safe."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._by_id: dict[str, Snapshot] = {}
        # Entries whose manifest could not be read: not snapshots, and not read again.
        self._unreadable: set[str] = set()
        self._stamp: tuple[int, int] | None = None

    def refresh(self) -> None:
        """Bring the index up to date with the store directory."""
        root = self.store.root
        with self._lock:
            try:
                st = os.stat(root)
            except FileNotFoundError:
                self._by_id.clear()
                self._unreadable.clear()
                self._stamp = None
                return
            stamp = (st.st_ino, st.st_mtime_ns)
            settled = st.st_mtime_ns < time.time_ns() - _MTIME_TRUST_NS
            if stamp == self._stamp and settled:
                return
            with os.scandir(root) as it:
                names = {e.name for e in it if is_snapshot_id(e.name)}
            for gone in set(self._by_id) - names:
                del self._by_id[gone]
            self._unreadable &= names
            for name in names - set(self._by_id) - self._unreadable:
                try:
                    self._by_id[name] = self.store.get(name)
                except NotFound:
                    self._unreadable.add(name)
            self._stamp = stamp

    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Committed snapshots, oldest first; optionally only one notebook's."""
        self.refresh()
        with self._lock:
            found = [
                s for s in self._by_id.values()
                if notebook_path is None or s.notebook_path == notebook_path
            ]
        return sorted(found, key=lambda s: (s.created, s.id))

    def find_name(self, name: str) -> Snapshot | None:
        self.refresh()
        with self._lock:
            return next((s for s in self._by_id.values() if s.manifest.get("name") == name), None)

    def get(self, ref: str) -> Snapshot:
        """A snapshot by id or by name; NotFound as ``SnapshotStore.get`` says it."""
        if is_snapshot_id(ref):
            self.refresh()
            with self._lock:
                found = self._by_id.get(ref)
        else:
            found = self.find_name(validate_name(ref))
        if found is None:
            raise NotFound(
                "lookup",
                f"no snapshot {ref!r} in {self.store.root}",
                hint="'jupyter gpu-snapshot list' shows the snapshots there are",
            )
        return found

