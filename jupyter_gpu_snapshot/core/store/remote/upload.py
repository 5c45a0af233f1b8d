"""Uploading a committed local snapshot: parallel multipart parts, the remote manifest last.

A snapshot kept by content (recipes beside its manifest, ``core/store/packs/``) goes up
chunked: first one new remote pack with the pages no usable remote pack holds yet
(``packs.RemotePacks``), then its small files and its recipes, then the remote manifest,
which names the packs it needs. A whole-file snapshot goes up as whole files.

Files are read with ``pread`` in parts of ``RemoteObjects.part_bytes`` (sealed on the way when
a key is configured); on S3 each large file is one multipart upload whose parts go up on
``workers`` threads at once, elsewhere each file streams through ``fs.open``. Nothing local
is ever written, so a failed upload leaves the local snapshot as it was.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import stat
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import SnapshotError
from ...progress import ProgressFn, byte_counter
from .. import images, packs
from ..manifest import MANIFEST
from ..snapshot import is_snapshot_id
from ..store import SnapshotStore
from .objects import (
    CHUNKED_FORMAT,
    REMOTE_FORMAT,
    REMOTE_MANIFEST,
    RemoteObjects,
    RemoteSnapshot,
    RemoteStoreError,
    describe,
    remote_store_errors,
    safe_object_name,
)
from .pages import PageUpload
from .sealing import CIPHER

_MAX_PARTS = 10_000  # the S3 limit
# What to do after any failed upload: nothing local was touched.
_INTACT = "the local snapshot is intact; try the upload again"


@dataclass
class _File:
    name: str
    fd: int
    size: int
    stored_size: int
    upload_id: str | None = None
    etags: dict[int, str] = field(default_factory=dict)


def _read_exactly(fd: int, offset: int, length: int, name: str) -> bytes:
    parts: list[bytes] = []
    while length:
        data = os.pread(fd, length, offset)
        if not data:
            raise RemoteStoreError(
                "upload", f"local file {name} shrank while it was uploaded",
                hint="the local snapshot changed during the upload; check it with verify",
            )
        parts.append(data)
        offset += len(data)
        length -= len(data)
    return b"".join(parts)


def _open_snapshot_files(snapshot_dir: Path) -> tuple[str, list[tuple[str, int, int]]]:
    """The id and the (name, fd, size) of every file of a committed snapshot; no symlinks."""
    info = os.lstat(snapshot_dir)
    if not stat.S_ISDIR(info.st_mode):
        raise RemoteStoreError("upload", f"{snapshot_dir} is not a snapshot directory")
    snapshot_id = snapshot_dir.name
    if not is_snapshot_id(snapshot_id) or not (snapshot_dir / MANIFEST).is_file():
        raise RemoteStoreError(
            "upload", f"{snapshot_dir} is not a committed snapshot (no id name or no manifest)",
            hint="upload a snapshot from the store, after its save finished",
        )
    opened: list[tuple[str, int, int]] = []
    try:
        for entry in sorted(os.scandir(snapshot_dir), key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            safe_object_name(entry.name, "upload")
            if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                raise RemoteStoreError(
                    "upload", f"{entry.path} is not a regular file; snapshots hold only files"
                )
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
            opened.append((entry.name, fd, os.fstat(fd).st_size))
    except BaseException:
        for _, fd, _ in opened:
            os.close(fd)
        raise
    return snapshot_id, opened


def upload_snapshot(
    store: RemoteObjects, snapshot_dir: Path, progress: ProgressFn | None = None,
    local: SnapshotStore | None = None,
) -> RemoteSnapshot:
    """Upload ``snapshot_dir``; called by ``RemoteStore.upload``.

    ``local`` is the store that holds the snapshot (by default, the store in its parent
    directory): a snapshot kept by content reads its pages from that store's packs.
    ``progress(done, total)`` (bytes of the local files, and of the pages that go up) is
    called from worker threads. A snapshot already
    uploaded is left as it is. Any failure removes what this upload wrote and raises one
    RemoteStoreError naming the file and the cause.
    """
    snapshot_id, opened = _open_snapshot_files(snapshot_dir)
    try:
        # Fails when the remote store does not answer.
        with remote_store_errors("upload", f"uploading {snapshot_id} to {store.url}", _INTACT):
            existing = store.get(snapshot_id, missing_ok=True)
        if existing is not None:
            return existing
        recipes = _recipes(snapshot_id, opened)
        sealer = store.sealer(snapshot_id)
        files = [
            _File(name, fd, size, sealer.stored_size(size) if sealer else size)
            for name, fd, size in opened if name not in recipes
        ]
        pages = None
        if recipes:
            # A committed snapshot lies in its store's directory.
            local = local or SnapshotStore(snapshot_dir.parent)
            with remote_store_errors("upload", f"uploading {snapshot_id} to {store.url}",
                                     _INTACT):
                pages = PageUpload(store, local, recipes)
        _Upload(store, snapshot_id, files, progress, pages).run()
    finally:
        for _, fd, _ in opened:
            os.close(fd)
    snapshot = store.get(snapshot_id)
    assert snapshot is not None
    return snapshot


def _recipes(snapshot_id: str, opened: list[tuple[str, int, int]]) -> dict[str, bytes]:
    """The recipes of the files kept by content (name → recipe), each checked against
    the signed manifest: its size and its digest."""
    by_name = {name: (fd, size) for name, fd, size in opened}
    fd, size = by_name[MANIFEST]
    files = json.loads(_read_exactly(fd, 0, size, MANIFEST)).get("files", {})
    recipes: dict[str, bytes] = {}
    for name, entry in sorted(files.items()):
        recipe_file = packs.recipe_name(name)
        if not isinstance(entry, dict) or "chunks" not in entry or recipe_file not in by_name:
            continue
        fd, size = by_name[recipe_file]
        recipe = _read_exactly(fd, 0, size, recipe_file)
        if not images.recipe_matches(recipe, entry):
            raise RemoteStoreError(
                "upload", f"the recipe of {name} of {snapshot_id} does not match its manifest",
                hint="the snapshot is damaged; check it with verify",
            )
        recipes[name] = recipe
    return recipes


class _Upload:
    def __init__(
        self,
        store: RemoteObjects,
        snapshot_id: str,
        files: list[_File],
        progress: ProgressFn | None,
        pages: PageUpload | None = None,
    ) -> None:
        self.store = store
        self.snapshot_id = snapshot_id
        self.files = files
        self.pages = pages
        self.sealer = store.sealer(snapshot_id)
        total = sum(f.size for f in files) + (pages.new_bytes if pages else 0)
        self.advance = byte_counter(progress, total)

    def part_bytes(self, f: _File) -> int:
        step = self.store.part_bytes
        if f.size > step * _MAX_PARTS:
            chunk = self.store.chunk_bytes
            fewest = -(-f.size // _MAX_PARTS)
            step = -(-fewest // chunk) * chunk
        return step

    def sealed(self, f: _File, offset: int, data: bytes) -> bytes:
        if self.sealer is None:
            return data
        return self.sealer.seal_run(f.name, offset // self.sealer.chunk_bytes, f.size, data)

    def run(self) -> None:
        multipart = [
            f for f in self.files if self.store.is_s3 and f.stored_size > self.part_bytes(f)
        ]
        with remote_store_errors(
            "upload", f"uploading {self.snapshot_id} to {self.store.url}", _INTACT
        ):
            try:
                remote = self._remote_manifest()  # checks the manifest before anything goes up
                if self.pages is not None:  # the pages first: a manifest never names less
                    self.pages.send(self.advance)
                if not self.store.is_s3:  # a filesystem with real directories
                    directory = self.store.path(self.snapshot_id)
                    self.store.fs.makedirs(directory, exist_ok=True)
                    if self.store.is_local:  # snapshots are secrets: only the owner may enter
                        os.chmod(directory, 0o700)
                for f in multipart:
                    f.upload_id = self._s3("create_multipart_upload", f)["UploadId"]
                jobs: list[tuple[_File, Callable[[], None]]] = []
                for f in self.files:
                    if f.upload_id:
                        step = self.part_bytes(f)
                        jobs += [(f, self._part_job(f, n, off, step)) for n, off in
                                 enumerate(range(0, f.size, step), start=1)]
                    else:
                        jobs.append((f, self._whole_file_job(f)))
                self._run_jobs(jobs)
                for f in multipart:
                    parts = [{"PartNumber": n, "ETag": f.etags[n]} for n in sorted(f.etags)]
                    self._s3("complete_multipart_upload", f, MultipartUpload={"Parts": parts})
                    f.upload_id = None
                if self.pages is not None:
                    self.pages.check(self.snapshot_id)
                    remote.update(self.pages.describe(), remote_format=CHUNKED_FORMAT)
                self._put_remote_manifest(remote)
                if self.pages is not None:
                    # A collection that counted before the manifest went up and removed
                    # after the check above: unlisted again, and the upload fails.
                    self.pages.check(self.snapshot_id)
            except BaseException:
                self._undo(multipart)
                if self.pages is not None:
                    self.pages.undo()
                raise

    def _run_jobs(self, jobs: list[tuple[_File, Callable[[], None]]]) -> None:
        with ThreadPoolExecutor(self.store.workers, thread_name_prefix="upload") as pool:
            futures: dict[Future[None], _File] = {pool.submit(job): f for f, job in jobs}
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [fut for fut in finished if fut.exception() is not None]
            if failed:
                for fut in futures:
                    fut.cancel()
                error = failed[0].exception()
                assert error is not None
                if isinstance(error, SnapshotError):
                    raise error
                raise RemoteStoreError(
                    "upload",
                    f"uploading {futures[failed[0]].name} of {self.snapshot_id} to "
                    f"{self.store.url} failed: {describe(error)}",
                    hint=_INTACT,
                ) from error

    def _s3(self, method: str, f: _File, **kwargs: Any) -> dict[str, Any]:
        bucket, key, _ = self.store.fs.split_path(self.store.path(self.snapshot_id, f.name))
        if f.upload_id and method != "create_multipart_upload":
            kwargs["UploadId"] = f.upload_id
        result: dict[str, Any] = self.store.retry(
            method, lambda: self.store.fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)
        )
        return result

    def _part_job(self, f: _File, number: int, offset: int, step: int) -> Callable[[], None]:
        def job() -> None:
            length = min(step, f.size - offset)
            body = self.sealed(f, offset, _read_exactly(f.fd, offset, length, f.name))
            reply = self._s3("upload_part", f, PartNumber=number, Body=body)
            f.etags[number] = reply["ETag"]
            self.advance(length)

        return job

    def _whole_file_job(self, f: _File) -> Callable[[], None]:
        path = self.store.path(self.snapshot_id, f.name)

        def job() -> None:
            if f.stored_size <= self.part_bytes(f):
                body = self.sealed(f, 0, _read_exactly(f.fd, 0, f.size, f.name))
                self.store.retry(f"put {f.name}", lambda: self.store.fs.pipe_file(path, body))
                self.advance(f.size)
                return
            # Not S3: stream the file in parts through the filesystem's own writer.
            with self.store.fs.open(path, "wb") as out:
                for offset in range(0, f.size, self.store.part_bytes):
                    length = min(self.store.part_bytes, f.size - offset)
                    out.write(self.sealed(f, offset, _read_exactly(f.fd, offset, length, f.name)))
                    self.advance(length)

        return job

    def _remote_manifest(self) -> dict[str, Any]:
        manifest_file = next(f for f in self.files if f.name == MANIFEST)
        manifest_bytes = _read_exactly(manifest_file.fd, 0, manifest_file.size, MANIFEST)
        manifest = json.loads(manifest_bytes)
        if manifest.get("id") != self.snapshot_id:
            raise RemoteStoreError(
                "upload", f"the manifest of {self.snapshot_id} names another snapshot"
            )
        listed = set(manifest.get("files", {}))
        objects: dict[str, dict[str, Any]] = {}
        for f in self.files:
            entry: dict[str, Any] = {"size": f.size, "stored_size": f.stored_size}
            if f.name not in listed:
                # The manifest and files beside it (a signature) are checked by this digest.
                digest = hashlib.sha256()
                step = 8 << 20
                for offset in range(0, f.size, step):
                    length = min(step, f.size - offset)
                    digest.update(_read_exactly(f.fd, offset, length, f.name))
                entry["sha256"] = digest.hexdigest()
            objects[f.name] = entry
        return {
            "remote_format": REMOTE_FORMAT,
            "id": self.snapshot_id,
            "uploaded_by": platform.node(),
            "objects": objects,
            "encryption": (
                {"cipher": CIPHER, "chunk_bytes": self.sealer.chunk_bytes,
                 "key_id": self.sealer.key_id}
                if self.sealer else None
            ),
        }

    def _put_remote_manifest(self, remote: dict[str, Any]) -> None:
        remote = dict(remote, uploaded=time.time())
        body = json.dumps(remote, indent=2, sort_keys=True).encode()
        path = self.store.path(self.snapshot_id, REMOTE_MANIFEST)
        self.store.retry("put remote manifest", lambda: self.store.fs.pipe_file(path, body))

    def _undo(self, multipart: list[_File]) -> None:
        """Best effort: abort open multipart uploads and remove what went up."""
        # The failure itself is what gets reported; cleanup errors would only hide it.
        for f in multipart:
            if f.upload_id:
                with contextlib.suppress(Exception):
                    self._s3("abort_multipart_upload", f)
        with contextlib.suppress(Exception):
            self.store.discard(self.snapshot_id)


def abort_stale_multipart(store: RemoteObjects, cutoff: float) -> None:
    """Abort S3 multipart uploads under the store's prefix started before ``cutoff``."""
    bucket, prefix, _ = store.fs.split_path(store.root)
    reply = store.retry(
        "list multipart uploads",
        lambda: store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix),
    )
    for upload in reply.get("Uploads", []):
        started = upload.get("Initiated")
        if started is not None and started.timestamp() > cutoff:
            continue
        abort = functools.partial(
            store.fs.call_s3,
            "abort_multipart_upload",
            Bucket=bucket,
            Key=upload["Key"],
            UploadId=upload["UploadId"],
        )
        store.retry("abort multipart upload", abort)
