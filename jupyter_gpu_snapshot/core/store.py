"""The snapshot store: one directory per snapshot, CRIU images plus ``manifest.json``.

A snapshot appears in the store only by an atomic rename of a fully written and fsynced
directory, so a crash or a failed save never leaves a half snapshot listed. Snapshots hold
the whole memory of a kernel (tokens, keys), so the store is 0700 and every file 0600.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from .._constants import ENV_STORE_DIR
from .errors import InvalidRequest, NotFound, SnapshotError
from .locks import StoreLocks
from .locks import snapshot_key as snapshot_lock_key

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL_PREFIX = ".partial-"
DELETING_PREFIX = ".deleting-"
# A partial that holds an image nobody could commit; kept for a person to look at.
UNFINISHED_PREFIX = ".unfinished-"
OWNER_FILE = ".owner"
# The manifest without file digests, written before criu dumps: a recovery commits it.
DRAFT_FILE = ".manifest-draft.json"
# Written by criu's post-dump action, once every image file is complete.
DUMP_COMPLETE_FILE = ".dump-complete"

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")
_HASH_CHUNK = 8 << 20
TREE_CHUNK = 64 << 20
TREE_TAG = b"jupyter-gpu-snapshot sha256 tree, 64 MiB chunks\n"

ProgressFn = Callable[[int, int], None]


def default_store_dir() -> Path:
    """``$JUPYTER_GPU_SNAPSHOT_DIR``, else ``gpu_snapshots`` under the Jupyter data dir."""
    env = os.environ.get(ENV_STORE_DIR)
    if env:
        return Path(env)
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "gpu_snapshots"


def validate_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name) or name.endswith((".", "-")) or ".." in name:
        raise InvalidRequest(
            "preflight",
            f"invalid snapshot name {name!r}",
            hint="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


def is_snapshot_id(ref: str) -> bool:
    return bool(ID_PATTERN.fullmatch(ref))


def new_snapshot_id(now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(now or time.time(), tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(4)}"


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """The sha256 of a file; large files are hashed in parallel chunks.

    Files up to ``TREE_CHUNK`` bytes get their plain sha256. Larger ones (the memory pages)
    get the sha256 of the concatenated sha256s of their ``TREE_CHUNK``-sized chunks, so that
    every core hashes at once: checking a multi-GB image before each restore is otherwise
    several seconds of one core at about 1.5 GB/s.
    """
    size = path.stat().st_size
    if size <= TREE_CHUNK:
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                if progress:
                    progress(len(chunk))
        return digest.hexdigest()
    lock = threading.Lock()
    fd = os.open(path, os.O_RDONLY)

    def chunk_digest(offset: int) -> bytes:
        digest = hashlib.sha256()
        end = min(offset + TREE_CHUNK, size)
        while offset < end:
            data = os.pread(fd, min(_HASH_CHUNK, end - offset), offset)
            if not data:
                raise OSError(f"{path} shrank while it was read")
            digest.update(data)  # releases the GIL: chunks really hash in parallel
            offset += len(data)
            if progress:
                with lock:
                    progress(len(data))
        return digest.digest()

    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            parts = list(pool.map(chunk_digest, range(0, size, TREE_CHUNK)))
    finally:
        os.close(fd)
    return hashlib.sha256(TREE_TAG + b"".join(parts)).hexdigest()


def _write_private(path: Path, text: str, fsync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: its directory and its manifest."""

    id: str
    path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or self.id)

    @property
    def created(self) -> float:
        return float(self.manifest.get("created", 0.0))

    @property
    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.manifest.get("files", {}).values())

    @property
    def notebook_path(self) -> str | None:
        kernel = self.manifest.get("kernel", {})
        value = kernel.get("notebook_path")
        return str(value) if value else None

    @property
    def connection_info(self) -> dict[str, Any]:
        return dict(self.manifest["kernel"]["connection_info"])

    def summary(self) -> dict[str, Any]:
        """What may be shown to clients: everything but the kernel's HMAC key."""
        kernel = dict(self.manifest.get("kernel", {}))
        info = dict(kernel.get("connection_info", {}))
        info.pop("key", None)
        kernel["connection_info"] = info
        return {
            "id": self.id,
            "name": self.name,
            "created": self.created,
            "created_iso": datetime.fromtimestamp(self.created, tz=timezone.utc).isoformat(),
            "size_bytes": self.size_bytes,
            "host": self.manifest.get("host"),
            "notebook_path": self.notebook_path,
            "kernel": kernel,
            "reason": self.manifest.get("reason", "user"),
            "timings": self.manifest.get("timings", {}),
            "gpu": self.manifest.get("gpu"),
            "versions": self.manifest.get("versions", {}),
            "warnings": self.manifest.get("warnings", []),
            "recovered": bool(self.manifest.get("recovered", False)),
        }


