"""The image files of one snapshot directory: digested when a save is committed, opened and
checked against the manifest when a snapshot is read, checked against the old sha256s
when an unsigned snapshot is trusted.

The store (``store.py``) keeps the directory: it opens it (never through a link),
holds the locks, and signs and writes the manifest. The functions here get that directory
as an open fd and see only the image files in it, each opened by name as a regular file
(``safe_fs.open_regular``), and the manifest's ``files``: name → size and digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from .. import safe_fs
from ..errors import SnapshotError
from ..progress import ProgressFn, byte_counter
from . import digest, packs
from .manifest import MANIFEST
from .snapshot import Snapshot

Files = dict[str, dict[str, Any]]
# An opened image file: its fd and its size when opened.
Image = tuple[int, int]

_ALTERED = "the snapshot is damaged or was altered; delete it"


def digest_new(
    dfd: int, progress: ProgressFn | None = None, chunker: packs.PageStore | None = None,
    followed: dict[str, packs.FollowedFile] | None = None,
) -> tuple[str, Files, dict[str, int]]:
    """Make the images a save wrote into ``dfd`` private (0600) and digest them on all
    cores. With ``chunker``, large files are kept by content (``packs/``): their
    new pages go to the store's packs and a recipe goes beside them; the rest are fsynced.
    Returns the algorithm, the manifest's ``files`` and its ``stored`` section (the bytes
    this save added to the store).

    Called by ``SnapshotStore.commit``, which holds the chunks lock when it passes a
    chunker. Dot files are the save's bookkeeping (owner, draft, dump marker), no image.
    ``followed``: the ids and digests of large images read while criu wrote them.
    """
    for name in os.listdir(dfd):  # recipes of an earlier attempt at this commit
        if name.endswith(packs.RECIPE_SUFFIX):
            os.unlink(name, dir_fd=dfd)
    names = sorted(n for n in os.listdir(dfd) if not n.startswith(".") and n != MANIFEST)
    with _opened(dfd, names, "commit") as opened:
        for fd, _ in opened.values():
            os.fchmod(fd, 0o600)
        chunked = [n for n, (_, size) in opened.items() if chunker is not None
                   and packs.is_chunkable(size)]
        if digest.preferred_algorithm() != digest.BLAKE3:
            chunked = []
        whole = {n: image for n, image in opened.items() if n not in chunked}
        advance = byte_counter(progress, sum(size for _, size in opened.values()))
        algorithm, files = _digest(whole, advance)
        for fd, _ in whole.values():
            os.fsync(fd)
        stored = {"whole_bytes": sum(size for _, size in whole.values())}
        if chunked:
            assert chunker is not None
            results, _ = chunker.chunk_files(dfd, chunked, advance, followed=followed)
            for name, result in results.items():
                files[name] = {"size": opened[name][1], "digest": result.digest,
                               "chunks": digest.blake3_hex(result.recipe)}
            stored.update(
                new_page_bytes=sum(r.new_bytes for r in results.values()),
                recipe_bytes=sum(len(r.recipe) for r in results.values()),
                zero_page_bytes=sum(r.zero_pages for r in results.values()) * packs.PAGE,
            )
    return algorithm, dict(sorted(files.items())), stored


def read_recipe(dfd: int, name: str, entry: dict[str, Any], snapshot_id: str) -> bytes:
    """The recipe of the chunked file ``name``, once its size and digest match the signed
    manifest's ``entry``: only then may it say which pages to read."""
    expected = recipe_bytes(entry)
    try:
        fd, size = safe_fs.open_regular(packs.recipe_name(name), dfd)
        try:
            recipe = os.pread(fd, expected + 1, 0) if size == expected else b""
        finally:
            os.close(fd)
    except OSError as exc:
        raise SnapshotError("verify", f"the recipe of {name} of {snapshot_id} is unreadable: "
                            f"{exc}", hint=_ALTERED) from exc
    if not recipe_matches(recipe, entry):
        raise SnapshotError(
            "verify", f"the recipe of {name} of {snapshot_id} does not match its manifest",
            hint=_ALTERED,
        )
    return recipe


