"""What a snapshot store takes on disk, and what deleting each snapshot would free now.

Since images are kept by content (``packs/``), a snapshot's logical size says little
about its disk: its pages may be shared with other snapshots of the same kernel. The pages
only it needs are those no other directory's recipe names: other snapshots, saves in
progress and partials kept for a person to look at, as the collector counts them
(``SnapshotStore._live_recipes``). What deleting it frees now is its own directory (files
kept whole, recipes, manifest), the plans remembered for recipes only it holds
(``packs.RememberedPlan``), plus what the collector would then give back: a pack goes
when its live pages fall below ``packs.REPACK_BELOW``, so pages only it needs that sit in
a pack others still mostly need stay on disk until a later delete empties that pack.

Sizes are the files' lengths (``st_size``), as ``PageStore.disk_bytes`` counts them.

Called by ``jupyter gpu-snapshot du`` and by the server's ``GET gpu-snapshot/usage`` (in a
worker thread: it reads every recipe of the store).
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import safe_fs
from ..errors import SnapshotError
from . import digest
from .packs import (
    CHUNKS_DIR,
    ID_BYTES,
    IDS_SUFFIX,
    PACK_SUFFIX,
    PAGE,
    PLAN_SUFFIX,
    RECIPE_SUFFIX,
    REPACK_BELOW,
    recipe_voids,
)
from .snapshot import Snapshot, is_snapshot_id
from .store import MAX_RECIPE_BYTES, SnapshotStore, holds_recipes

_VOID = np.dtype((np.void, ID_BYTES))
_ATTEMPTS = 20


@dataclass(frozen=True)
class StoreRoom:
    """Where the snapshots are kept, as a path, and the free bytes of its file system (None
    when they cannot be read): what the sidebar and autosave's admission read."""

    path: str
    free_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "free_bytes": self.free_bytes}


@dataclass(frozen=True)
class SnapshotUsage:
    """One snapshot's sizes: ``size_bytes`` its images as a restore sees them,
    ``new_bytes`` what its save wrote, ``own_bytes`` its directory, ``frees_bytes`` what
    deleting it would free now (its directory and the pages only it needs)."""

    id: str
    name: str
    status: str
    size_bytes: int
    new_bytes: int
    own_bytes: int
    sole_page_bytes: int
    frees_bytes: int


@dataclass(frozen=True)
class StoreUsage:
    """The store's bytes on disk: its snapshots' directories and its page packs."""

    path: str
    disk_bytes: int
    chunks_bytes: int
    snapshots: list[SnapshotUsage]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Directory:
    own_bytes: int
    pages: npt.NDArray[np.void]  # the distinct ids its recipes need, sorted
    recipes: set[str]  # the BLAKE3 of each of its recipes, which names its remembered plan


@dataclass
class _Pack:
    ids: npt.NDArray[np.void]  # in the order of its pages
    pack_bytes: int


def store_usage(store: SnapshotStore) -> StoreUsage:
    """The store's usage now; its snapshots as ``SnapshotStore.catalog`` lists them (every
    status, oldest first). A directory that moves while the store is read (a commit's
    rename, a delete) makes the whole scan start again: a recipe missed would count pages
    as freed that another snapshot needs."""
    listed = store.catalog()
    for _ in range(_ATTEMPTS):
        with store.opened_root() as root_fd:
            if root_fd is None:
                return StoreUsage(str(store.root), 0, 0, [])
            try:
                directories = _read_directories(root_fd)
                packs = _read_packs(root_fd)
                plans = _read_plans(root_fd)
                chunks_bytes = _dir_bytes(CHUNKS_DIR, root_fd)
            except FileNotFoundError:
                continue
        return _tally(store, listed, directories, packs, plans, chunks_bytes)
    raise SnapshotError("usage", "the store kept changing while its sizes were counted",
                        hint="try again when no save or delete is running")


def _read_directories(root_fd: int) -> dict[str, _Directory]:
    found: dict[str, _Directory] = {}
    for name in os.listdir(root_fd):
        if not holds_recipes(name) or safe_fs.entry_kind(name, root_fd) != "dir":
            continue
        with safe_fs.opened_dir(name, root_fd) as dfd:
            own = 0
            parts = []
            recipes = set()
            for entry in os.listdir(dfd):
                own += _file_bytes(entry, dfd)
                if entry.endswith(RECIPE_SUFFIX) and not entry.startswith("."):
                    recipe = safe_fs.read_small(entry, dfd, MAX_RECIPE_BYTES)
                    recipes.add(digest.blake3_hex(recipe))
                    whole = len(recipe) - len(recipe) % ID_BYTES  # a damaged one
                    parts.append(recipe_voids(recipe[:whole]))
        pages = np.unique(np.concatenate(parts)) if parts else _no_pages()
        found[name] = _Directory(own, pages, recipes)
    return found


