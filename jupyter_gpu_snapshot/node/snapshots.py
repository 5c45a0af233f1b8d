"""This node's snapshots, local and remote, however the engine is reached: ``NodeSnapshots``.

Every operation that looks at both places is written here once, as a plain synchronous
method that raises the core's errors: the CLI calls it and prints, the server's service
calls it in a worker thread and keeps the jobs, locks and sessions around it. A remote
snapshot is judged by this node's signing key from its manifest before anything of it is
fetched; one signed with another key, or unsigned, is listed as such and never downloaded.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import GPUSnapshot
from ..core.errors import InvalidRequest, NotFound, SnapshotError
from ..core.store import (
    DAMAGED,
    PendingUploads,
    RemoteSnapshot,
    RemoteStore,
    RemoteStoreError,
    Snapshot,
    SnapshotCache,
    describe,
    is_snapshot_id,
    newest_per_notebook,
    validate_name,
)
from .engine import NodeEngine
from .local_engine import process_engine
from .notebook_moves import NotebookMoves
from .remotes import BOTH, LOCAL, REMOTE, judge_remote, make_remote_store, merge_locations

log = logging.getLogger(__name__)

# A transfer's progress: bytes done, bytes in all. Called from its worker threads.
TransferProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class Found:
    """A snapshot a reference named, and whether this node has a copy of it (else it is
    only in the remote store)."""

    snapshot: Snapshot
    local: bool


@dataclass(frozen=True)
class Deleted:
    """What a delete removed: the local copy, the remote copy."""

    snapshot: Snapshot
    local: bool
    remote: bool


class NodeSnapshots:
    """The engine's snapshots and, with ``c.GPUSnapshot.remote_url``, the remote store's.

    Through the node agent there is no remote store: the agent keeps snapshots on this node.
    Every snapshot handed out has its notebook where it is now (``moves``, the renames the
    server saw; none kept without it).
    """

    def __init__(self, engine: NodeEngine, remote: RemoteStore | None = None,
                 cache_max_bytes: int = 0, moves: NotebookMoves | None = None) -> None:
        self.engine = engine
        self.moves = moves or NotebookMoves(None)
        self.remote = remote if engine.local_store is not None else None
        store = engine.local_store
        self._store = store
        # The local store as the remote store's cache, and the uploads it owes there.
        self.cache = SnapshotCache(store, cache_max_bytes) if store is not None else None
        self.pending = PendingUploads(store) if store is not None else None

    @classmethod
    def from_settings(cls, settings: GPUSnapshot | None = None) -> NodeSnapshots:
        settings = settings or GPUSnapshot()
        engine = process_engine(settings)
        remote = make_remote_store(settings) if engine.local_store is not None else None
        return cls(engine, remote, int(settings.remote_cache_max_bytes),
                   NotebookMoves(engine.own_dir))

    @property
    def remote_url(self) -> str | None:
        return self.remote.url if self.remote is not None else None

    def require_remote(self, step: str) -> RemoteStore:
        """The remote store; InvalidRequest when there is none."""
        if self.remote is None:
            raise InvalidRequest(step, "there is no remote store",
                                 hint="set c.GPUSnapshot.remote_url")
        return self.remote

    # -- listings ------------------------------------------------------------------------------
    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """The trusted local snapshots (of the notebook now at ``notebook_path``), oldest
        first: what retention, status and restores act on."""
        return self._of(self.engine.list(), notebook_path)

    def get(self, ref: str) -> Snapshot:
        """The local snapshot ``ref`` names (an id, or a trusted one's name); NotFound."""
        return self.moves.place(self.engine.get(ref))

    def _of(self, snapshots: Iterable[Snapshot], notebook_path: str | None
            ) -> builtins.list[Snapshot]:
        placed = [self.moves.place(s) for s in snapshots]
        if notebook_path is None:
            return placed
        return [s for s in placed if s.status != DAMAGED and s.notebook_path == notebook_path]

    def judge(self, remote: RemoteSnapshot) -> Snapshot:
        """A remote snapshot as a ``Snapshot`` of the local store, its status by its key."""
        assert self._store is not None  # a remote store implies the local one
        return self.moves.place(judge_remote(self._store, remote))

    def remote_snapshots(self) -> dict[str, Snapshot]:
        """Every remote snapshot, judged; none without a remote store. Raises
        RemoteStoreError when the remote store does not answer."""
        if self.remote is None:
            return {}
        try:
            return {s.id: self.judge(s) for s in self.remote.list()}
        except SnapshotError:
            raise
        except Exception as exc:  # the remote store did not answer
            raise RemoteStoreError("list", f"listing {self.remote.url} failed: {describe(exc)}",
                                   hint="check the remote store's address and credentials"
                                   ) from exc

    @staticmethod
    def remote_of(remote: Mapping[str, Snapshot], notebook_path: str | None = None,
                  trusted: bool = False) -> dict[str, Snapshot]:
        """The remote snapshots of one notebook (all without one), only the trusted ones
        with ``trusted``."""
        return {
            i: s for i, s in remote.items()
            if (notebook_path is None or (s.status != DAMAGED and s.notebook_path == notebook_path))
            and (s.trusted or not trusted)
        }

    def summaries(self, remote: Mapping[str, Snapshot], notebook_path: str | None = None,
                  latest: bool = False, remote_only: bool = True) -> builtins.list[dict[str, Any]]:
        """Summaries of the local snapshots and of ``remote`` (a listing of the remote
        store), each with its ``location``; oldest first. ``latest``: what a restart offers
        back, the newest trusted snapshot of each notebook, newest first. ``remote_only``
        false: the local snapshots only (the remote listing says which have a copy there)."""
        remote = self.remote_of(remote, notebook_path, trusted=latest)
        listed = self.engine.list() if latest else self.engine.catalog()
        local = [s.summary() for s in self._of(listed, notebook_path)]
        if not remote_only:
            local_ids = {s["id"] for s in local}
            remote = {i: s for i, s in remote.items() if i in local_ids}
        merged = merge_locations(local, remote, self.remote_url)
        if latest:
            return [dict(s) for s in newest_per_notebook(merged)]
        return merged

    def located(self, found: Found, remote_ids: Collection[str]) -> dict[str, Any]:
        """One snapshot's summary with its ``location`` and ``remote_url``."""
        if self.remote is None:
            return {**found.snapshot.summary(), "location": LOCAL, "remote_url": None}
        remote = not found.local or found.snapshot.id in remote_ids
        where = (BOTH if remote else LOCAL) if found.local else REMOTE
        return {**found.snapshot.summary(), "location": where,
                "remote_url": self.remote.url if remote else None}

    # -- lookup --------------------------------------------------------------------------------
    def find(self, ref: str, remote: Mapping[str, Snapshot] | None = None) -> Found:
        """The snapshot ``ref`` names (an id, or a trusted one's name): the local one, else
        the remote one. ``remote``: a fresh listing the caller holds already. Raises
        NotFound when neither side has it, RemoteStoreError when the remote store cannot be
        asked."""
        try:
            return Found(self.get(ref), True)
        except NotFound:
            if self.remote is None:
                raise
        if remote is None:
            remote = self._remote_candidates(ref)
        for snapshot in remote.values():
            if ref == snapshot.id or (snapshot.trusted and ref == snapshot.name):
                return Found(snapshot, False)
        raise NotFound(
            "lookup", f"no snapshot {ref!r} in {self.engine.location} nor in {self.remote.url}",
            hint="'jupyter gpu-snapshot list' shows the snapshots there are",
        )

    def _remote_candidates(self, ref: str) -> dict[str, Snapshot]:
        assert self.remote is not None
        try:
            if not is_snapshot_id(ref):  # a name: every remote manifest is read
                return {s.id: self.judge(s) for s in self.remote.list()}
            found = self.remote.get(ref, missing_ok=True)
        except SnapshotError:
            raise
        except Exception as exc:  # the remote store did not answer
            raise RemoteStoreError(
                "lookup",
                f"no snapshot {ref!r} in {self.engine.location}, and {self.remote.url} could "
                f"not be asked: {describe(exc)}",
                hint="check the remote store's address and credentials, then try again",
            ) from exc
        return {found.id: self.judge(found)} if found is not None else {}

    # -- rename and delete ---------------------------------------------------------------------
    def check_rename(self, found: Found, new_name: str,
                     remote: Mapping[str, Snapshot] | None = None) -> None:
        """Refuse a rename before anything is renamed: a snapshot only in the remote store
        (it is renamed on a node that holds a copy), a name that a remote snapshot has."""
        validate_name(new_name)
        if self.remote is None:
            return
        if not found.local:
            raise InvalidRequest(
                "rename",
                f"snapshot {found.snapshot.id} exists only in {self.remote.url}; a snapshot is "
                "renamed on a node that holds a copy",
                hint=f"download it first ('jupyter gpu-snapshot download {found.snapshot.id}', "
                "or restore it), then rename it",
            )
        if remote is None:
            try:
                remote = self.remote_snapshots()
            except RemoteStoreError:
                # Nothing is known to clash; the remote copy's rename then fails and says so.
                remote = {}
        others = remote
        for other in self.remote_of(others, trusted=True).values():
            if other.name == new_name and other.id != found.snapshot.id:
                raise InvalidRequest(
                    "rename",
                    f"a snapshot named {new_name!r} exists already in {self.remote.url} "
                    f"({other.id})",
                    hint="pick another name, or delete that snapshot first",
                )

    def rename(self, found: Found, new_name: str) -> tuple[Snapshot, dict[str, Any] | None]:
        """Rename the local snapshot, then its remote copy (its re-signed manifest goes up);
        call ``check_rename`` first. Returns the renamed snapshot and, with a remote store,
        how the remote copy went: ``status`` "renamed", "none" (no copy there) or "failed"
        (with ``error``: the remote copy keeps its old name, the local rename stays)."""
        renamed = self.moves.place(self.engine.rename(found.snapshot.id, new_name))
        if self.remote is None:
            return renamed, None
        try:
            copy = self.remote.rename_copy(renamed.path)
        except SnapshotError as exc:
            error = SnapshotError(
                "rename",
                f"snapshot {renamed.id} is renamed to {renamed.name!r} here, but its copy in "
                f"{self.remote.url} keeps its old name ({exc.cause})",
                hint=f"rename it to {renamed.name!r} again once {self.remote.url} answers",
            )
            log.warning("gpu-snapshot: %s", error.message)
            return renamed, {"status": "failed", "url": self.remote.url, "error": error.to_dict()}
        if copy is None:
            return renamed, {"status": "none", "url": self.remote.url}
        log.info("gpu-snapshot: renamed the copy of %s in %s to %r", renamed.id, self.remote.url,
                 renamed.name)
        return renamed, {"status": "renamed", "url": copy.url}

    def check_delete(self, found: Found, where: str) -> None:
        """Refuse a delete before anything is deleted: ``where`` is local, remote or both."""
        if where not in (LOCAL, REMOTE, BOTH):
            raise InvalidRequest("request", f"where must be local, remote or both, not {where!r}")
        if where == REMOTE:
            self.require_remote("delete")
        if where == LOCAL and not found.local:
            raise NotFound("delete", f"snapshot {found.snapshot.id} has no local copy",
                           hint="where=remote deletes the remote one")

    def delete(self, found: Found, where: str = BOTH) -> Deleted:
        """Delete a snapshot's local copy, remote copy or both (``where``); call
        ``check_delete`` first. A remote copy goes first: a local one left is listed."""
        self.check_delete(found, where)
        snapshot_id = found.snapshot.id
        deleted_remote = False
        if where != LOCAL and self.remote is not None:
            deleted_remote = self.delete_remote_copy(snapshot_id)
            if where == REMOTE and not deleted_remote:
                raise NotFound("delete", f"snapshot {snapshot_id} is not in {self.remote.url}")
        deleted_local = where != REMOTE and found.local
        if deleted_local:
            self.engine.delete(snapshot_id)
        return Deleted(found.snapshot, deleted_local, deleted_remote)

    def delete_remote_copy(self, snapshot_id: str) -> bool:
        """Delete the remote copy of a snapshot; False when there was none."""
        remote = self.require_remote("delete")
        try:
            remote.delete(snapshot_id)
        except NotFound:
            return False
        return True

    # -- transfers -----------------------------------------------------------------------------
    def upload(self, snapshot: Snapshot, progress: TransferProgress | None = None
               ) -> RemoteSnapshot:
        """Upload a committed, trusted local snapshot; one kept by content goes up chunked,
        only the pages the remote store lacks. Until it completes, the snapshot is owed to
        the remote store (``pending``): a failed upload is retried by the server later."""
        remote = self.require_remote("upload")
        assert self.pending is not None
        snapshot.require_trusted("upload")
        self.pending.mark(snapshot.id)
        uploaded = remote.upload(snapshot.path, progress, local=self._store)
        self.pending.clear(snapshot.id)
        return uploaded

    def download(self, snapshot: Snapshot, progress: TransferProgress | None = None,
                 protected: Collection[str] = (),
                 remote_ids: Collection[str] | None = None) -> Snapshot:
        """Fetch a remote-only snapshot into the local store, every digest checked as it
        streams; returns it as a local snapshot. Its manifest is judged by this node's key
        first: a refused one is not fetched at all. The caller checks the node's
        compatibility first (``NodeEngine.check_compatibility``): a node that cannot run it
        refuses before gigabytes of it come. ``remote_ids``: what the remote store holds, so
        that room is made by removing local copies that stay there (asked when None)."""
        remote = self.require_remote("download")
        if not snapshot.trusted:
            raise SnapshotError(
                "verify",
                f"remote snapshot {snapshot.id} in {remote.url} is refused, nothing of it was "
                f"fetched, run or kept: {snapshot.problem}",
                hint="a node restores only snapshots signed with its own signing key: give "
                "every node the same key file (c.GPUSnapshot.signing_key_file)",
            )
        self.evict(remote_ids if remote_ids is not None else set(remote.ids()), protected,
                   incoming_bytes=snapshot.size_bytes)
        assert self._store is not None and self.cache is not None and self.pending is not None
        remote.download(snapshot.id, self._store, progress)
        self.cache.touch(snapshot.id)
        # It came from there: nothing of it is owed to the remote store.
        self.pending.clear(snapshot.id)
        log.info("gpu-snapshot: downloaded snapshot %s from %s", snapshot.id, remote.url)
        return self.get(snapshot.id)

    def evict(self, remote_ids: Collection[str], protected: Collection[str] = (),
              incoming_bytes: int = 0) -> builtins.list[str]:
        """Keep the local store under ``remote_cache_max_bytes``: only snapshots that also
        exist remotely (``remote_ids``) and are not ``protected`` (in use) go, least
        recently used first."""
        if self.cache is None or self.cache.max_bytes <= 0:
            return []
        evicted = self.cache.evict(set(remote_ids), protected, incoming_bytes)
        for snapshot_id in evicted:
            log.info("gpu-snapshot: removed the local copy of %s (it stays in %s)", snapshot_id,
                     self.remote_url)
        return evicted