def recipe_bytes(entry: dict[str, Any]) -> int:
    """The length of the recipe of a manifest's ``files`` entry: one id per page."""
    return int(entry["size"]) // packs.PAGE * packs.ID_BYTES


def recipe_matches(recipe: bytes, entry: dict[str, Any]) -> bool:
    """Whether ``recipe`` is the one a manifest's ``files`` entry names: an id per page of
    the file's size, and the entry's BLAKE3 of the recipe. Checked before a recipe says
    which pages to read or send (here, and by the remote store's upload and download)."""
    return len(recipe) == recipe_bytes(entry) and digest.blake3_hex(recipe) == entry.get("chunks")


def stored_as_recipes(dfd: int, files: Files) -> list[str]:
    """The files of a snapshot directory kept as recipes. A chunked file may also be there
    whole (downloaded from a remote store, or a commit cut off after its rename, before it
    removed the whole file); the recipe wins, since only it was made durable."""
    return sorted(
        name for name, entry in files.items()
        if isinstance(entry, dict) and "chunks" in entry
        and safe_fs.entry_kind(packs.recipe_name(name), dfd) == "file"
    )


@contextlib.contextmanager
def opened(dfd: int, snapshot: Snapshot) -> Iterator[list[Image]]:
    """The images of trusted ``snapshot`` in ``dfd``, in the order of their names, once the
    directory holds exactly the files its manifest lists, each a regular file of the listed
    size. Called by ``staging.opened_images``; closed on leaving."""
    require_listed(dfd, snapshot.manifest["files"], snapshot.id, "verify")
    with opened_whole(dfd, snapshot, sorted(snapshot.manifest["files"])) as whole:
        yield list(whole.values())


@contextlib.contextmanager
def opened_whole(dfd: int, snapshot: Snapshot, names: list[str]) -> Iterator[dict[str, Image]]:
    """``names``, files of trusted ``snapshot`` kept whole in ``dfd``, opened (never through
    a link) once each is a regular file of the size its manifest lists; closed on leaving."""
    files: Files = snapshot.manifest["files"]
    with _opened(dfd, names, "verify") as whole:
        for name, (_, size) in whole.items():
            if size != files[name]["size"]:
                raise SnapshotError(
                    "verify",
                    f"image file {name} of {snapshot.id} has {size} bytes, "
                    f"the manifest says {files[name]['size']}",
                    hint=_ALTERED,
                )
        yield whole


def mismatch(snapshot: Snapshot, name: str) -> SnapshotError:
    """The error for an image file whose digest differs from its manifest's."""
    return SnapshotError(
        "verify",
        f"image file {name} of {snapshot.id} does not match its "
        f"{snapshot.manifest['digest']} digest",
        hint=_ALTERED,
    )


