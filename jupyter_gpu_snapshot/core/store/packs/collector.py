"""The collector: packs no recipe needs removed, packs mostly dead rewritten.

Called by the store with every recipe of its committed snapshots and of saves in progress,
under the chunks lock (``SnapshotStore.collect_garbage``, after a delete and at recovery).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ... import safe_fs
from .. import digest
from .fd_io import size_at
from .layout import (
    ID_BYTES,
    IDS_SUFFIX,
    PACK_NAME,
    PACK_SUFFIX,
    PAGE,
    Ids,
    PackIndex,
    PackWriter,
    as_keys,
    list_packs,
    read_ids,
    voids,
)
from .plans import PLAN_SUFFIX

# A pack whose live pages fall below this share is rewritten by the collector.
REPACK_BELOW = 0.5


@dataclass
class CollectReport:
    removed: int = 0
    rewritten: int = 0
    freed_bytes: int = 0


def collect(dfd: int, live_recipes: Iterable[bytes]) -> CollectReport:
    """Remove packs no recipe needs from the ``chunks/`` open at ``dfd``, and rewrite those
    mostly dead. The caller passes every recipe of the store's committed snapshots and of
    saves in progress, and holds the chunks lock. Each step leaves the store whole if the
    process dies after it: a rewritten pack is durable before the old one goes, and a pack
    stops being one when its ids go, before its pages do."""
    report = CollectReport()
    live_recipes = list(live_recipes)
    remembered = {digest.blake3_hex(recipe) for recipe in live_recipes}
    for leftover in os.listdir(dfd):
        stem = leftover.removesuffix(PACK_SUFFIX)
        if leftover.startswith(".") or (
            leftover.endswith(PACK_SUFFIX) and PACK_NAME.fullmatch(stem)
            and safe_fs.entry_kind(stem + IDS_SUFFIX, dfd) == "missing"
        ) or (
            # Where the pages of a recipe no snapshot holds any more were.
            leftover.endswith(PLAN_SUFFIX)
            and leftover.removesuffix(PLAN_SUFFIX) not in remembered
        ):
            report.freed_bytes += size_at(leftover, dfd)
            safe_fs.remove_at(leftover, dfd)
    # Liveness by the first 8 bytes of each id: an id of a dead page that shares
    # them with a live one keeps its page (harmless, and as likely as a collision
    # of 64-bit digests); a page is never dropped for it.
    live_high = _live_high(live_recipes)
    held = PackIndex()  # ids kept so far: a second copy of a page is dead
    for pack in list_packs(dfd):
        ids = read_ids(dfd, pack)
        high, _ = as_keys(ids)
        wanted = _first_of_each(ids) & _members(high, live_high)
        wanted &= held.find(ids) < 0
        keep = np.nonzero(wanted)[0]
        held = PackIndex.build([""], [np.concatenate([_ids_of(held), ids[keep]])])
        if len(keep) == len(ids) or (len(keep) and len(keep) >= REPACK_BELOW * len(ids)):
            continue
        size = size_at(pack + PACK_SUFFIX, dfd)
        if len(keep):
            rewrite(dfd, pack, ids, keep)
            report.rewritten += 1
        os.unlink(pack + IDS_SUFFIX, dir_fd=dfd)  # first: from now on it is no pack
        os.unlink(pack + PACK_SUFFIX, dir_fd=dfd)
        report.freed_bytes += size + (len(ids) - len(keep)) * ID_BYTES - len(keep) * PAGE
        report.removed += 1
    os.fsync(dfd)
    return report


def rewrite(dfd: int, pack: str, ids: Ids, keep: npt.NDArray[np.intp]) -> None:
    """A new pack of the ``keep`` pages of ``pack``, durable, copied run by run in the
    kernel."""
    writer = PackWriter(dfd)
    fd, size = safe_fs.open_regular(pack + PACK_SUFFIX, dfd)
    try:
        if size < len(ids) * PAGE:
            raise OSError(f"pack {pack} is shorter than its ids say")
        starts = np.concatenate(([0], np.nonzero(np.diff(keep) != 1)[0] + 1))
        ends = np.concatenate((starts[1:], [len(keep)]))
        runs = [(int(keep[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist(),
                                                            strict=True)]
        writer.copy_from(fd, runs, ids[keep].tobytes())
        writer.finish()
    except BaseException:
        writer.discard()
        raise
    finally:
        os.close(fd)


def _live_high(recipes: Iterable[bytes]) -> npt.NDArray[np.uint64]:
    """The first 8 bytes of every id ``recipes`` need, sorted, distinct."""
    parts = [as_keys(np.frombuffer(r, np.uint8).reshape(-1, ID_BYTES))[0] for r in recipes]
    if not parts:
        return np.zeros(0, np.uint64)
    highs = np.sort(np.concatenate(parts))
    distinct: npt.NDArray[np.uint64] = highs[np.concatenate(([True], highs[1:] != highs[:-1]))]
    return distinct


def _members(values: npt.NDArray[np.uint64],
             sorted_set: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
    """Which of ``values`` are in ``sorted_set`` (sorted, distinct)."""
    if not len(sorted_set):
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    found: npt.NDArray[np.bool_] = sorted_set[at] == values
    return found


def _first_of_each(ids: Ids) -> npt.NDArray[np.bool_]:
    """True at the first place each distinct id of ``ids`` appears."""
    high, low = as_keys(ids)
    order = np.argsort(high, kind="stable")
    same_high = high[order][1:] == high[order][:-1]
    if np.all(low[order][1:][same_high] == low[order][:-1][same_high]):
        # Equal first halves are equal ids (the usual case): the first of each run.
        first = np.ones(len(ids), bool)
        first[order[1:][same_high]] = False
        return first
    _, index = np.unique(voids(ids), return_index=True)
    exact = np.zeros(len(ids), bool)
    exact[index] = True
    return exact


def _ids_of(index: PackIndex) -> Ids:
    """The ids of an index, as 16-byte rows."""
    return np.stack([index.high, index.low], axis=1).view(np.uint8).reshape(-1, ID_BYTES)

