"""The store's snapshots in memory: every manifest is read once, not once per request.

A refresh is one ``scandir`` of the store plus one ``lstat`` of each snapshot's manifest:
snapshots appear and disappear by renames in the store (``SnapshotStore.commit`` and
``delete``, whichever process makes them), and a manifest changes in place only when
``jupyter gpu-snapshot trust`` signs it. Only new or changed manifests are read, through
the store, which checks their signature and schema.
"""

from __future__ import annotations

import builtins
import os
import threading

from ..errors import NotFound
from .manifest import MANIFEST
from .snapshot import DAMAGED, Snapshot, is_snapshot_id, validate_name
from .store import SnapshotStore

_Stamp = tuple[int, int, int]


class SnapshotIndex:
    """Snapshots of one ``SnapshotStore`` with their status, kept up to date. Thread-safe."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._by_id: dict[str, Snapshot] = {}
        # What each manifest looked like when it was read (inode, mtime, size).
        self._stamps: dict[str, _Stamp | None] = {}

    def refresh(self) -> None:
        """Bring the index up to date with the store directory."""
        root = self.store.root
        with self._lock:
            try:
                with os.scandir(root) as it:
                    names = {
                        e.name for e in it
                        if is_snapshot_id(e.name) and e.is_dir(follow_symlinks=False)
                    }
            except (FileNotFoundError, NotADirectoryError):
                names = set()
            for gone in set(self._stamps) - names:
                self._stamps.pop(gone, None)
                self._by_id.pop(gone, None)
            for name in names:
                self._reread(name)

    def _reread(self, name: str) -> None:
        """Read snapshot ``name`` again if its manifest changed since it was read (or it
        is new); drop it when the store has it no more. Called with the lock held."""
        stamp = _stamp(os.path.join(self.store.root, name, MANIFEST))
        if name in self._stamps and self._stamps[name] == stamp:
            return
        self._stamps[name] = stamp
        try:
            self._by_id[name] = self.store.get(name)
        except NotFound:
            self._by_id.pop(name, None)

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Every snapshot whatever its status, oldest first; optionally one notebook's."""
        self.refresh()
        with self._lock:
            found = [
                s for s in self._by_id.values()
                if notebook_path is None
                or (s.status != DAMAGED and s.notebook_path == notebook_path)
            ]
        return sorted(found, key=lambda s: (s.created, s.id))

    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Trusted snapshots, oldest first: what retention, status and restores act on."""
        return [s for s in self.catalog(notebook_path) if s.trusted]

    def find_name(self, name: str) -> Snapshot | None:
        """The trusted snapshot named ``name``."""
        return next((s for s in self.list() if s.name == name), None)

    def get(self, ref: str) -> Snapshot:
        """By id (whatever its status) or by name (trusted ones only), as the store says it.
        By id, that snapshot alone is read again: a command's one lookup in a fresh process
        reads one manifest, not the store's every one."""
        if is_snapshot_id(ref):
            with self._lock:
                self._reread(ref)
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


def _stamp(path: str) -> _Stamp | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
