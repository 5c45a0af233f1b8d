"""Which local snapshots still owe their upload: one empty file per snapshot id in the
store's ``.upload-pending`` directory.

A snapshot is marked when it is committed with a remote store configured and unmarked once
its upload completed, so one whose upload failed, was given up at shutdown or was cut off
by a crash is uploaded again later. A snapshot kept local on purpose (its remote copy
deleted, or saved without a remote store) is never marked, so never uploaded by itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ... import safe_fs
from ..snapshot import is_snapshot_id
from ..store import SnapshotStore

PENDING_DIR = ".upload-pending"


class PendingUploads:
    """The upload-pending marks of one local store; every call blocks (file system)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def mark(self, snapshot_id: str) -> None:
        """Called once a save committed, before its upload starts."""
        assert is_snapshot_id(snapshot_id)
        with self._dir(create=True) as fd:
            assert fd is not None
            with contextlib.suppress(FileExistsError):
                safe_fs.write_new(snapshot_id, fd, b"")

    def clear(self, snapshot_id: str) -> None:
        """Called once the upload completed, or when the snapshot is gone."""
        with self._dir(create=False) as fd:
            if fd is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(snapshot_id, dir_fd=fd)

    def ids(self) -> list[str]:
        """The marked snapshot ids, oldest first (ids begin with their creation time)."""
        with self._dir(create=False) as fd:
            if fd is None:
                return []
            return sorted(n for n in os.listdir(fd) if is_snapshot_id(n))

    @contextlib.contextmanager
    def _dir(self, create: bool) -> Iterator[int | None]:
        root = self.store.root
        if not create and not os.path.isdir(root / PENDING_DIR):
            yield None
            return
        with self.store._root_fd() as root_fd:
            assert root_fd is not None
            with contextlib.suppress(FileExistsError):
                os.mkdir(PENDING_DIR, 0o700, dir_fd=root_fd)
            # Opened without following a link: the marks stay inside the store.
            with safe_fs.opened_dir(PENDING_DIR, root_fd) as fd:
                yield fd
