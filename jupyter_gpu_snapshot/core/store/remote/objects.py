"""The objects of snapshots in object storage, through fsspec: S3 (s3fs), GCS, a shared
filesystem, ...

Remote layout, under the configured URL::

    <id>/manifest.json           the local manifest, byte for byte (sealed when encrypted)
    <id>/<image files>           CRIU images and any other file of the snapshot directory
    <id>/remote-manifest.json    what was uploaded: sizes, encryption; written LAST
    <id>/manifest.<n>.json       after a rename: the re-signed manifest (``object`` of its entry)
    <id>/<file>.chunks           a file kept by content: its recipe (one page id per page)
    packs/...                    the pages of the snapshots kept by content (``packs.py``)

A snapshot kept by content (``core/store/packs/``) goes up chunked: its remote manifest
(format 2) names the packs holding its pages (``packs``) and its chunked files with their
sizes (``chunked``); its ``objects`` are the manifest, the small files and the recipes.
Whole-file snapshots keep format 1, which every version reads.

A snapshot is listed only when its remote manifest exists, so an upload cut off at any
point is never listed, and a delete removes the remote manifest first. A rename writes the
re-signed manifest under a new object name and then replaces the remote manifest, so a
reader sees the old name or the new one, never a mix. Every name read
from the remote side is validated before it becomes a local path.

This module reads, lists and deletes; the transfers (``upload``, ``download``, ``rename``)
build on it, and ``store.RemoteStore`` puts both behind one class. Imports go that way
only. All methods block: the server calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from ...errors import NotFound, SnapshotError
from ..manifest import MANIFEST
from ..snapshot import is_snapshot_id
from .sealing import CIPHER, DEFAULT_CHUNK_BYTES, ChunkSealer

REMOTE_MANIFEST = "remote-manifest.json"
REMOTE_FORMAT = 1
CHUNKED_FORMAT = 2
READABLE_FORMATS = (REMOTE_FORMAT, CHUNKED_FORMAT)
DEFAULT_PART_BYTES = 16 << 20
DEFAULT_WORKERS = 8
PACK_STEM = re.compile(r"^[0-9a-f]{32}(?:\.[0-9a-f]{16})?$")  # see packs.py
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Errors that a second try will not cure.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)

T = TypeVar("T")


class RemoteStoreError(SnapshotError):
    """A transfer to or from the remote store failed; the local side is untouched."""


def safe_object_name(name: str, where: str = "remote") -> str:
    """``name`` if it may become a file name in the cache: no '/', no '..', no hidden names."""
    if not _OBJECT_NAME.fullmatch(name) or ".." in name:
        raise RemoteStoreError(
            where,
            f"refusing the object name {name!r}: it could point outside the snapshot directory",
            hint="the remote store holds something this version did not write; inspect it",
        )
    return name


def safe_snapshot_id(snapshot_id: str, where: str = "remote") -> str:
    if not is_snapshot_id(snapshot_id):
        raise RemoteStoreError(
            where,
            f"{snapshot_id!r} is not a snapshot id",
            hint="ids look like 20261122T120000Z-0123abcd; 'list' shows the remote ones",
        )
    return snapshot_id


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, (*_PERMANENT, SnapshotError)):
        return False
    if isinstance(error, (OSError, TimeoutError, ConnectionError)):
        return True
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:  # not an S3 store
        return False
    return isinstance(error, BotoCoreError)


def describe(error: BaseException) -> str:
    """An exception as one line a person can read."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def remote_store_errors(step: str, doing: str, hint: str) -> Iterator[None]:
    """Around a transfer (an upload, a download): any failure but a ``SnapshotError``, which
    is worded for a person already, becomes one ``RemoteStoreError``: ``doing`` failed, and
    why. A cancel or an interrupt (no ``Exception``) passes as it is."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as e:
        raise RemoteStoreError(step, f"{doing} failed: {describe(e)}", hint=hint) from e


def damaged_copy(snapshot_id: str, cause: str) -> RemoteStoreError:
    """The error for a remote copy that cannot be read back whole."""
    return RemoteStoreError(
        "download", f"remote snapshot {snapshot_id}: {cause}",
        hint="the remote copy is damaged or incomplete; upload it again from a node that has it",
    )


@dataclass(frozen=True)
class RemoteSnapshot:
    """A snapshot whose upload completed: its remote manifest and, when readable, its manifest.

    ``manifest`` is None for an encrypted snapshot when no key, or another key, is configured.
    """

    id: str
    url: str
    remote_manifest: dict[str, Any]
    manifest: dict[str, Any] | None

    @property
    def encrypted(self) -> bool:
        return bool(self.remote_manifest.get("encryption"))

    @property
    def size_bytes(self) -> int:
        objects: dict[str, dict[str, Any]] = self.remote_manifest.get("objects", {})
        chunked: dict[str, dict[str, Any]] = self.remote_manifest.get("chunked", {})
        recipes = {str(c["recipe"]) for c in chunked.values()}
        return sum(int(o["size"]) for n, o in objects.items() if n not in recipes) + sum(
            int(c["size"]) for c in chunked.values())

    @property
    def chunked(self) -> bool:
        """Whether its large files are kept by content, in the remote store's packs."""
        return bool(self.remote_manifest.get("chunked"))

    @property
    def uploaded(self) -> float:
        return float(self.remote_manifest.get("uploaded", 0.0))

    @property
    def name(self) -> str:
        return str((self.manifest or {}).get("name") or self.id)

    def summary(self) -> dict[str, Any]:
        """What a listing shows; never the kernel's connection key."""
        manifest = self.manifest or {}
        kernel = manifest.get("kernel", {})
        return {
            "id": self.id,
            "name": self.name,
            "url": self.url,
            "encrypted": self.encrypted,
            "readable": self.manifest is not None,
            "size_bytes": self.size_bytes,
            "uploaded": self.uploaded,
            "created": manifest.get("created"),
            "host": manifest.get("host"),
            "notebook_path": kernel.get("notebook_path"),
        }