class SnapshotStore:
    """Snapshots on local disk under ``root``."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_store_dir()
        self.locks = StoreLocks(self.root)

    def ensure(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        return self.root

    # -- writing ---------------------------------------------------------------------------
    def begin(self, snapshot_id: str) -> Path:
        """Create the private working directory a save dumps into.

        The caller holds ``locks.snapshot_key(snapshot_id)`` from now until the commit's
        rename or the abort: that lock, not a file, is what marks the directory as owned.
        ``.owner`` says who for people (pid and start time: a pid alone may be reused).
        """
        self.ensure()
        partial = self.root / f"{PARTIAL_PREFIX}{snapshot_id}"
        partial.mkdir(mode=0o700)
        me = psutil.Process()
        owner = {"pid": me.pid, "started": me.create_time(), "command": me.cmdline()[:4]}
        _write_private(partial / OWNER_FILE, json.dumps(owner))
        return partial

    def write_draft(self, partial: Path, manifest: dict[str, Any]) -> None:
        """Keep the manifest (without digests) in ``partial`` before criu dumps into it."""
        draft = dict(manifest, format=FORMAT_VERSION, verified=False)
        staged = partial / f"{DRAFT_FILE}.new"
        staged.unlink(missing_ok=True)
        _write_private(staged, json.dumps(draft, sort_keys=True), fsync=True)
        os.replace(staged, partial / DRAFT_FILE)

    def commit(
        self,
        partial: Path,
        manifest: dict[str, Any],
        progress: ProgressFn | None = None,
    ) -> Snapshot:
        """Checksum, fsync and atomically publish ``partial`` as a snapshot.

        The caller holds the snapshot's lock, and the name's lock when it chose the name;
        the name is checked again here, right before the rename.
        """
        snapshot_id = manifest["id"]
        files = sorted(
            p for p in partial.iterdir()
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
        )
        total = sum(p.stat().st_size for p in files)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        entries: dict[str, dict[str, Any]] = {}
        for path in files:
            os.chmod(path, 0o600)
            entries[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path, advance)}
            _fsync_path(path)
        manifest = dict(manifest, format=FORMAT_VERSION, files=entries)
        manifest.pop("verified", None)
        name = manifest.get("name")
        if name and self.find_name(str(name)) is not None:
            raise InvalidRequest(
                "commit",
                f"a snapshot named {name!r} was committed meanwhile",
                hint="pick another name, or delete the old one first",
            )
        manifest_path = partial / MANIFEST
        fd = os.open(manifest_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(partial, 0o700)
        # Bookkeeping of the save goes last: until the rename, the lock says who owns it.
        for hidden in partial.iterdir():
            if hidden.name.startswith("."):
                hidden.unlink()
        _fsync_path(partial)
        final = self.root / snapshot_id
        os.rename(partial, final)
        _fsync_path(self.root)
        return Snapshot(snapshot_id, final, manifest)

    def abort(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------
    def _load(self, path: Path) -> Snapshot | None:
        try:
            with open(path / MANIFEST) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or manifest.get("id") != path.name:
            return None
        return Snapshot(path.name, path, manifest)

    def _iter(self) -> Iterator[Snapshot]:
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or not is_snapshot_id(entry.name):
                continue
            snapshot = self._load(entry)
            if snapshot is not None:
                yield snapshot

    def list(self, notebook_path: str | None = None) -> list[Snapshot]:
        """Committed snapshots, oldest first; optionally only one notebook's."""
        found = [
            s for s in self._iter() if notebook_path is None or s.notebook_path == notebook_path
        ]
        return sorted(found, key=lambda s: (s.created, s.id))

    def find_name(self, name: str) -> Snapshot | None:
        return next((s for s in self._iter() if s.manifest.get("name") == name), None)

    def get(self, ref: str) -> Snapshot:
        """A snapshot by id or by name."""
        if not is_snapshot_id(ref):
            validate_name(ref)
            found = self.find_name(ref)
        else:
            found = self._load(self.root / ref)
        if found is None:
            raise NotFound(
                "lookup",
                f"no snapshot {ref!r} in {self.root}",
                hint="'jupyter gpu-snapshot list' shows the snapshots there are",
            )
        return found

    def delete(self, ref: str) -> Snapshot:
        """Remove a snapshot; ``Busy`` while another process restores it."""
        snapshot = self.get(ref)
        with self.locks.hold(
            snapshot_lock_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})", "delete",
            note="delete",
        ):
            # Renaming first takes it out of every listing at once, even if removal is slow.
            doomed = self.root / f"{DELETING_PREFIX}{snapshot.id}"
            try:
                os.rename(snapshot.path, doomed)
            except FileNotFoundError:
                raise NotFound("delete", f"snapshot {snapshot.id} was deleted meanwhile") from None
        shutil.rmtree(doomed, ignore_errors=True)
        return snapshot

    def verify(self, snapshot: Snapshot, progress: ProgressFn | None = None) -> None:
        """Check every file's size and sha256 against the manifest before a restore."""
        if snapshot.manifest.get("format") != FORMAT_VERSION:
            raise SnapshotError(
                "verify",
                f"snapshot {snapshot.id} has manifest format {snapshot.manifest.get('format')!r}, "
                f"this version reads format {FORMAT_VERSION}",
            )
        files: dict[str, dict[str, Any]] = snapshot.manifest.get("files", {})
        if not files:
            raise SnapshotError("verify", f"snapshot {snapshot.id} lists no image files")
        present = {p.name for p in snapshot.path.iterdir() if p.name != MANIFEST}
        extra = present - set(files)
        if extra:
            raise SnapshotError(
                "verify", f"snapshot {snapshot.id} has unexpected files: {', '.join(sorted(extra))}"
            )
        for name, entry in files.items():
            path = snapshot.path / name
            if not path.is_file():
                raise SnapshotError("verify", f"image file {name} of {snapshot.id} is missing")
            if path.stat().st_size != entry["size"]:
                raise SnapshotError(
                    "verify",
                    f"image file {name} of {snapshot.id} has {path.stat().st_size} bytes, "
                    f"the manifest says {entry['size']}",
                    hint="the snapshot is damaged; delete it",
                )
        total = sum(int(e["size"]) for e in files.values())
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        for name, entry in files.items():
            if sha256_file(snapshot.path / name, advance) != entry["sha256"]:
                raise SnapshotError(
                    "verify",
                    f"image file {name} of {snapshot.id} does not match its sha256",
                    hint="the snapshot is damaged or was altered; delete it",
                )

    # -- housekeeping ----------------------------------------------------------------------
    def clean_stale(self) -> builtins.list[Path]:
        """Finish or remove what saves whose process died left behind; see ``recovery``."""
        from .recovery import recover_store

        return recover_store(self).removed


    def free_bytes(self) -> int:
        self.ensure()
        return shutil.disk_usage(self.root).free
