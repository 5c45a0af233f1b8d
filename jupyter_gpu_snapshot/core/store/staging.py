"""Restore staging: the image files of a trusted snapshot, made ready for criu or an upload.

A snapshot keeps its large image files as recipes over the store's page packs
(``packs/``). A restore either streams them to criu where they lie
(``served_images``, for the ``ImageStreamer``), or needs them as whole files in one directory
(``opened_images``: a verify, an upload): then they are assembled into a private directory,
in memory when it has room, else beside the snapshots, removed on leaving. A directory left
by a dead process is removed by ``recovery``, which finds it by the names and locks here.

The store opens its directory and hands it here (``SnapshotStore.opened_images`` and
``served_images``); this module never imports the store, which calls it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from .. import locks, safe_fs
from ..errors import SnapshotError
from .manifest import MANIFEST, is_portable_file
from .snapshot import Snapshot

# The packs, the image files and the streamer are imported by the functions that stage
# them: the names and locks below, which a recovery reads, need none of them (nor numpy).
if TYPE_CHECKING:
    from . import images, packs
    from .streamer import ImageFile

# Whole image files assembled beside the snapshots, in a store entry of this prefix, locked
# by ``assembly_key`` while in use.
ASSEMBLED_PREFIX = ".assembled-"
# Assembled files in memory: a directory of this prefix in MEMORY_DIR, locked by its
# ASSEMBLY_LOCK while in use (recovery.clean_work_dirs removes those of dead processes).
MEMORY_DIR = Path("/dev/shm")
MEMORY_ASSEMBLY_PREFIX = "jupyter-gpu-snapshot-assembled-"
ASSEMBLY_LOCK = "owner.lock"
_MEMORY_MARGIN = 2 << 30


def assembly_key(token: str) -> str:
    """The lock held while assembled files are in use."""
    return f"assembled-{token}"


def memory_for_assembly(needed: int) -> Path | None:
    """``MEMORY_DIR`` when it can hold ``needed`` bytes and the machine's memory can hold
    them twice (the files, then the restored kernel) with a margin; else None."""
    try:
        room = os.statvfs(MEMORY_DIR)
    except OSError:
        return None
    free = room.f_bavail * room.f_frsize
    available = psutil.virtual_memory().available
    if free < needed + _MEMORY_MARGIN or available < 2 * needed + _MEMORY_MARGIN:
        return None
    return MEMORY_DIR


@contextlib.contextmanager
def opened_images(
    root: Path, pages: packs.PageStore, snapshot: Snapshot
) -> Iterator[tuple[Path, list[images.Image]]]:
    """A directory holding the whole image files of trusted ``snapshot``, and those
    files as ``(fd, size)``, checked against its manifest's list and sizes
    (``images.opened``). Its own directory when every file is kept whole; else a private
    directory beside it, where the files kept as recipes are assembled from the store's
    pages (their recipes checked against the signed manifest first) and the others are
    hard links; removed on leaving. The files' digests are not checked here: ``verify``
    checks them; an upload reads the directory.

    ``root`` is the store's path, ``pages`` its page packs, opened on its directory (whose
    descriptor and locks they carry).
    """
    from . import images

    snapshot.require_trusted()
    with safe_fs.opened_dir(snapshot.id, pages.root_fd) as dfd:
        files = snapshot.manifest["files"]
        images.require_listed(dfd, files, snapshot.id, "verify")
        recipes = images.stored_as_recipes(dfd, files)
        if not recipes:
            with images.opened(dfd, snapshot) as opened:
                yield root / snapshot.id, opened
            return
        with (
            _assembled(root, pages, snapshot, dfd, recipes) as (path, out_fd),
            images.opened(out_fd, snapshot) as opened,
        ):
            yield path, opened


@contextlib.contextmanager
def served_images(pages: packs.PageStore, snapshot: Snapshot) -> Iterator[dict[str, ImageFile]]:
    """Every image file of trusted ``snapshot``, ready to be read where it is: files
    kept whole opened in its directory, files kept as recipes planned onto the store's
    packs ``pages`` (their recipes checked against the signed manifest first). Nothing is
    assembled or checked here: a restore's ``ImageStreamer`` hands the bytes to criu and
    compares each file with its manifest digest as it goes. A portable copy's files are no
    image: never served, never read. Closed on leaving."""
    from . import images
    from .streamer import ImageFile

    snapshot.require_trusted()
    with safe_fs.opened_dir(snapshot.id, pages.root_fd) as dfd:
        images.require_listed(dfd, snapshot.manifest["files"], snapshot.id, "verify")
        files = {name: entry for name, entry in snapshot.manifest["files"].items()
                 if not is_portable_file(name)}
        recipes = {name: images.read_recipe(dfd, name, files[name], snapshot.id)
                   for name in images.stored_as_recipes(dfd, files)}
        whole_names = sorted(set(files) - set(recipes))
        with contextlib.ExitStack() as stack:
            try:
                whole = stack.enter_context(images.opened_whole(dfd, snapshot, whole_names))
                plans = stack.enter_context(pages.opened_pages(recipes, "restore"))
            except OSError as exc:
                raise SnapshotError(
                    "restore", f"cannot open the page packs of {snapshot.id}: {exc}",
                    hint="the snapshot is damaged; delete it") from exc
            served = {name: ImageFile.whole(name, fd, files[name]["size"],
                                               files[name]["digest"])
                      for name, (fd, _) in whole.items()}
            served.update({name: ImageFile(name, plan.size, files[name]["digest"],
                                           plan.read_into, plan.splice_into,
                                           extents=plan.runs, kept_whole=False)
                           for name, plan in plans.items()})
            yield dict(sorted(served.items()))


@contextlib.contextmanager
def portable_files(root: Path, pages: packs.PageStore, snapshot: Snapshot) -> Iterator[Path]:
    """A private directory holding the portable copy of trusted ``snapshot`` as whole
    files, each checked against its digest before this yields: a kernel loads them, and
    loading runs their pickles. Assembled like ``opened_images``; removed on leaving."""
    from . import images

    snapshot.require_trusted()
    names = sorted((snapshot.manifest.get("portable") or {}).get("files", []))
    with safe_fs.opened_dir(snapshot.id, pages.root_fd) as dfd:
        images.require_listed(dfd, snapshot.manifest["files"], snapshot.id, "verify")
        recipes = [name for name in images.stored_as_recipes(dfd, snapshot.manifest["files"])
                   if name in names]
        if not recipes:  # all kept whole: read where they are, by name
            with images.opened_whole(dfd, snapshot, names) as opened:
                images.check_named_digests(snapshot, opened)
            yield root / snapshot.id
            return
        with _assembled(root, pages, snapshot, dfd, recipes, names) as (path, out_fd):
            with images.opened_whole(out_fd, snapshot, names) as opened:
                images.check_named_digests(snapshot, opened)
            yield path


@contextlib.contextmanager
def _assembled(
    root: Path, pages: packs.PageStore, snapshot: Snapshot, dfd: int, recipes: list[str],
    wanted_names: list[str] | None = None,
) -> Iterator[tuple[Path, int]]:
    """``wanted_names`` (default: every file, and the manifest) in a private directory:
    ``recipes`` among them assembled, the others linked."""
    from . import images

    files = snapshot.manifest["files"]
    linked = set(files) | {MANIFEST} if wanted_names is None else set(wanted_names)
    wanted = {name: images.read_recipe(dfd, name, files[name], snapshot.id)
              for name in recipes}
    needed = sum(int(files[name]["size"]) for name in recipes)
    with _assembly_dir(root, pages, needed) as (outer, outer_fd):
        os.mkdir(snapshot.id, 0o700, dir_fd=outer_fd)
        with safe_fs.opened_dir(snapshot.id, outer_fd) as out_fd:
            # The manifest too: an upload reads the directory as a snapshot.
            for name in sorted(linked - set(recipes)):
                _link_or_copy(name, dfd, out_fd)
            try:
                pages.assemble(wanted, out_fd, lambda n: None)
            except OSError as exc:
                # A full disk says nothing of the snapshot: never ask to delete it.
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                raise SnapshotError(
                    "restore", f"cannot assemble the images of {snapshot.id}: {exc}",
                    hint=("free space on the disk holding the snapshot store, then "
                          "try again") if full else "the snapshot is damaged; delete it",
                ) from exc
            yield outer / snapshot.id, out_fd


@contextlib.contextmanager
def _assembly_dir(root: Path, pages: packs.PageStore, needed: int) -> Iterator[tuple[Path, int]]:
    """A private directory for assembled files, removed on leaving: in memory when it
    has room for them and for the kernel they become (criu then reads them at memory
    speed, and they are never written back to a disk), else beside the snapshots."""
    memory = memory_for_assembly(needed)
    if memory is not None:
        outer = Path(tempfile.mkdtemp(prefix=MEMORY_ASSEMBLY_PREFIX, dir=memory))
        held = locks.try_lock(outer / ASSEMBLY_LOCK, "assemble")
        assert held is not None  # nobody else knows the directory yet
        try:
            with safe_fs.opened_dir(outer) as outer_fd:
                yield outer, outer_fd
        finally:
            shutil.rmtree(outer, ignore_errors=True)
            held.release()
        return
    token = secrets.token_hex(6)
    name = f"{ASSEMBLED_PREFIX}{token}"
    # A lock marks it as in use: a recovery removes only those nobody holds.
    with pages.locks.hold(assembly_key(token), f"assembled images {token}", "restore"):
        try:
            os.mkdir(name, 0o700, dir_fd=pages.root_fd)
            with safe_fs.opened_dir(name, pages.root_fd) as outer_fd:
                yield root / name, outer_fd
        finally:
            safe_fs.remove_at(name, pages.root_fd)


def _link_or_copy(name: str, src_dfd: int, dst_dfd: int) -> None:
    """``name`` from one directory into another: a hard link on one filesystem, else a
    copy; a link in the source is never followed."""
    from . import packs

    try:
        os.link(name, name, src_dir_fd=src_dfd, dst_dir_fd=dst_dfd, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    src, size = safe_fs.open_regular(name, src_dfd)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dst_dfd)
        try:
            packs.copy_range(src, 0, dst, 0, size)
        finally:
            os.close(dst)
    finally:
        os.close(src)