class RemoteObjects:
    """The snapshots under one fsspec URL, e.g. ``s3://bucket/prefix``: their objects.

    ``options`` go to the filesystem (for s3fs: ``endpoint_url``, ``key``, ``secret``,
    ``client_kwargs``...); without them s3fs uses the usual AWS credential chain. With
    ``key`` (32 bytes), uploads are sealed with AES-256-GCM and downloads need that key.
    """

    def __init__(
        self,
        url: str,
        options: dict[str, Any] | None = None,
        *,
        key: bytes | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        workers: int = DEFAULT_WORKERS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        attempts: int = 4,
        retry_delay: float = 0.5,
    ) -> None:
        # fsspec is imported by the first remote store: a node without one needs none.
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        self.url = url.rstrip("/")
        self.fs: Any = fs
        self.root = str(root).rstrip("/")
        self.key = key
        self.chunk_bytes = chunk_bytes
        # Parts hold whole sealed records, so a part boundary is always a chunk boundary.
        self.part_bytes = max(chunk_bytes, part_bytes // chunk_bytes * chunk_bytes)
        self.workers = max(1, workers)
        self.attempts = max(1, attempts)
        self.retry_delay = retry_delay

    # -- paths and small objects ------------------------------------------------------------
    def path(self, snapshot_id: str, name: str | None = None) -> str:
        base = f"{self.root}/{snapshot_id}"
        return f"{base}/{name}" if name else base

    def object_path(self, snapshot_id: str, name: str, entry: dict[str, Any]) -> str:
        """Where the file ``name`` is stored: its own name, or the ``object`` a rename wrote."""
        return self.path(snapshot_id, str(entry.get("object") or name))

    def url_of(self, snapshot_id: str) -> str:
        return f"{self.url}/{snapshot_id}"

    @property
    def protocols(self) -> set[str]:
        protocol = self.fs.protocol
        return set(protocol) if isinstance(protocol, tuple | list) else {str(protocol)}

    @property
    def is_s3(self) -> bool:
        return "s3" in self.protocols

    @property
    def is_local(self) -> bool:
        """A path on a local or shared (mounted) filesystem."""
        return bool({"file", "local"} & self.protocols)

    def retry(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, tried again after transient errors (with backoff); ``what`` is for logs."""
        for attempt in range(self.attempts):
            try:
                return call()
            except Exception as e:
                if attempt == self.attempts - 1 or not _is_transient(e):
                    raise
                time.sleep(self.retry_delay * (2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def sealer(self, snapshot_id: str) -> ChunkSealer | None:
        return ChunkSealer(self.key, snapshot_id, self.chunk_bytes) if self.key else None

    def read_remote_manifest(self, snapshot_id: str) -> dict[str, Any] | None:
        """The remote manifest of ``snapshot_id``; None when absent (not uploaded, or cut off)."""
        try:
            data = self.retry(
                f"read {REMOTE_MANIFEST}",
                lambda: self.fs.cat_file(self.path(snapshot_id, REMOTE_MANIFEST)),
            )
        except FileNotFoundError:
            return None
        return self._parse_remote_manifest(snapshot_id, data)

    def _parse_remote_manifest(self, snapshot_id: str, data: bytes) -> dict[str, Any]:
        try:
            remote = json.loads(data)
        except ValueError as e:
            raise RemoteStoreError(
                "remote", f"the remote manifest of {snapshot_id} is not JSON ({e})",
                hint="delete the remote snapshot and upload it again",
            ) from e
        if not isinstance(remote, dict) or remote.get("id") != snapshot_id:
            raise RemoteStoreError(
                "remote", f"the remote manifest of {snapshot_id} names another snapshot",
                hint="delete the remote snapshot and upload it again",
            )
        if remote.get("remote_format") not in READABLE_FORMATS:
            raise RemoteStoreError(
                "remote",
                f"remote snapshot {snapshot_id} has format {remote.get('remote_format')!r}; "
                f"this version reads formats {', '.join(map(str, READABLE_FORMATS))}",
                hint="upgrade jupyter_gpu_snapshot on this node",
            )
        for name, entry in remote.get("objects", {}).items():
            safe_object_name(name)
            for stored_as in (entry.get("object"), entry.get("replaces")):
                if stored_as is not None:
                    safe_object_name(str(stored_as))
        for name, entry in remote.get("chunked", {}).items():
            safe_object_name(name)
            safe_object_name(str(entry.get("recipe")))
            if str(entry.get("recipe")) not in remote.get("objects", {}):
                raise RemoteStoreError(
                    "remote", f"the remote manifest of {snapshot_id} lists no recipe for {name}",
                    hint="delete the remote snapshot and upload it again",
                )
        if not isinstance(remote.get("packs", []), builtins.list) or not all(
            PACK_STEM.fullmatch(str(stem)) for stem in remote.get("packs", [])
        ):
            raise RemoteStoreError(
                "remote", f"the remote manifest of {snapshot_id} names packs this version "
                "did not write", hint="delete the remote snapshot and upload it again",
            )
        return remote

    def check_key(self, snapshot_id: str, remote: dict[str, Any]) -> ChunkSealer | None:
        """The sealer that opens ``snapshot_id``, or None for a plain one; refuses a wrong key."""
        encryption = remote.get("encryption")
        if not encryption:
            return None
        if encryption.get("cipher") != CIPHER:
            raise RemoteStoreError(
                "decrypt", f"snapshot {snapshot_id} uses the cipher {encryption.get('cipher')!r}"
            )
        if self.key is None:
            raise RemoteStoreError(
                "decrypt",
                f"snapshot {snapshot_id} is encrypted and no key is configured",
                hint="set c.GPUSnapshot.remote_encryption_key_file to the key it was saved with",
            )
        sealer = ChunkSealer(self.key, snapshot_id, int(encryption["chunk_bytes"]))
        if encryption.get("key_id") != sealer.key_id:
            raise RemoteStoreError(
                "decrypt",
                f"snapshot {snapshot_id} was encrypted with another key "
                f"(key id {encryption.get('key_id')}, this node has {sealer.key_id})",
                hint="configure the key file that the uploading node used",
            )
        return sealer

    def fetch_object(self, snapshot_id: str, remote: dict[str, Any], name: str) -> bytes:
        """A small object of the snapshot, whole: opened when sealed, checked by its digest."""
        entry = remote.get("objects", {}).get(name)
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise damaged_copy(snapshot_id, f"the remote manifest does not list {name}")
        sealer = self.check_key(snapshot_id, remote)
        path = self.object_path(snapshot_id, name, entry)
        try:
            stored = self.retry(f"get {name}", lambda: self.fs.cat_file(path))
        except FileNotFoundError as e:
            raise damaged_copy(snapshot_id, f"the object {name} is missing") from e
        if len(stored) != int(entry["stored_size"]):
            raise damaged_copy(
                snapshot_id,
                f"the object {name} has {len(stored)} bytes, expected {entry['stored_size']}",
            )
        data = sealer.open_run(name, 0, int(entry["size"]), stored) if sealer else stored
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise damaged_copy(snapshot_id, f"{name} does not match its sha256")
        return data

    def read_manifest(self, snapshot_id: str, remote: dict[str, Any]) -> bytes:
        """The snapshot's own manifest.json bytes, decrypted and checked against its digest."""
        return self.fetch_object(snapshot_id, remote, MANIFEST)

    # -- listing and deleting ---------------------------------------------------------------
    def ids(self) -> builtins.list[str]:
        """The ids of snapshots whose upload completed (those with a remote manifest)."""
        return sorted(self.revisions())

    def revisions(self) -> dict[str, str]:
        """Each completed snapshot's id and a stamp of its remote manifest (ETag or mtime,
        and size) that changes when a rename replaces it.

        One recursive listing (on S3, a LIST without delimiter): an empty "directory"
        that some servers keep after a delete is no snapshot.
        """
        self.fs.invalidate_cache()
        try:
            found: dict[str, dict[str, Any]] = self.retry(
                "list", lambda: self.fs.find(self.root, detail=True)
            )
        except FileNotFoundError:
            return {}
        revisions: dict[str, str] = {}
        for path, info in found.items():
            parts = str(path).rstrip("/").split("/")
            if len(parts) >= 2 and parts[-1] == REMOTE_MANIFEST and is_snapshot_id(parts[-2]):
                stamp = f"{info.get('ETag', '')}:{info.get('size')}:{modified_time(info)}"
                revisions[parts[-2]] = stamp
        return revisions

    def list(self) -> builtins.list[RemoteSnapshot]:
        """Snapshots whose upload completed, oldest first."""
        snapshots: builtins.list[RemoteSnapshot] = []
        for snapshot_id in self.ids():
            snapshot = self.get(snapshot_id, missing_ok=True)
            if snapshot is not None:
                snapshots.append(snapshot)
        return sorted(snapshots, key=lambda s: (s.uploaded, s.id))

    def get(self, snapshot_id: str, missing_ok: bool = False) -> RemoteSnapshot | None:
        """One remote snapshot, with its manifest when it can be read here."""
        safe_snapshot_id(snapshot_id)
        remote = self.read_remote_manifest(snapshot_id)
        if remote is None:
            if missing_ok:
                return None
            raise NotFound(
                "lookup",
                f"no snapshot {snapshot_id} in {self.url}",
                hint="'list' shows the snapshots there are; an unfinished upload is not listed",
            )
        manifest: dict[str, Any] | None = None
        with contextlib.suppress(SnapshotError, ValueError):
            manifest = json.loads(self.read_manifest(snapshot_id, remote))
        return RemoteSnapshot(snapshot_id, self.url_of(snapshot_id), remote, manifest)

    def exists(self, snapshot_id: str) -> bool:
        return self.read_remote_manifest(safe_snapshot_id(snapshot_id)) is not None

    def delete(self, snapshot_id: str) -> None:
        """Remove a remote snapshot: its remote manifest first, so it leaves every listing."""
        self.get(snapshot_id)
        self.retry("delete", lambda: self.fs.rm_file(self.path(snapshot_id, REMOTE_MANIFEST)))
        self.discard(snapshot_id)

    def discard(self, snapshot_id: str) -> None:
        """Best-effort removal of whatever objects ``snapshot_id`` has (an unlisted upload)."""
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            self.retry("delete", lambda: self.fs.rm(self.path(snapshot_id), recursive=True))
        self.fs.invalidate_cache()

def modified_time(info: dict[str, Any]) -> float:
    stamp = info.get("LastModified", info.get("mtime", info.get("created", 0.0)))
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    try:
        return float(stamp)
    except (TypeError, ValueError):
        return 0.0
