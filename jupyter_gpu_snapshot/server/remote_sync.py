"""The server's side of the remote store: uploads after saves, downloads before restores,
and a listing of the remote snapshots that is cached briefly.

Every call of the remote store blocks, so each runs in a worker thread. A remote snapshot
is judged by this node's signing key from its manifest before anything of it is fetched:
one signed with another key, or unsigned, is listed as such and never downloaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import NotFound, SnapshotError
from ..core.hooks import Progress
from ..core.remote import RemoteSnapshot, RemoteStore, SnapshotCache
from ..core.remote.objects import describe
from ..core.remote.pending import PendingUploads
from ..core.snapshot import Snapshot
from ..core.store import SnapshotStore
from ..remotes import judge_remote, upload_local

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
        remote: RemoteStore,
        store: SnapshotStore,
        cache: SnapshotCache,
        log: logging.Logger | None = None,
        listing_seconds: float = LISTING_SECONDS,
    ) -> None:
        self.remote = remote
        self.store = store
        self.cache = cache
        self.log = log or logging.getLogger(__name__)
        self.listing_seconds = listing_seconds
        # Local snapshots whose upload has not completed yet (retried by the service).
        self.pending = PendingUploads(store)
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
            return {i: self.judge(s) for i, (_, s) in sorted(self._known.items())}

    def judge(self, remote: RemoteSnapshot) -> Snapshot:
        """A remote snapshot as a ``Snapshot`` of this store, its status by this node's key."""
        return judge_remote(self.store, remote)

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
        await asyncio.to_thread(self.pending.mark, snapshot.id)
        progress = _progress(report, "uploading", self.stopping)
        try:
            uploaded = await asyncio.to_thread(upload_local, self.store, self.remote, snapshot,
                                               progress)
        except SnapshotError as exc:
            self.log.warning(
                "gpu-snapshot: snapshot %s is saved here, but its upload to %s failed: %s",
                snapshot.id, self.url, exc,
            )
            return {"status": "failed", "url": self.url, "error": exc.to_dict()}
        finally:
            self.forget()
        await asyncio.to_thread(self.pending.clear, snapshot.id)
        seconds = time.monotonic() - started
        self.log.info(
            "gpu-snapshot: uploaded snapshot %s to %s (%d bytes in %.1f s)",
            snapshot.id, uploaded.url, uploaded.size_bytes, seconds,
        )
        await self.evict(protected)
        return {"status": "uploaded", "url": uploaded.url, "seconds": round(seconds, 3)}

    # -- rename ----------------------------------------------------------------------------
    async def rename(self, snapshot: Snapshot) -> dict[str, Any]:
        """Carry a local rename to the remote copy; called by the service after the local
        rename succeeded. Returns ``status`` "renamed", "none" (no remote copy) or "failed"
        (with ``error``: the remote copy keeps its old name)."""
        try:
            renamed = await asyncio.to_thread(self.remote.rename_copy, snapshot.path)
        except SnapshotError as exc:
            error = SnapshotError(
                "rename",
                f"snapshot {snapshot.id} is renamed to {snapshot.name!r} here, but its copy in "
                f"{self.url} keeps its old name ({exc.cause})",
                hint=f"rename it to {snapshot.name!r} again once {self.url} answers",
            )
            self.log.warning("gpu-snapshot: %s", error.message)
            return {"status": "failed", "url": self.url, "error": error.to_dict()}
        finally:
            self.forget()
        if renamed is None:
            return {"status": "none", "url": self.url}
        self.log.info("gpu-snapshot: renamed the copy of %s in %s to %r", snapshot.id, self.url,
                      snapshot.name)
        return {"status": "renamed", "url": renamed.url}

    # -- download --------------------------------------------------------------------------
    async def download(
        self, snapshot_id: str, report: Callable[[Progress], None], protected: Collection[str]
    ) -> None:
        """Fetch a remote-only snapshot into the local store; called by the restore job.

        Its manifest is read and judged by this node's signing key first: an unsigned or
        foreign one is refused before a byte of its images is fetched.
        """
        report(Progress("downloading"))
        remote = await asyncio.to_thread(self.remote.get, snapshot_id)
        assert remote is not None
        judged = self.judge(remote)
        if not judged.trusted:
            raise SnapshotError(
                "verify",
                f"remote snapshot {snapshot_id} in {self.url} is refused, nothing of it was "
                f"run or kept: {judged.problem}",
                hint="a node restores only snapshots signed with its own signing key: give "
                "every node the same key file (c.GPUSnapshot.signing_key_file)",
            )
        await self.evict(protected, incoming_bytes=remote.size_bytes)
        progress = _progress(report, "downloading", None)
        await asyncio.to_thread(self.remote.download, snapshot_id, self.store, progress)
        await asyncio.to_thread(self.cache.touch, snapshot_id)
        self.log.info("gpu-snapshot: downloaded snapshot %s from %s", snapshot_id, self.url)

    async def evict(self, protected: Collection[str], incoming_bytes: int = 0) -> list[str]:
        """Keep the local store under ``remote_cache_max_bytes``: only snapshots that also
        exist remotely and are not ``protected`` (in use) go, least recently used first."""
        if self.cache.max_bytes <= 0:
            return []
        listing = await self.listing(fresh=True)
        if listing.error is not None:
            return []  # without a listing, nothing is known to be safe remotely
        evicted = await asyncio.to_thread(
            self.cache.evict, set(listing.snapshots), protected, incoming_bytes
        )
        for snapshot_id in evicted:
            self.log.info(
                "gpu-snapshot: removed the local copy of %s (it stays in %s)", snapshot_id,
                self.url,
            )
        return evicted

    # -- delete ----------------------------------------------------------------------------
    async def delete(self, snapshot_id: str) -> bool:
        """Delete the remote copy; False when there was none."""
        try:
            await asyncio.to_thread(self.remote.delete, snapshot_id)
        except NotFound:
            return False
        finally:
            self.forget()
        return True

    async def exists(self, snapshot_id: str) -> bool:
        return bool(await asyncio.to_thread(self.remote.exists, snapshot_id))


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

