"""The server's side of the remote store: a listing of the remote snapshots that is cached
briefly, and the transfers of ``node.snapshots.NodeSnapshots`` as jobs see them (progress at
a bounded rate, a stop when the server stops, the listing forgotten after each change).

Every call of the node layer blocks, so each runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import SnapshotError
from ..core.hooks import Progress
from ..core.store import Snapshot
from ..node.remotes import RemoteSnapshot, RemoteStore, describe
from ..node.snapshots import NodeSnapshots

# How long a remote listing is reused; the UI polls every few seconds.
LISTING_SECONDS = 15.0
# How long a request waits for the first listing of an unresponsive remote.
FIRST_LISTING_SECONDS = 5.0
# Job progress from the transfer threads, at most this often.
PROGRESS_SECONDS = 0.1


class UploadStopped(SnapshotError):
    """An upload given up because the server stops; the local snapshot is whole."""

    code = "upload_stopped"


@dataclass
class RemoteListing:
    """The remote snapshots as last listed, judged by this node's key."""

    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    listed_at: float = 0.0
    error: str | None = None


class RemoteSync:
    """Moves snapshots between the local store (the cache) and one remote store."""

    def __init__(
        self,
        node: NodeSnapshots,
        log: logging.Logger | None = None,
        listing_seconds: float = LISTING_SECONDS,
    ) -> None:
        assert node.remote is not None and node.pending is not None
        self.node = node
        self.remote: RemoteStore = node.remote
        self.log = log or logging.getLogger(__name__)
        self.listing_seconds = listing_seconds
        # Local snapshots whose upload has not completed yet (retried by the service).
        self.pending = node.pending
        self._listing = RemoteListing()
        # Each remote snapshot is read once per revision of its remote manifest (a rename
        # replaces it).
        self._known: dict[str, tuple[str, RemoteSnapshot]] = {}
        self._reading = threading.Lock()
        self._refresh: asyncio.Task[RemoteListing] | None = None
        self._forgotten = False
        self._generation = 0
        # Set when the server stops: uploads still running give up at their next part.
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return self.remote.url

    # -- listing ---------------------------------------------------------------------------
    async def listing(self, fresh: bool = False) -> RemoteListing:
        """The remote snapshots; a listing younger than ``listing_seconds`` is reused.

        A stale one is returned at once while a new one is made in the background, so a
        slow or unreachable remote never holds up a request that has a listing to show;
        ``fresh`` waits for a new one (a restore or delete acts on what is there now).
        """
        fresh = fresh or self._forgotten
        age = time.monotonic() - self._listing.listed_at
        if not fresh and age < self.listing_seconds:
            return self._listing
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._list())
        if fresh:
            self._forgotten = False
            return await asyncio.shield(self._refresh)
        if self._listing.listed_at == 0.0 and not self._listing.snapshots:
            # Nothing to show yet: wait for the first listing, but not for a remote that
            # does not answer (it goes on in the background).
            done, _ = await asyncio.wait({self._refresh}, timeout=FIRST_LISTING_SECONDS)
            if not done:
                return RemoteListing(error=f"listing {self.url} is still under way")
            return self._refresh.result()
        return self._listing

    def cached(self) -> RemoteListing:
        """The last listing as it is, without asking the remote store."""
        return self._listing

    def forget(self) -> None:
        """Make the next listing ask the remote store again and wait for its answer (after
        an upload or a delete, so that nobody is shown what was there before)."""
        self._listing.listed_at = 0.0
        self._forgotten = True
        # One under way may have listed before the change: its answer is not kept.
        self._generation += 1
        self._refresh = None

    async def _list(self) -> RemoteListing:
        generation = self._generation
        try:
            found = await asyncio.to_thread(self._read_listing)
        except Exception as exc:
            error = f"listing {self.url} failed: {describe(exc)}"
            if error != self._listing.error:
                self.log.warning("gpu-snapshot: %s", error)
            # Keep showing what was there; retry at the next request.
            listing = RemoteListing(self._listing.snapshots, 0.0, error)
        else:
            listing = RemoteListing(found, time.monotonic(), None)
        if generation == self._generation:  # not begun before a change this node made
            self._listing = listing
        return listing

    def _read_listing(self) -> dict[str, Snapshot]:
        """One listing of the remote, plus the manifests of snapshots not seen before."""
        with self._reading:  # a listing begun before a forget() may still run
            revisions = self.remote.revisions()
            for gone in set(self._known) - set(revisions):
                del self._known[gone]
            for snapshot_id, revision in revisions.items():
                known = self._known.get(snapshot_id)
                if known is None or known[0] != revision:
                    found = self.remote.get(snapshot_id, missing_ok=True)
                    if found is not None:  # None: deleted meanwhile
                        self._known[snapshot_id] = (revision, found)
            return {i: self.node.judge(s) for i, (_, s) in sorted(self._known.items())}

    # -- upload ----------------------------------------------------------------------------
    async def upload(
        self, snapshot: Snapshot, report: Callable[[Progress], None], protected: Collection[str]
    ) -> dict[str, Any]:
        """Upload a committed snapshot; called by ``Uploads``: after a save, in a retry
        pass, at shutdown.

        Returns what the job's ``result.upload`` says: ``status`` "uploaded" or "failed"
        (with ``error``). A failed upload leaves the local snapshot as it was, and marked
        as pending, so that it is uploaded again later (``Uploads.upload_pending``).
        """
        started = time.monotonic()
        progress = _progress(report, "uploading", self.stopping)
        try:
            uploaded = await asyncio.to_thread(self.node.upload, snapshot, progress)
        except SnapshotError as exc:
            self.log.warning(
                "gpu-snapshot: snapshot %s is saved here, but its upload to %s failed: %s",
                snapshot.id, self.url, exc,
            )
            return {"status": "failed", "url": self.url, "error": exc.to_dict()}
        finally:
            self.forget()
        seconds = time.monotonic() - started
        self.log.info(
            "gpu-snapshot: uploaded snapshot %s to %s (%d bytes in %.1f s)",
            snapshot.id, uploaded.url, uploaded.size_bytes, seconds,
        )
        await self.evict(protected)
        return {"status": "uploaded", "url": uploaded.url, "seconds": round(seconds, 3)}

    # -- download --------------------------------------------------------------------------
    async def download(
        self, snapshot: Snapshot, report: Callable[[Progress], None], protected: Collection[str]
    ) -> Snapshot:
        """Fetch a remote-only snapshot into the local store (``NodeSnapshots.download``);
        called by the restore job. Returns it as a local snapshot."""
        report(Progress("downloading"))
        listing = await self.listing(fresh=True)
        # Without a listing, nothing is known to be safe remotely: nothing is evicted.
        remote_ids = set(listing.snapshots) if listing.error is None else set()
        progress = _progress(report, "downloading", None)
        return await asyncio.to_thread(
            self.node.download, snapshot, progress, protected, remote_ids)

    async def evict(self, protected: Collection[str], incoming_bytes: int = 0) -> list[str]:
        """Keep the local store under ``remote_cache_max_bytes``: only snapshots that also
        exist remotely and are not ``protected`` (in use) go, least recently used first."""
        if self.node.cache is None or self.node.cache.max_bytes <= 0:
            return []
        listing = await self.listing(fresh=True)
        if listing.error is not None:
            return []  # without a listing, nothing is known to be safe remotely
        return await asyncio.to_thread(
            self.node.evict, set(listing.snapshots), protected, incoming_bytes)

    async def delete(self, snapshot_id: str) -> bool:
        """Delete the remote copy; False when there was none."""
        try:
            return await asyncio.to_thread(self.node.delete_remote_copy, snapshot_id)
        finally:
            self.forget()


def _progress(
    report: Callable[[Progress], None], phase: str, stopping: threading.Event | None
) -> Callable[[int, int], None]:
    """A transfer's ``progress(done, total)``, called from its worker threads, as job
    progress at most every ``PROGRESS_SECONDS``; raises once ``stopping`` is set."""
    lock = threading.Lock()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if stopping is not None and stopping.is_set():
            raise UploadStopped(
                "upload", "the server is stopping",
                hint="the snapshot is saved locally and goes up at the next server start "
                "('jupyter gpu-snapshot upload ID' sends it at once)",
            )
        now = time.monotonic()
        with lock:
            if done < total and now - last[0] < PROGRESS_SECONDS:
                return
            last[0] = now
        report(Progress(phase, done, total))

    return progress

