"""Downloading a remote snapshot into a local store directory, checked while it streams.

Each file is fetched in ranges by ``workers`` threads, opened (decrypted) when sealed,
hashed and written with ``pwrite``; large sha256 files split into the store's tree chunks,
which hash independently. Everything goes into a ``.partial-<id>`` directory beside the
final one and is renamed into place only when every digest matched, so the store never
lists a partial download.

A chunked remote snapshot (``packs.py``) comes down as a chunked local one: its recipes go
into the partial directory first (from then on they keep the pages this store has alive),
then only the pages this store lacks are fetched, each checked against its keyed id, into
a file there that becomes a new pack of the store (``PageStore.adopt_pack``) before the
rename. A later restore reads it from the packs as any chunked snapshot.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from ... import safe_fs
from ...errors import NotFound
from ...progress import ProgressFn, byte_counter
from .. import images, packs
from ..digest import TREE_CHUNK
from ..manifest import MANIFEST
from ..store import OWNER_FILE, PARTIAL_PREFIX, SnapshotStore
from .digests import FileCheck, Hasher, file_check, sidecar_check
from .objects import (
    RemoteObjects,
    RemoteStoreError,
    damaged_copy,
    remote_store_errors,
    safe_object_name,
)
from .pages import PageDownload
from .sealing import RECORD_OVERHEAD, ChunkSealer

READ_BYTES = 8 << 20  # one ranged GET: plaintext bytes


def _stored_span(sealer: ChunkSealer | None, offset: int, length: int) -> tuple[int, int]:
    """The stored byte range holding plaintext [offset, offset + length)."""
    if sealer is None:
        return offset, length
    records = max(1, -(-length // sealer.chunk_bytes))
    return sealer.stored_offset(offset), length + records * RECORD_OVERHEAD


def download_snapshot(
    store: RemoteObjects, snapshot_id: str, into: Path | SnapshotStore,
    progress: ProgressFn | None = None,
) -> Path:
    """Download ``snapshot_id`` into the store ``into`` (or the store at that path, with the
    default signing key); called by ``RemoteStore.download``.

    Returns the snapshot directory; one already there is returned as it is.
    ``progress(done, total)`` is called from worker threads.
    """
    local = into if isinstance(into, SnapshotStore) else None
    into_dir = into.root if isinstance(into, SnapshotStore) else into
    final = into_dir / snapshot_id
    if final.is_dir() and not final.is_symlink():
        return final
    remote = store.read_remote_manifest(snapshot_id)
    if remote is None:
        raise NotFound(
            "download", f"no snapshot {snapshot_id} in {store.url}",
            hint="'list' shows the remote snapshots; an unfinished upload is not listed",
        )
    sealer = store.check_key(snapshot_id, remote)
    objects: dict[str, dict[str, Any]] = remote.get("objects", {})
    _check_objects_present(store, snapshot_id, objects)
    manifest_bytes = store.fetch_object(snapshot_id, remote, MANIFEST)
    manifest = json.loads(manifest_bytes)
    if not isinstance(manifest, dict) or manifest.get("id") != snapshot_id:
        raise damaged_copy(snapshot_id, "its manifest names another snapshot")
    listed = set(manifest.get("files", {}))
    chunked: dict[str, dict[str, Any]] = remote.get("chunked", {})
    missing = sorted(listed - set(objects) - set(chunked))
    if missing:
        raise damaged_copy(snapshot_id, f"image files were never uploaded: {', '.join(missing)}")
    recipes = {name: _fetch_recipe(store, snapshot_id, remote, manifest, name, entry)
               for name, entry in sorted(chunked.items())}
    checks: list[FileCheck] = []
    for name, entry in sorted(objects.items()):
        if name == MANIFEST or name in {packs.recipe_name(n) for n in recipes}:
            continue
        safe_object_name(name, "download")
        if name in listed:
            check = file_check(manifest, name)
            if check.size != int(entry["size"]):
                raise damaged_copy(snapshot_id, f"{name} has another size than its manifest says")
        else:
            check = sidecar_check(name, int(entry["size"]), str(entry["sha256"]))
        checks.append(check)

    into_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = into_dir / f"{PARTIAL_PREFIX}{snapshot_id}"
    _remove_if_abandoned(partial)
    try:
        partial.mkdir(mode=0o700)
    except FileExistsError as e:
        raise RemoteStoreError(
            "download", f"a download of {snapshot_id} into {into_dir} is already under way",
            hint="wait for it; a stale one is removed when the store cleans up",
        ) from e
    with remote_store_errors(
        "download", f"downloading {snapshot_id} from {store.url}", "nothing was kept; try again"
    ):
        try:
            (partial / OWNER_FILE).write_text(str(os.getpid()))
            _write_private(partial / MANIFEST, manifest_bytes)
            for name, recipe in recipes.items():
                _write_private(partial / packs.recipe_name(name), recipe)
            pages = PageDownload(store, snapshot_id, remote, recipes, local or
                                  SnapshotStore(into_dir)) if recipes else None
            download = _Download(store, snapshot_id, sealer, partial, checks, progress,
                                 pages.lacking_bytes if pages else 0)
            download.run()
            if pages is not None:
                pages.fetch(partial, download.advance)
            (partial / OWNER_FILE).unlink()
            _fsync(partial)
            os.rename(partial, final)
            _fsync(into_dir)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return final


def _fetch_recipe(
    store: RemoteObjects, snapshot_id: str, remote: dict[str, Any], manifest: dict[str, Any],
    name: str, entry: dict[str, Any],
) -> bytes:
    """The recipe of the chunked file ``name``, checked against the snapshot's manifest
    (whose signature the local store checks before any restore)."""
    listed = manifest.get("files", {}).get(name)
    recipe = store.fetch_object(snapshot_id, remote, str(entry["recipe"]))
    if (not isinstance(listed, dict) or "chunks" not in listed
            or int(listed["size"]) != int(entry["size"])
            or not images.recipe_matches(recipe, listed)):
        raise damaged_copy(snapshot_id, f"the recipe of {name} does not match its manifest")
    return recipe


def _check_objects_present(
    store: RemoteObjects, snapshot_id: str, objects: dict[str, dict[str, Any]]
) -> None:
    """Refuse before any transfer when an object is missing or has the wrong stored size."""
    store.fs.invalidate_cache()
    try:
        found: dict[str, dict[str, Any]] = store.retry(
            "list objects", lambda: store.fs.find(store.path(snapshot_id), detail=True)
        )
    except FileNotFoundError:
        found = {}
    sizes = {str(p).rsplit("/", 1)[-1]: int(info.get("size", -1)) for p, info in found.items()}
    for name, entry in sorted(objects.items()):
        stored_as = str(entry.get("object") or name)
        if stored_as not in sizes:
            raise damaged_copy(snapshot_id, f"the object {stored_as} is missing")
        if sizes[stored_as] != int(entry["stored_size"]):
            raise damaged_copy(
                snapshot_id,
                f"the object {stored_as} has {sizes[stored_as]} bytes, expected "
                f"{entry['stored_size']} (truncated or replaced)",
            )


def _remove_if_abandoned(partial: Path) -> None:
    """Remove the partial directory of a download whose process is gone (killed, crashed)."""
    try:
        owner = int((partial / OWNER_FILE).read_text())
    except FileNotFoundError:
        # Not claimed yet: a download starting right now, or one that died at once.
        try:
            if time.time() - partial.stat().st_mtime < 60:
                return
        except FileNotFoundError:
            return
        owner = 0
    except (OSError, ValueError):
        return
    if owner > 0 and psutil.pid_exists(owner):
        return
    shutil.rmtree(partial, ignore_errors=True)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Download:
    def __init__(
        self,
        store: RemoteObjects,
        snapshot_id: str,
        sealer: ChunkSealer | None,
        into: Path,
        checks: list[FileCheck],
        progress: ProgressFn | None,
        extra_bytes: int = 0,
    ) -> None:
        if sealer is not None:
            assert TREE_CHUNK % sealer.chunk_bytes == 0 and READ_BYTES % sealer.chunk_bytes == 0
        self.store = store
        self.snapshot_id = snapshot_id
        self.sealer = sealer
        self.into = into
        self.checks = checks
        self.advance = byte_counter(progress, sum(c.size for c in checks) + extra_bytes)

    def run(self) -> None:
        fds: dict[str, int] = {}
        try:
            for check in self.checks:
                fd = os.open(
                    self.into / check.name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                )
                fds[check.name] = fd
                os.ftruncate(fd, check.size)
            jobs: list[tuple[FileCheck, Callable[[], Hasher]]] = [
                (check, self._segment_job(check, fds[check.name], offset, length))
                for check in self.checks
                for offset, length in check.segments()
            ]
            with ThreadPoolExecutor(self.store.workers, thread_name_prefix="download") as pool:
                futures = [(check, pool.submit(job)) for check, job in jobs]
                hashers: dict[str, list[Hasher]] = {}
                try:
                    for check, future in futures:
                        hashers.setdefault(check.name, []).append(future.result())
                except BaseException:
                    for _, future in futures:
                        future.cancel()
                    raise
            for check in self.checks:
                if check.combine(hashers[check.name]) != check.expected:
                    raise damaged_copy(
                        self.snapshot_id,
                        f"{check.name} does not match its {check.algorithm} digest",
                    )
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _segment_job(
        self, check: FileCheck, fd: int, offset: int, length: int
    ) -> Callable[[], Hasher]:
        path = self.store.path(self.snapshot_id, check.name)

        def job() -> Hasher:
            hasher = check.new_hasher()
            end = offset + length
            position = offset
            # An empty sealed file still has its one record to authenticate.
            while position < end or (position == 0 and end == 0 and self.sealer is not None):
                piece = min(READ_BYTES, end - position)
                start, span = _stored_span(self.sealer, position, piece)
                fetch = functools.partial(
                    self.store.fs.cat_file, path, start=start, end=start + span
                )
                stored: bytes = self.store.retry(f"get {check.name}", fetch)
                if len(stored) != span:
                    raise damaged_copy(
                        self.snapshot_id,
                        f"the object {check.name} ended early at byte {start + len(stored)}",
                    )
                data = stored
                if self.sealer is not None:
                    index = position // self.sealer.chunk_bytes
                    data = self.sealer.open_run(check.name, index, check.size, stored)
                hasher.update(data)
                safe_fs.pwrite_all(fd, data, position)
                self.advance(len(data))
                if end == 0:
                    break
                position += piece
            return hasher

        return job

