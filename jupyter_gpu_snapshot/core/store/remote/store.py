"""The remote store: a snapshot's objects (``objects.RemoteObjects``) and its transfers.

``RemoteStore`` is what the server and the CLI hold: listing and deleting come from
``RemoteObjects``, uploads, downloads and renames from their own modules, which build on
``RemoteObjects`` and never on this module, so imports go one way.

All methods block: the server calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import builtins
import contextlib
import time
from pathlib import Path
from typing import Any

from ...progress import ProgressFn
from ..snapshot import is_snapshot_id
from ..store import SnapshotStore
from .objects import REMOTE_MANIFEST, RemoteObjects, RemoteSnapshot, modified_time, safe_snapshot_id

# The transfers and the packs are imported by the calls that run them: holding a remote
# store, or none, costs a listing nothing of them (nor numpy).


class RemoteStore(RemoteObjects):
    """The snapshots under one fsspec URL, e.g. ``s3://bucket/prefix``; see ``RemoteObjects``
    for the options and the encryption key."""

    # A delete collects the packs no remote manifest names that are older than this: an
    # upload in progress (its manifest not up yet) wrote its pack more recently.
    pack_grace: float = 3600.0

    def delete(self, snapshot_id: str) -> None:
        """Remove a remote snapshot (``RemoteObjects.delete``), then the packs that no
        remote snapshot needs any more, past ``pack_grace``. The snapshot is gone once this
        returns; a failure to collect only leaves packs for the next delete or clean-up."""
        super().delete(snapshot_id)
        with contextlib.suppress(Exception):
            self.collect_packs(time.time() - self.pack_grace)

    def clean_incomplete(self, older_than: float = 3600.0) -> builtins.list[str]:
        """Remove uploads that never completed and are older than ``older_than`` seconds,
        and the remote packs that no remote manifest names, as old.

        Another node may be uploading right now, so young leftovers stay. On S3, multipart
        uploads that were started and never finished are aborted too.
        """
        from .packs import PACKS_DIR

        cutoff = time.time() - older_than
        self.fs.invalidate_cache()
        try:
            entries: dict[str, dict[str, Any]] = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            entries = {}
        newest: dict[str, float] = {}
        complete: set[str] = set()
        for path, info in entries.items():
            parts = str(path).split("/")
            if len(parts) < 2 or parts[-2] == PACKS_DIR or not is_snapshot_id(parts[-2]):
                continue
            snapshot_id = parts[-2]
            if parts[-1] == REMOTE_MANIFEST:
                complete.add(snapshot_id)
            newest[snapshot_id] = max(newest.get(snapshot_id, 0.0), modified_time(info))
        removed = [i for i, t in sorted(newest.items()) if i not in complete and t <= cutoff]
        for snapshot_id in removed:
            self.discard(snapshot_id)
        self.collect_packs(cutoff)
        if self.is_s3:
            from .upload import abort_stale_multipart

            abort_stale_multipart(self, cutoff)
        return removed

    def collect_packs(self, cutoff: float) -> builtins.list[str]:
        """Remove the remote packs no remote manifest names whose objects are all older
        than ``cutoff``; nothing when a remote manifest cannot be read (it might name any).
        Returns the packs removed.

        The remote manifests are listed again right before the removal: one that went up
        meanwhile (an upload that reused an old pack) makes the count start over.
        """
        from .packs import RemotePacks

        packs = RemotePacks(self)
        for _ in range(3):
            revisions = self.revisions()
            referenced: set[str] = set()
            for snapshot_id in revisions:
                try:
                    remote = self.read_remote_manifest(snapshot_id)
                except Exception:  # unreadable: it might name any pack, so keep them all
                    return []
                referenced.update(str(s) for s in (remote or {}).get("packs", []))
            doomed = packs.garbage(referenced, cutoff)
            if not doomed:
                return []
            if self.revisions() == revisions:
                for stem in doomed:
                    packs.remove(stem)
                return doomed
        return []

    # -- transfers --------------------------------------------------------------------------
    def upload(
        self, snapshot_dir: Path | str, progress: ProgressFn | None = None,
        local: SnapshotStore | None = None,
    ) -> RemoteSnapshot:
        """Upload a committed local snapshot of ``local`` (needed when it is kept by
        content); see ``upload.upload_snapshot``."""
        from .upload import upload_snapshot

        return upload_snapshot(self, Path(snapshot_dir), progress, local)

    def rename_copy(self, snapshot_dir: Path | str) -> RemoteSnapshot | None:
        """Carry a local rename to the remote copy; see ``rename.rename_remote_copy``."""
        from .rename import rename_remote_copy

        return rename_remote_copy(self, Path(snapshot_dir))

    def download(
        self, snapshot_id: str, into: Path | str | SnapshotStore,
        progress: ProgressFn | None = None,
    ) -> Path:
        """Download a remote snapshot into a store (or a store's directory, with the default
        signing key); see ``download.download_snapshot``."""
        from .download import download_snapshot

        target = into if isinstance(into, SnapshotStore) else Path(into)
        return download_snapshot(self, safe_snapshot_id(snapshot_id), target, progress)
