"""The snapshot store: one directory per snapshot, CRIU images plus a signed ``manifest.json``.

A snapshot appears in the store only by an atomic rename of a fully written and fsynced
directory, so a crash or a failed save never leaves a half snapshot listed. Snapshots hold
the whole memory of a kernel and are code that root runs at restore, so:

- the store must be private (``safe_fs.require_private_dir``); files are 0600;
- nothing inside it is reached through a symlink (dir-fd walks, ``O_NOFOLLOW``);
- a manifest is used only once its HMAC matched this node's key and it passed the schema;
  anything else is listed as ``unsigned`` or ``damaged`` with the reason, and never restored.

This module keeps the directory: partial snapshots and their commit, manifests signed,
judged and replaced, lookups, locks. A snapshot's id, name and ``Snapshot`` view are in
``snapshot.py``; its image files are digested and checked by ``images.py``, and staged for
a restore or an upload by ``staging.py``; large ones are kept by content (``packs/``).

FORMAT (the store's directory; this module lays it out)

``<store>/`` (0700, private to its owner; every file 0600):

- ``<id>/``: a snapshot: ``manifest.json`` (``manifest.py``), the image files criu wrote,
  and for each large one kept by content its recipe ``<file>.chunks`` in its place
  (``packs/recipes.py``); with a portable copy, its ``portable.*`` files;
- ``.partial-<id>/``: a save in progress: ``.owner`` (JSON: pid, start time, command, for
  people; the snapshot's lock is what owns it), ``.manifest-draft.json``, criu's images,
  and ``.dump-complete`` once criu's post-dump action saw every image whole;
- ``.deleting-<id>/``: a snapshot renamed out of the listing, being removed;
- ``.unfinished-<id>/``: a partial that no recovery could commit, kept for a person;
- ``.assembled-<token>/``: whole files assembled from the packs for a check or an upload
  (``staging.py``);
- ``chunks/``: the packs, their ids and the remembered plans (``packs/layout.py``,
  ``packs/plans.py``);
- ``logs/``: criu's logs of failed runs, their last 4 MiB each;
- ``.locks/``: one lock file per kernel, name or snapshot in use (``core/locks.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ..._constants import ENV_SIGNING_KEY, ENV_STORE_DIR
from .. import safe_fs
from ..errors import InvalidRequest, NotFound, SnapshotError
from ..locks import StoreLocks
from ..locks import name_key as name_lock_key
from ..locks import snapshot_key as snapshot_lock_key
from ..progress import ProgressFn
from . import digest
from .manifest import (
    CONNECTION_KEYS,
    FORMAT_VERSION,
    LEGACY_FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    ManifestPolicy,
    kernel_problem,
)
from .manifest import problem as manifest_problem
from .signing import SigningKey
from .snapshot import DAMAGED, UNSIGNED, Snapshot, is_snapshot_id, validate_name

# The packs, the image files, their staging and the streamer are imported by the operations
# that move pages (saves, restores, deletes, transfers): reading the manifests, as a listing
# does, needs none of them (nor numpy).
if TYPE_CHECKING:
    from . import images, packs
    from .streamer import ImageFile

PARTIAL_PREFIX = ".partial-"
DELETING_PREFIX = ".deleting-"
OWNER_FILE = ".owner"
# A partial that holds an image nobody could commit; kept for a person to look at.
UNFINISHED_PREFIX = ".unfinished-"
# The manifest without file digests, written before criu dumps: a recovery commits it.
DRAFT_FILE = ".manifest-draft.json"
# Written by criu's post-dump action, once every image file is complete.
DUMP_COMPLETE_FILE = ".dump-complete"
LOGS_DIR = "logs"
# A recipe names 16 bytes per 4 KiB page: this much covers a 1 TiB image file.
MAX_RECIPE_BYTES = 4 << 30


def holds_recipes(name: str) -> bool:
    """Whether the store's entry ``name`` is a directory whose recipes keep pages alive: a
    snapshot, a save in progress, or a partial kept for a person to look at."""
    return (is_snapshot_id(name) or name.startswith(PARTIAL_PREFIX)
            or name.startswith(UNFINISHED_PREFIX))


def default_store_dir() -> Path:
    """``$JUPYTER_GPU_SNAPSHOT_DIR``, else ``gpu_snapshots`` under the Jupyter data dir."""
    env = os.environ.get(ENV_STORE_DIR)
    if env:
        return Path(env)
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "gpu_snapshots"


def default_key_file() -> Path:
    """``$JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE``, else a file in the Jupyter data dir."""
    env = os.environ.get(ENV_SIGNING_KEY)
    if env:
        return Path(env)
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "gpu_snapshot_signing.key"


KERNEL_LOG_SUBDIR = "gpu_snapshot"


def default_kernel_log_dir() -> Path:
    """Where snapshot-ready kernels of this user write their logs (the runtime dir's): a
    manifest naming a log file elsewhere is refused (``ManifestPolicy.kernel_log_dir``)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(os.path.realpath(Path(jupyter_runtime_dir()) / KERNEL_LOG_SUBDIR))


class SnapshotStore:
    """Snapshots on local disk under ``root``, signed with the key in ``key_file``."""

    def __init__(
        self,
        root: Path | str | None = None,
        key_file: Path | str | None = None,
        policy: ManifestPolicy | None = None,
        chunk_images: bool = True,
    ) -> None:
        self.root = Path(root) if root is not None else default_store_dir()
        # Large image files kept by content, each page once per store (packs/).
        self.chunk_images = chunk_images
        self.key_file = Path(key_file) if key_file else default_key_file()
        self.policy = policy or ManifestPolicy(kernel_log_dir=default_kernel_log_dir)
        self._key: SigningKey | None = None
        self._key_lock = threading.Lock()
        self.locks = StoreLocks(self.root)

    @property
    def key(self) -> SigningKey:
        with self._key_lock:
            if self._key is None:
                self._key = SigningKey.load(self.key_file)
            return self._key

    def ensure(self) -> Path:
        """Create the store (0700 with its missing parents) and refuse it unless private."""
        safe_fs.make_private_dirs(self.root)
        safe_fs.tighten_own_dir(self.root)
        safe_fs.require_private_dir(self.root)
        return self.root

    @contextlib.contextmanager
    def _root_fd(self, create: bool = True) -> Iterator[int | None]:
        if not create and not os.path.lexists(self.root):
            yield None
            return
        self.ensure()
        # The configured path may be a link (the whole chain was checked); inside, never.
        with safe_fs.opened_dir(os.path.realpath(self.root)) as fd:
            yield fd

    @contextlib.contextmanager
    def opened_root(self) -> Iterator[int | None]:
        """The store's directory opened (never through a link inside), or None while there
        is no store; for readers of the whole store, such as ``usage.py``."""
        with self._root_fd(create=False) as root_fd:
            yield root_fd

    def _chunks(self, root_fd: int) -> packs.PageStore:
        from . import packs

        return packs.PageStore(root_fd, self.locks, self.key.derive(packs.ID_CONTEXT))

    @contextlib.contextmanager
    def chunk_store(self, keyed: bool = True) -> Iterator[packs.PageStore]:
        """The store's page packs, for a remote transfer that reads or adds pages
        (``remote/``): an upload reads the pages a remote lacks (by their ids: it
        needs no key, ``keyed=False``), a download adds those this store lacks."""
        from . import packs

        with self._root_fd() as root_fd:
            assert root_fd is not None
            yield self._chunks(root_fd) if keyed else packs.PageStore(root_fd, self.locks, b"")

    @contextlib.contextmanager
    def _holding_chunks(self, root_fd: int, step: str) -> Iterator[packs.PageStore]:
        store = self._chunks(root_fd)
        with store.hold(step):
            yield store

    # -- writing ---------------------------------------------------------------------------
    def begin(self, snapshot_id: str) -> Path:
        """Create the private working directory a save dumps into.

        The caller holds ``locks.snapshot_key(snapshot_id)`` from now until the commit's
        rename or the abort: that lock, not a file, is what marks the directory as owned.
        ``.owner`` says who for people (pid and start time: a pid alone may be reused).
        """
        name = f"{PARTIAL_PREFIX}{snapshot_id}"
        me = psutil.Process()
        owner = {"pid": me.pid, "started": me.create_time(), "command": me.cmdline()[:4]}
        with self._root_fd() as root_fd:
            assert root_fd is not None
            os.mkdir(name, 0o700, dir_fd=root_fd)
            with safe_fs.opened_dir(name, root_fd) as fd:
                os.fchmod(fd, 0o700)
                safe_fs.write_new(OWNER_FILE, fd, json.dumps(owner).encode())
        return self.root / name

    def write_draft(self, partial: Path, manifest: dict[str, Any]) -> None:
        """Keep the manifest (without digests) in ``partial`` before criu dumps into it."""
        draft = dict(manifest, format=FORMAT_VERSION, verified=False)
        staged = f"{DRAFT_FILE}.new"
        with self._root_fd() as root_fd, safe_fs.opened_dir(partial.name, root_fd) as dfd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged, dir_fd=dfd)
            safe_fs.write_new(staged, dfd, json.dumps(draft, sort_keys=True).encode())
            os.replace(staged, DRAFT_FILE, src_dir_fd=dfd, dst_dir_fd=dfd)

    def commit(
        self,
        partial: Path,
        manifest: dict[str, Any],
        progress: ProgressFn | None = None,
        followed: dict[str, packs.FollowedFile] | None = None,
    ) -> Snapshot:
        """Digest (on all cores), sign, fsync and atomically publish ``partial``.

        The caller holds the snapshot's lock, and the name's lock when it chose the name;
        the name is checked again here, right before the rename. ``followed``: what
        ``follow_dump``'s follower read of the images while criu wrote them.
        """
        from . import images

        snapshot_id = manifest["id"]
        with (
            self._root_fd() as root_fd,
            safe_fs.opened_dir(partial.name, root_fd) as dfd,
            contextlib.ExitStack() as stack,
        ):
            assert root_fd is not None
            # Held through the rename: the collector must find the recipes, in the partial
            # or in the snapshot, whenever it looks.
            chunker = stack.enter_context(self._holding_chunks(root_fd, "commit")) if (
                self.chunk_images) else None
            algorithm, files, stored = images.digest_new(dfd, progress, chunker, followed)
            manifest = dict(manifest, format=FORMAT_VERSION, digest=algorithm, files=files,
                            stored=stored)
            manifest.pop("verified", None)
            name = manifest.get("name")
            if name and self.find_name(str(name)) is not None:
                raise InvalidRequest(
                    "commit",
                    f"a snapshot named {name!r} was committed meanwhile",
                    hint="pick another name, or delete the old one first",
                )
            signed = self._sign(manifest, snapshot_id, "commit")
            safe_fs.write_new(MANIFEST, dfd, _encode(signed))
            # Bookkeeping of the save goes last: until the rename, the lock says who owns it.
            for hidden in os.listdir(dfd):
                if hidden.startswith("."):
                    os.unlink(hidden, dir_fd=dfd)
            os.fchmod(dfd, 0o700)
            os.fsync(dfd)
            os.rename(partial.name, snapshot_id, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            os.fsync(root_fd)
            # The whole files that are now recipes; dropped before most of their pages
            # ever reach the disk. A crash before this leaves them, and the recipe wins.
            for chunked in images.stored_as_recipes(dfd, files):
                os.unlink(chunked, dir_fd=dfd)
        return Snapshot(snapshot_id, self.root / snapshot_id, signed)

    def follow_dump(self, partial: Path) -> packs.DumpFollower | None:
        """A follower of the page images criu is about to write into ``partial``
        (``packs.DumpFollower``), or None where images are kept whole or no cores are spare."""
        if not self.chunk_images or digest.preferred_algorithm() != digest.BLAKE3:
            return None
        from . import packs

        with self._root_fd() as root_fd, safe_fs.opened_dir(partial.name, root_fd) as dfd:
            assert root_fd is not None
            return packs.DumpFollower.start(dfd, self.key.derive(packs.ID_CONTEXT))

    def _sign(self, manifest: dict[str, Any], snapshot_id: str, step: str) -> dict[str, Any]:
        kernel = dict(manifest.get("kernel") or {})
        info = kernel.get("connection_info") or {}
        kernel["connection_info"] = {k: v for k, v in info.items() if k in CONNECTION_KEYS}
        manifest = dict(manifest, kernel=kernel)
        manifest["signature"] = self.key.sign(manifest)
        # Never write what this store would refuse to read back.
        problem = manifest_problem(manifest, snapshot_id, self.policy)
        if problem:
            raise SnapshotError(step, f"the manifest of {snapshot_id} would be invalid: {problem}")
        return manifest

    def abort(self, partial: Path) -> None:
        with contextlib.suppress(OSError), self._root_fd(create=False) as root_fd:
            if root_fd is not None:
                safe_fs.remove_at(partial.name, root_fd)

    def keep_log(self, source: Path, label: str) -> Path:
        """Copy a failed run's criu log into the store's ``logs/`` (never through a link)."""
        with self._root_fd() as root_fd:
            assert root_fd is not None
            with contextlib.suppress(FileExistsError):
                os.mkdir(LOGS_DIR, 0o700, dir_fd=root_fd)
            with safe_fs.opened_dir(LOGS_DIR, root_fd) as logs_fd:
                name = f"{time.strftime('%Y%m%dT%H%M%S')}-{label}-{secrets.token_hex(2)}.log"
                safe_fs.write_new(name, logs_fd, source.read_bytes()[-(4 << 20):])
        return self.root / LOGS_DIR / name

    # -- reading ---------------------------------------------------------------------------
    def _load(self, root_fd: int, name: str) -> Snapshot | None:
        """The snapshot in directory ``name``, with its status; None for what is no snapshot
        (a symlink, a file, a directory gone meanwhile)."""
        path = self.root / name
        if safe_fs.entry_kind(name, root_fd) != "dir":
            return None
        try:
            with safe_fs.opened_dir(name, root_fd) as fd:
                raw = safe_fs.read_small(MANIFEST, fd, MAX_MANIFEST_BYTES)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not os.path.lexists(path):
                return None  # deleted meanwhile
            return Snapshot(name, path, {}, DAMAGED, f"manifest unreadable: {exc}")
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            return Snapshot(name, path, {}, DAMAGED, f"manifest is no JSON: {exc}")
        return self.judge(name, manifest)

    def judge(self, name: str, manifest: Any) -> Snapshot:
        """The snapshot ``name`` with ``manifest`` and its status: its signature and schema
        checked against this node's key. Called by ``_load``, and by the server for the
        manifests of snapshots that exist only in the remote store."""
        path = self.root / name
        if not isinstance(manifest, dict):
            return Snapshot(name, path, {}, DAMAGED, "manifest is no JSON object")
        if "signature" not in manifest and manifest.get("format") == LEGACY_FORMAT:
            return Snapshot(name, path, manifest, UNSIGNED, "its manifest carries no signature")
        signature_problem = self.key.problem(manifest)
        if signature_problem:
            return Snapshot(name, path, {}, DAMAGED, f"not written by this node: "
                            f"{signature_problem}")
        problem = manifest_problem(manifest, name, self.policy)
        if problem:
            return Snapshot(name, path, {}, DAMAGED, problem)
        return Snapshot(name, path, manifest)

    def _iter(self) -> Iterator[Snapshot]:
        with self._root_fd(create=False) as root_fd:
            if root_fd is None:
                return
            for name in sorted(os.listdir(root_fd)):
                if is_snapshot_id(name):
                    snapshot = self._load(root_fd, name)
                    if snapshot is not None:
                        yield snapshot

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Every snapshot, whatever its status, oldest first (for listings people read).

        With ``notebook_path``, only that notebook's (damaged ones name no notebook).
        """
        found = [s for s in self._iter() if notebook_path is None
                 or (s.status != DAMAGED and s.notebook_path == notebook_path)]
        return sorted(found, key=lambda s: (s.created, s.id))

    def list(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Trusted snapshots, oldest first; optionally only one notebook's."""
        return [s for s in self.catalog(notebook_path) if s.trusted]

    def find_name(self, name: str) -> Snapshot | None:
        return next((s for s in self._iter() if s.trusted and s.name == name), None)

    def get(self, ref: str) -> Snapshot:
        """A snapshot by id (whatever its status) or by name (trusted ones only)."""
        found: Snapshot | None = None
        if not is_snapshot_id(ref):
            validate_name(ref)
            found = self.find_name(ref)
        else:
            with self._root_fd(create=False) as root_fd:
                if root_fd is not None:
                    if safe_fs.entry_kind(ref, root_fd) == "symlink":
                        raise NotFound(
                            "lookup",
                            f"{self.root / ref} is a symbolic link, not a snapshot; it is "
                            "never followed",
                            hint="remove the link",
                        )
                    found = self._load(root_fd, ref)
        if found is None:
            raise NotFound(
                "lookup",
                f"no snapshot {ref!r} in {self.root}",
                hint="'jupyter gpu-snapshot list' shows the snapshots there are",
            )
        return found

    def drop_whole_copies(self, snapshot_id: str) -> builtins.list[str]:
        """Remove the whole image files that a commit cut off after its rename left beside
        their recipes: a snapshot reads the recipe (``images.stored_as_recipes``), the whole
        file only takes room. Called by a recovery; a snapshot in use, or not trusted, is
        left as it is. Returns the names removed."""
        from . import images, packs

        with self._root_fd(create=False) as root_fd:
            if root_fd is None or safe_fs.entry_kind(snapshot_id, root_fd) != "dir":
                return []
            with safe_fs.opened_dir(snapshot_id, root_fd) as dfd:
                present = set(os.listdir(dfd))
                if not any(packs.recipe_name(name) in present for name in present):
                    return []
                snapshot = self._load(root_fd, snapshot_id)
                if snapshot is None or not snapshot.trusted:
                    return []
                held = self.locks.try_acquire(snapshot_lock_key(snapshot_id), "recovery")
                if held is None:
                    return []
                with held:
                    whole = [name for name in images.stored_as_recipes(
                        dfd, snapshot.manifest["files"]) if name in present
                        and safe_fs.entry_kind(name, dfd) == "file"]
                    for name in whole:
                        os.unlink(name, dir_fd=dfd)
                    if whole:
                        os.fsync(dfd)
                return whole

    def delete(self, ref: str) -> Snapshot:
        """Delete by name (trusted snapshots) or by id (any, damaged ones included).

        ``Busy`` while another process restores it.
        """
        snapshot = self.get(ref)
        with self.locks.hold(
            snapshot_lock_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})", "delete",
            note="delete",
        ), self._root_fd() as root_fd:
            assert root_fd is not None
            # Renaming first takes it out of every listing at once, even if removal is slow.
            doomed = f"{DELETING_PREFIX}{snapshot.id}"
            try:
                os.rename(snapshot.id, doomed, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            except FileNotFoundError:
                raise NotFound("delete", f"snapshot {snapshot.id} was deleted meanwhile") from None
            safe_fs.remove_at(doomed, root_fd)
        self.collect_garbage()
        return snapshot

    def collect_garbage(self, wait: bool = True) -> packs.CollectReport:
        """Free the pages no snapshot, save in progress or restore needs any more. Without
        ``wait``, nothing is done while another operation holds the packs."""
        from . import packs

        with self._root_fd(create=False) as root_fd:
            if root_fd is None or safe_fs.entry_kind(packs.CHUNKS_DIR, root_fd) != "dir":
                return packs.CollectReport()
            chunk_store = self._chunks(root_fd)
            held = chunk_store.hold("collect") if wait else self.locks.try_acquire(
                packs.LOCK_KEY, "collect")
            if held is None:
                return packs.CollectReport()
            with held:
                return chunk_store.collect(self._live_recipes(root_fd))

    def _live_recipes(self, root_fd: int) -> builtins.list[bytes]:
        """Every recipe of the snapshots, of the saves in progress and of the partials kept
        for a person to look at, read under the chunks lock. A directory that moves while
        it is read (a recovery keeps a partial aside) makes the whole scan start again:
        missing one recipe would free pages a snapshot needs."""
        from .packs import RECIPE_SUFFIX

        for _ in range(20):
            found: builtins.list[bytes] = []
            try:
                for name in os.listdir(root_fd):
                    if not holds_recipes(name):
                        continue
                    if safe_fs.entry_kind(name, root_fd) != "dir":
                        continue
                    with safe_fs.opened_dir(name, root_fd) as dfd:
                        for entry in os.listdir(dfd):
                            if entry.endswith(RECIPE_SUFFIX) and not entry.startswith("."):
                                found.append(safe_fs.read_small(entry, dfd, MAX_RECIPE_BYTES))
            except FileNotFoundError:
                continue
            return found
        raise SnapshotError("collect", "the store kept changing while its pages were counted",
                            hint="try again when no save or delete is running")

    def rename(self, ref: str, new_name: str) -> Snapshot:
        """Give a trusted snapshot another name: its manifest, re-signed, replaces the old
        one atomically. ``Busy`` while another operation holds the snapshot or the name."""
        validate_name(new_name)
        snapshot = self.get(ref)
        with self.locks.hold(
            snapshot_lock_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})", "rename",
            note="rename",
        ), self.locks.hold(
            name_lock_key(new_name), f"the snapshot name {new_name!r}", "rename", note="rename",
        ), self._root_fd() as root_fd:
            assert root_fd is not None
            # Read again under the lock: only what this node signed is ever re-signed.
            current = self.get(snapshot.id)
            current.require_trusted("rename")
            if current.name == new_name:
                return current
            other = self.find_name(new_name)
            if other is not None:
                raise InvalidRequest(
                    "rename",
                    f"a snapshot named {new_name!r} exists already ({other.id})",
                    hint="pick another name, or delete that snapshot first",
                )
            return self._resign(root_fd, current, {"name": new_name}, "rename")

    def add_warning(self, ref: str, warning: str) -> Snapshot:
        """Add a warning to a trusted snapshot's manifest, re-signed (e.g. that the kernel
        died after its save)."""
        snapshot = self.get(ref)
        with self.locks.hold(
            snapshot_lock_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})",
            "commit", note="warning",
        ), self._root_fd() as root_fd:
            assert root_fd is not None
            current = self.get(snapshot.id)
            current.require_trusted("commit")
            warnings = [*current.manifest.get("warnings", []), warning]
            return self._resign(root_fd, current, {"warnings": warnings}, "commit")

    def record_timings(self, ref: str, timings: dict[str, float]) -> Snapshot:
        """Replace a trusted snapshot's timings, re-signed: a save's commit and total are
        known only once the manifest is signed."""
        snapshot = self.get(ref)
        with self.locks.hold(
            snapshot_lock_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})",
            "commit", note="timings",
        ), self._root_fd() as root_fd:
            assert root_fd is not None
            current = self.get(snapshot.id)
            current.require_trusted("commit")
            return self._resign(root_fd, current, {"timings": timings}, "commit")

    def _resign(self, root_fd: int, current: Snapshot, changes: dict[str, Any],
                step: str) -> Snapshot:
        """Replace ``current``'s manifest, with ``changes`` and signed again, atomically."""
        manifest = {k: v for k, v in current.manifest.items() if k != "signature"}
        signed = self._sign({**manifest, **changes}, current.id, step)
        staged = f".{MANIFEST}.resigned"
        with safe_fs.opened_dir(current.id, root_fd) as dfd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged, dir_fd=dfd)
            safe_fs.write_new(staged, dfd, _encode(signed))
            os.replace(staged, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        return Snapshot(current.id, current.path, signed)

    def reload(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` read again from disk, refused unless trusted (a restore's first step)."""
        fresh = self.get(snapshot.id)
        fresh.require_trusted()
        problem = kernel_problem(fresh.manifest, self.policy)
        if problem:
            raise SnapshotError(
                "preflight",
                f"snapshot {fresh.id} cannot be restored here: {problem}",
                hint="install the snapshot-ready kernelspec "
                "('jupyter gpu-snapshot kernelspec install')",
            )
        return fresh

    @contextlib.contextmanager
    def opened_images(
        self, snapshot: Snapshot
    ) -> Iterator[tuple[Path, builtins.list[images.Image]]]:
        """A directory holding the whole image files of trusted ``snapshot``, and those
        files as ``(fd, size)``, assembled from the store's pages where needed
        (``staging.opened_images``); removed and closed on leaving."""
        from . import staging

        with self._root_fd() as root_fd:
            assert root_fd is not None
            with staging.opened_images(self.root, self._chunks(root_fd), snapshot) as found:
                yield found

    @contextlib.contextmanager
    def served_images(self, snapshot: Snapshot) -> Iterator[dict[str, ImageFile]]:
        """Every image file of trusted ``snapshot``, ready to be read where it is, for a
        restore's ``ImageStreamer`` (``staging.served_images``); closed on leaving."""
        from . import staging

        with self._root_fd() as root_fd:
            assert root_fd is not None
            with staging.served_images(self._chunks(root_fd), snapshot) as served:
                yield served

    def find_pages(self, snapshot: Snapshot) -> None:
        """Find where the pages of trusted ``snapshot`` lie in the packs, and remember it
        for its restores (``packs.RememberedPlan``): done by a save once it is durable, so
        that its first restore does not sort the store's ids first."""
        with self.served_images(snapshot):
            pass

    @contextlib.contextmanager
    def portable_files(self, snapshot: Snapshot) -> Iterator[Path]:
        """A private directory with the checked portable copy of trusted ``snapshot``
        (``staging.portable_files``); removed on leaving."""
        from . import staging

        with self._root_fd() as root_fd:
            assert root_fd is not None
            with staging.portable_files(self.root, self._chunks(root_fd), snapshot) as found:
                yield found

    def verify(self, snapshot: Snapshot, progress: ProgressFn | None = None) -> None:
        """Check the signature, the file list, every size and every digest."""
        from . import images

        snapshot = self.reload(snapshot)
        with self.opened_images(snapshot) as (_, opened):
            images.check_digests(snapshot, opened, progress)

    # -- trust -----------------------------------------------------------------------------
    def trust(self, snapshot_id: str, progress: ProgressFn | None = None) -> Snapshot:
        """Sign an unsigned snapshot with this node's key, once its old checksums match.

        Called by ``jupyter gpu-snapshot trust`` after the user was warned: it is the one way
        a snapshot this node did not write becomes restorable.
        """
        snapshot = self.get(snapshot_id)
        if snapshot.status != UNSIGNED:
            raise InvalidRequest(
                "trust",
                f"snapshot {snapshot.id} is {snapshot.status}"
                + (f": {snapshot.problem}" if snapshot.problem else ""),
                hint="only unsigned snapshots (written before signing) can be trusted",
            )
        legacy = snapshot.manifest
        files = legacy.get("files")
        if not isinstance(files, dict) or not files:
            raise SnapshotError("trust", f"snapshot {snapshot.id} lists no files")
        from . import images

        with self._root_fd() as root_fd, safe_fs.opened_dir(snapshot.id, root_fd) as dfd:
            assert root_fd is not None
            algorithm, redigested = images.redigest_legacy(dfd, snapshot.id, files, progress)
            manifest = {k: v for k, v in legacy.items() if k not in ("files", "sha256")}
            manifest.update(format=FORMAT_VERSION, digest=algorithm, files=redigested)
            signed = self._sign(manifest, snapshot.id, "trust")
            tmp = f".{MANIFEST}.{secrets.token_hex(4)}"
            safe_fs.write_new(tmp, dfd, _encode(signed))
            os.rename(tmp, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        return Snapshot(snapshot.id, snapshot.path, signed)

    # -- housekeeping ----------------------------------------------------------------------
    def audit(self) -> builtins.list[str]:
        """Everything unsafe about the store, for ``jupyter gpu-snapshot check``."""
        if not os.path.lexists(self.root):
            return []
        problems = safe_fs.chain_problems(self.root)
        if problems:
            return problems
        with safe_fs.opened_dir(os.path.realpath(self.root)) as root_fd:
            for name in sorted(os.listdir(root_fd)):
                if safe_fs.entry_kind(name, root_fd) == "symlink":
                    problems.append(f"{self.root / name} is a symbolic link (never followed)")
        return problems

    def free_bytes(self) -> int:
        self.ensure()
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


def _encode(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, sort_keys=True).encode()