def check_digests(
    snapshot: Snapshot,
    images: list[Image],
    progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Compare the digests of ``images`` (from ``opened``) with ``snapshot``'s
    manifest. Called by ``SnapshotStore.verify``, and by the engine's restore while criu
    runs; ``cancel`` stops it early."""
    _compare(snapshot, sorted(snapshot.manifest["files"]), images, "images", progress, cancel)


def check_named_digests(snapshot: Snapshot, opened: dict[str, Image]) -> None:
    """Compare the digests of some files of trusted ``snapshot`` (``opened_whole``'s)
    with its manifest's: a portable copy is checked alone, before a kernel loads it."""
    _compare(snapshot, list(opened), list(opened.values()), "files")


def _compare(
    snapshot: Snapshot,
    names: list[str],
    images: list[Image],
    what: str,
    progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Digest ``images`` (the files ``names`` of ``snapshot``, in that order) and raise at
    the first that differs from its manifest's digest."""
    files: Files = snapshot.manifest["files"]
    total = sum(size for _, size in images)
    try:
        actual = digest.digest_files(images, snapshot.manifest["digest"],
                                     byte_counter(progress, total), cancel)
    except OSError as exc:
        raise SnapshotError(
            "verify", f"cannot read the {what} of {snapshot.id}: {exc}",
            hint="the snapshot is damaged; delete it",
        ) from exc
    for name, got in zip(names, actual, strict=True):
        if files[name]["digest"] != got:
            raise mismatch(snapshot, name)


def redigest_legacy(
    dfd: int, snapshot_id: str, files: Files, progress: ProgressFn | None = None
) -> tuple[str, Files]:
    """Check the images in ``dfd`` against the sha256s of a format-1 manifest's ``files``,
    then digest them as a save does now. Returns the algorithm and the new ``files``.

    Called by ``SnapshotStore.trust``: the old checksums are the one proof that the images
    are those the unsigned manifest describes.
    """
    require_listed(dfd, files, snapshot_id, "trust")
    with _opened(dfd, sorted(files), "trust") as opened:
        for name, (fd, size) in opened.items():
            entry = files[name]
            if not isinstance(entry, dict) or entry.get("size") != size or (
                _legacy_sha256(fd, size) != entry.get("sha256")
            ):
                raise SnapshotError(
                    "trust",
                    f"image file {name} of {snapshot_id} does not match its sha256",
                    hint=_ALTERED,
                )
        total = sum(size for _, size in opened.values())
        return _digest(opened, byte_counter(progress, total))


def require_listed(dfd: int, files: Files, snapshot_id: str, step: str) -> None:
    """Refuse a directory that holds other files than the manifest lists, naming one."""
    present = set(os.listdir(dfd)) - {MANIFEST}
    recipes = {packs.recipe_name(n) for n in stored_as_recipes(dfd, files)}
    extra = present - set(files) - recipes
    if extra:
        raise SnapshotError(
            step, f"snapshot {snapshot_id} has unexpected files: {', '.join(sorted(extra))}",
            hint=_ALTERED,
        )
    missing = set(files) - present - {r.removesuffix(packs.RECIPE_SUFFIX) for r in recipes}
    if missing:
        raise SnapshotError(
            step, f"image file {sorted(missing)[0]} of {snapshot_id} is missing",
            hint="the snapshot is damaged; delete it",
        )
    # Named here, before anything copies or links the files: a link would otherwise fail
    # deep in an assembly with the system's bare "Too many levels of symbolic links".
    for name in sorted(present):
        kind = safe_fs.entry_kind(name, dfd)
        if kind != "file":
            what = {"symlink": "a symbolic link", "dir": "a directory", "missing": "gone",
                    "other": "a FIFO, socket or device"}[kind]
            raise SnapshotError(
                step, f"image file {name} of {snapshot_id} is {what}, not a regular file",
                hint=_ALTERED,
            )


@contextlib.contextmanager
def _opened(dfd: int, names: list[str], step: str) -> Iterator[dict[str, Image]]:
    """``names`` opened as regular files in ``dfd``, never through a link; closed on leaving."""
    opened: dict[str, Image] = {}
    try:
        for name in names:
            try:
                opened[name] = safe_fs.open_regular(name, dfd)
            except OSError as exc:
                raise SnapshotError(
                    step, f"{name} is not a regular file of the snapshot: {exc}", hint=_ALTERED,
                ) from exc
        yield opened
    finally:
        for fd, _ in opened.values():
            os.close(fd)


def _digest(opened: dict[str, Image], advance: digest.Advance) -> tuple[str, Files]:
    """Digests of ``opened`` with this node's algorithm, as a manifest's ``files``."""
    algorithm = digest.preferred_algorithm()
    digests = digest.digest_files(list(opened.values()), algorithm, advance)
    return algorithm, {
        name: {"size": size, "digest": d}
        for (name, (_, size)), d in zip(opened.items(), digests, strict=True)
    }


def _legacy_sha256(fd: int, size: int) -> str:
    """The checksum format-1 manifests carry: plain sha256, or a 64 MiB chunk tree above."""
    if size > digest.TREE_CHUNK:
        return digest.digest_files([(fd, size)], digest.SHA256_TREE)[0]
    h = hashlib.sha256()
    offset = 0
    while offset < size:
        data = os.pread(fd, 8 << 20, offset)
        if not data:
            break
        h.update(data)
        offset += len(data)
    return h.hexdigest()