def _tally(store: SnapshotStore, listed: list[Snapshot], directories: dict[str, _Directory],
           packs: list[_Pack], plans: dict[str, int], chunks_bytes: int) -> StoreUsage:
    names = list(directories)
    every = [directories[n].pages for n in names]
    labels = np.repeat(np.arange(len(names)), [len(p) for p in every])
    ids, inverse, counts = np.unique(np.concatenate(every) if every else _no_pages(),
                                     return_inverse=True, return_counts=True)
    # Each id needed by one directory only: that directory's number; else -1.
    sole_owner = np.full(len(ids), -1, np.int64)
    single = counts[inverse] == 1
    sole_owner[inverse[single]] = labels[single]
    sole_pages = np.bincount(sole_owner[sole_owner >= 0], minlength=len(names))
    gains = _collector_gains(packs, ids, sole_owner, len(names))
    holders = Counter(key for d in directories.values() for key in d.recipes)
    rows = []
    for snapshot in listed:
        if snapshot.id not in directories:  # deleted since it was listed
            continue
        i = names.index(snapshot.id)
        own = directories[snapshot.id].own_bytes
        sole_plans = sum(plans.get(key, 0) for key in directories[snapshot.id].recipes
                         if holders[key] == 1)
        rows.append(SnapshotUsage(
            id=snapshot.id, name=snapshot.name, status=snapshot.status,
            size_bytes=snapshot.size_bytes, new_bytes=snapshot.new_bytes, own_bytes=own,
            sole_page_bytes=int(sole_pages[i]) * PAGE,
            frees_bytes=own + sole_plans + int(gains[i]),
        ))
    snapshot_bytes = sum(d.own_bytes for name, d in directories.items() if is_snapshot_id(name))
    return StoreUsage(str(store.root), snapshot_bytes + chunks_bytes, chunks_bytes, rows)


def _read_packs(root_fd: int) -> list[_Pack]:
    """The complete packs (their ids written), in name order: the collector's order."""
    if safe_fs.entry_kind(CHUNKS_DIR, root_fd) != "dir":
        return []
    found = []
    with safe_fs.opened_dir(CHUNKS_DIR, root_fd) as dfd:
        for entry in sorted(os.listdir(dfd)):
            if entry.startswith(".") or not entry.endswith(IDS_SUFFIX):
                continue
            raw = safe_fs.read_small(entry, dfd, MAX_RECIPE_BYTES)
            ids = np.frombuffer(raw[: len(raw) - len(raw) % ID_BYTES], _VOID)
            pack = entry.removesuffix(IDS_SUFFIX) + PACK_SUFFIX
            found.append(_Pack(ids, _file_bytes(pack, dfd)))
    return found


def _read_plans(root_fd: int) -> dict[str, int]:
    """The remembered plans beside the packs: each one's recipe BLAKE3 and length."""
    if safe_fs.entry_kind(CHUNKS_DIR, root_fd) != "dir":
        return {}
    with safe_fs.opened_dir(CHUNKS_DIR, root_fd) as dfd:
        return {entry.removesuffix(PLAN_SUFFIX): _file_bytes(entry, dfd)
                for entry in os.listdir(dfd)
                if entry.endswith(PLAN_SUFFIX) and not entry.startswith(".")}


def _collector_gains(packs: list[_Pack], live: npt.NDArray[np.void],
                     sole_owner: npt.NDArray[np.int64], directories: int) -> npt.NDArray[np.int64]:
    """For each directory, the bytes of packs the collector would give back once it is gone
    and not before: ``PageStore.collect``'s rule, pack by pack. ``live`` is every id some
    directory needs (sorted), ``sole_owner`` the directory that alone needs it, or -1."""
    gains = np.zeros(directories, np.int64)
    held = _no_pages()  # ids kept in earlier packs: a second copy of a page is dead
    for pack in packs:
        n = len(pack.ids)
        _, first = np.unique(pack.ids, return_index=True)
        wanted = np.zeros(n, bool)
        wanted[first] = True
        where = np.minimum(np.searchsorted(live, pack.ids), max(len(live) - 1, 0))
        if len(live):
            wanted &= live[where] == pack.ids
        else:
            wanted[:] = False
        wanted &= ~np.isin(pack.ids, held)
        kept = np.nonzero(wanted)[0]
        held = np.union1d(held, pack.ids[kept])
        now = _freed(n, len(kept), pack.pack_bytes)
        owners = sole_owner[where[kept]]
        per_owner = np.bincount(owners[owners >= 0], minlength=directories)
        for d in np.nonzero(per_owner)[0]:
            gains[d] += _freed(n, len(kept) - int(per_owner[d]), pack.pack_bytes) - now
    return gains


def _freed(pages: int, kept: int, pack_bytes: int) -> int:
    """What collecting a pack of ``pages`` frees when ``kept`` of them are live."""
    if kept == pages or (kept and kept >= REPACK_BELOW * pages):
        return 0
    return pack_bytes + (pages - kept) * ID_BYTES - kept * PAGE


def _dir_bytes(name: str, root_fd: int) -> int:
    """The regular files directly in the store's directory ``name``; 0 without one."""
    if safe_fs.entry_kind(name, root_fd) != "dir":
        return 0
    with safe_fs.opened_dir(name, root_fd) as dfd:
        return sum(_file_bytes(entry, dfd) for entry in os.listdir(dfd))


def _file_bytes(entry: str, dfd: int) -> int:
    """The length of ``entry`` if it is a regular file; 0 for one gone meanwhile (a save's
    staged file renamed, a pack the collector removed)."""
    try:
        info = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def _no_pages() -> npt.NDArray[np.void]:
    return np.zeros(0, _VOID)
