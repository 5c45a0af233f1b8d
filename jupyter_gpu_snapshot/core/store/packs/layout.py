"""The store's ``chunks/`` directory: packs of pages, their ids, and the index over them.

Two saves of one kernel share most of their memory pages, but seldom at the same offset of
CRIU's pages images: pages move whenever a mapping grows or a new one comes before them. So a
large image file is cut into pages, each page is named by its BLAKE3 digest keyed with a key
derived from the store's signing key (ids of two stores never match, and a copy of the ids
says nothing about which pages two users share), and only the pages the store lacks are
written, appended to a new pack.

FORMAT (this module reads and writes it; ``PageStore`` and the collector use it)

``<store>/chunks/`` (0700) holds, for each pack ``<name>`` (32 lowercase hex digits, random):

- ``<name>.pack``: the pages, ``PAGE`` (4096) bytes each, back to back in the order they
  were added, no header: page ``k`` is at byte ``k * 4096``. Never a page of zeros.
- ``<name>.ids``: the id of each page of the pack, ``ID_BYTES`` (16) bytes each, back to
  back, no header: the id of page ``k`` is at byte ``k * 16``. The number of pages is the
  file's length over 16 (trailing bytes of a partial id are ignored).

A page's id is the first 16 bytes of its keyed BLAKE3 (``id_workers.page_ids``): the key is
``SigningKey.derive(ID_CONTEXT)``, the BLAKE3 key derivation of the store's signing key with
the context ``ID_CONTEXT``. The zero id (16 zero bytes, ``ZERO_ID``) stands for a page of
zeros, which no pack holds.

A pack is written ``O_EXCL``, 0600, and made durable (``fdatasync``; the writer hands each
range to the disk as it appends it, so that little is left for that call); only then are its
ids written to ``.<name>.ids.new``, fsynced and renamed to ``<name>.ids``, and the directory
fsynced. So a ``.pack`` without its ``.ids`` is one whose save never finished, and only a
pack with ids is part of the store (``list_packs``). An id may be in more than one pack (a
rewrite cut off before the old pack went, or a download that added a page a save wrote
meanwhile): any copy serves, and the collector keeps the first in name order. Entries whose
names begin with a dot are leftovers of a writer that died; the collector removes them, and
packs without ids. The directory also holds the remembered plans (``plans.py``, ``<recipe
BLAKE3>.where``).

One lock, ``chunks`` (``LOCK_KEY``, a ``StoreLocks`` lock), keeps the collector away from a
save between its choice of which pages it need not write and the recipe that keeps them
alive, and from a restore while it opens the packs it will read (an open pack stays
readable after the collector removed it).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ... import safe_fs
from .fd_io import copy_range, read_all, start_writeback

PAGE = 4096
ID_BYTES = 16
ZERO_ID = bytes(ID_BYTES)
CHUNKS_DIR = "chunks"
PACK_SUFFIX = ".pack"
IDS_SUFFIX = ".ids"
PACK_NAME = re.compile(r"^[0-9a-f]{32}$")
LOCK_KEY = "chunks"
_SORT_THREADS = min(16, max(1, os.cpu_count() or 1))
_SORT_PART_MIN = 1 << 18
ID_CONTEXT = "jupyter-gpu-snapshot 2026-11 page ids"
# Whether a pack writer has the disk start on each range as it is appended (``PackWriter``);
# off only to measure the difference (benchmarks/bench_writeback.py).
WRITE_BEHIND = True

Ids = npt.NDArray[np.uint8]  # shape (n, 16)


def argsort(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
    """``np.argsort(keys)``, on all cores: parts sorted in threads (numpy sorts without the
    GIL), then merged by one stable sort, which finds the sorted runs and merges them."""
    parts = min(_SORT_THREADS, len(keys) // _SORT_PART_MIN)
    if parts < 2:
        return np.argsort(keys)
    bounds = np.linspace(0, len(keys), parts + 1, dtype=np.int64).tolist()

    def sort_part(part: tuple[int, int]) -> npt.NDArray[np.intp]:
        start, end = part
        return np.argsort(keys[start:end]) + start

    with ThreadPoolExecutor(parts) as pool:
        runs = np.concatenate(list(pool.map(sort_part, itertools.pairwise(bounds))))
    merged: npt.NDArray[np.intp] = runs[np.argsort(keys[runs], kind="stable")]
    return merged


def as_keys(ids: Ids) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Each 16-byte id as two integers, for sorting and searching."""
    words = np.ascontiguousarray(ids).view(np.uint64).reshape(-1, 2)
    return words[:, 0], words[:, 1]


@dataclass
class PackIndex:
    """Where each page of the store lives: every pack's ids, sorted for lookups."""

    packs: list[str] = field(default_factory=list)
    high: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, np.uint64))
    low: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, np.uint64))
    pack_of: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    slot_of: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def build(cls, packs: list[str], ids: list[Ids]) -> PackIndex:
        if not packs:
            return cls()
        every = np.concatenate(ids) if ids else np.zeros((0, ID_BYTES), np.uint8)
        high, low = as_keys(every)
        pack_of = np.concatenate([np.full(len(a), i, np.int32) for i, a in enumerate(ids)])
        slot_of = np.concatenate([np.arange(len(a), dtype=np.int64) for a in ids])
        # Sorted on the first 8 bytes only: find() looks through ids that share them.
        order = argsort(high)
        return cls(packs, high[order], low[order], pack_of[order], slot_of[order])

    def find(self, ids: Ids) -> npt.NDArray[np.int64]:
        """For each id, its position in the sorted index, or -1 where the store lacks it."""
        high, low = as_keys(ids)
        n = len(self.high)
        found = np.full(len(high), -1, np.int64)
        if n == 0 or len(high) == 0:
            return found
        # Looked up in sorted order: each search starts where the last ended, and the index
        # is read front to back (an 18 GB image's ids in a second, not ten).
        order = argsort(high)
        wanted_high, wanted_low = high[order], low[order]
        start = np.searchsorted(self.high, wanted_high, side="left")
        clipped = np.minimum(start, n - 1)
        same_high = (start < n) & (self.high[clipped] == wanted_high)
        exact = same_high & (self.low[clipped] == wanted_low)
        at = np.where(exact, start, -1)
        # Ids that share their first 8 bytes with another: rare, looked through one by one.
        for i in np.nonzero(same_high & ~exact)[0].tolist():
            j = int(start[i])
            while j < n and self.high[j] == wanted_high[i]:
                if self.low[j] == wanted_low[i]:
                    at[i] = j
                    break
                j += 1
        found[order] = at
        return found


@dataclass
class _Appended:
    """The ids a pack writer appended, so that a page seen again later in the same commit
    (in another file, or past the step that wrote it) is not written twice. Sorted runs,
    each at least twice the size of the next: a few runs to look through, each id sorted
    again a few times."""

    runs: list[tuple[Ids, PackIndex]] = field(default_factory=list)

    def lacks(self, ids: Ids) -> npt.NDArray[np.bool_]:
        lacking = np.ones(len(ids), bool)
        for _, index in self.runs:
            lacking &= index.find(ids) < 0
        return lacking

    def add(self, ids: Ids) -> None:
        while self.runs and len(self.runs[-1][0]) <= 2 * len(ids):
            ids = np.concatenate([self.runs.pop()[0], ids])
        # Sorted on the first 8 bytes only: all ``PackIndex.find`` needs, and faster.
        high, low = as_keys(ids)
        order = np.argsort(high)
        none = np.zeros(0, np.int64)
        self.runs.append((ids, PackIndex([], high[order], low[order], none.astype(np.int32),
                                         none)))


@dataclass
class PackWriter:
    """The one pack a commit appends its new pages to."""

    dfd: int
    name: str = field(default_factory=lambda: secrets.token_hex(16))
    fd: int = -1
    ids: bytearray = field(default_factory=bytearray)
    appended: _Appended = field(default_factory=_Appended)

    def lacks(self, ids: Ids) -> npt.NDArray[np.bool_]:
        """Which of ``ids`` this pack does not hold yet."""
        return self.appended.lacks(ids)

    def append(self, pages: memoryview | list[memoryview], new_ids: bytes) -> None:
        """Add pages (one buffer, or several written in their order) and their ids.

        The disk starts on them at once (write-behind): a save whose pages are mostly new
        then writes while it reads and hashes the rest of its images, and ``finish``'s fsync
        waits only for the last of it."""
        self._open()
        start = self.pages * PAGE
        length = 0
        for view in [pages] if isinstance(pages, memoryview) else pages:
            written = 0
            while written < len(view):
                # Released on leaving, error or not: see ``_store_new``.
                with view[written:] as rest:
                    written += os.write(self.fd, rest)
            length += written
        if WRITE_BEHIND:
            start_writeback(self.fd, start, length)
        self.ids += new_ids
        self.appended.add(np.frombuffer(new_ids, np.uint8).reshape(-1, ID_BYTES))

    def copy_from(self, src: int, runs: list[tuple[int, int]], new_ids: bytes) -> None:
        """Add runs of pages (first page, count) of another pack, copied in the kernel."""
        self._open()
        offset = self.pages * PAGE
        for first, count in runs:
            copy_range(src, first * PAGE, self.fd, offset, count * PAGE)
            offset += count * PAGE
        self.ids += new_ids
        self.appended.add(np.frombuffer(new_ids, np.uint8).reshape(-1, ID_BYTES))

    def _open(self) -> None:
        if self.fd < 0:
            self.fd = os.open(self.name + PACK_SUFFIX,
                              os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=self.dfd)

    @property
    def pages(self) -> int:
        return len(self.ids) // ID_BYTES

    def finish(self) -> None:
        """Make the pack durable, then its ids: only then is the pack part of the store."""
        if self.fd < 0:
            return
        # The data and what reading it back needs (size, blocks): a pack is never rewritten.
        os.fdatasync(self.fd)
        os.close(self.fd)
        self.fd = -1
        staged = f".{self.name}{IDS_SUFFIX}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged, dir_fd=self.dfd)
        safe_fs.write_new(staged, self.dfd, bytes(self.ids))
        os.rename(staged, self.name + IDS_SUFFIX, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
        os.fsync(self.dfd)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name + PACK_SUFFIX, dir_fd=self.dfd)


def list_packs(dfd: int) -> list[str]:
    """Complete packs (their ids written) of the ``chunks/`` open at ``dfd``, in name order."""
    names = []
    for entry in os.listdir(dfd):
        stem = entry.removesuffix(IDS_SUFFIX)
        if entry.endswith(IDS_SUFFIX) and PACK_NAME.fullmatch(stem):
            names.append(stem)
    return sorted(names)


def read_ids(dfd: int, pack: str) -> Ids:
    """The ids of ``pack``, one row of ``ID_BYTES`` per page."""
    fd, size = safe_fs.open_regular(pack + IDS_SUFFIX, dfd)
    try:
        raw = read_all(fd, size - size % ID_BYTES)
    finally:
        os.close(fd)
    return np.frombuffer(raw, np.uint8).reshape(-1, ID_BYTES)


VOID = np.dtype((np.void, ID_BYTES))


def voids(ids: Ids) -> npt.NDArray[np.void]:
    return np.ascontiguousarray(ids).view(VOID).ravel()

