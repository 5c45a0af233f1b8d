"""Image files kept by content: each 4 KiB page stored once per store, pages of zeros never.

Two saves of one kernel share most of their memory pages, but seldom at the same offset of
CRIU's pages images: pages move whenever a mapping grows or a new one comes before them. So a
large image file is cut into pages, each page is named by its BLAKE3 digest keyed with a key
derived from the store's signing key (ids of two stores never match, and a copy of the ids
says nothing about which pages two users share), and only the pages the store lacks are
written, appended to a new pack. The file itself becomes a recipe: one id per page, the zero
id for a page of zeros.

Under the store's ``chunks/``:

- ``<pack>.pack``: pages, 4 KiB each, in the order they were added;
- ``<pack>.ids``: their ids, 16 bytes each. Written, fsynced and renamed into place after the
  pack is durable, so a pack without ids is one whose save never finished; the collector
  removes it.

In a snapshot directory, ``<file>.chunks`` is the recipe of ``<file>``. The signed manifest
lists the recipe's digest and the digest of the whole file, so nothing read from ``chunks/``
is trusted: a restore assembles the whole files and checks them against the manifest beside
criu, as it checks files kept whole.

One lock, ``chunks``, keeps the collector away from a save between its choice of which pages
it need not write and the recipe that keeps them alive, and from a restore while it opens the
packs it will read (an open pack stays readable after the collector removed it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import mmap
import multiprocessing
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import blake3
import numpy as np
import numpy.typing as npt

from .. import safe_fs
from ..errors import SnapshotError
from ..locks import HeldLock, StoreLocks
from . import digest

log = logging.getLogger(__name__)

PAGE = 4096
ID_BYTES = 16
ZERO_ID = bytes(ID_BYTES)
CHUNKS_DIR = "chunks"
RECIPE_SUFFIX = ".chunks"
PACK_SUFFIX = ".pack"
IDS_SUFFIX = ".ids"
# Where a recipe's pages were found last, named by the recipe's BLAKE3: ``RememberedPlan``.
PLAN_SUFFIX = ".where"
_PLAN_MAGIC = b"jgs-where 1\n"
_PLAN_ROW_BYTES = 4 * 8  # a run: pack number, first slot, first page, pages; little-endian
# Files smaller than this stay whole: CRIU's small images change at every save anyway.
MIN_CHUNKED_BYTES = 1 << 20
# Read this much of an image per step: one BLAKE3 update on all cores, then its pages.
STEP = 64 << 20
_PACK_NAME = re.compile(r"^[0-9a-f]{32}$")
LOCK_KEY = "chunks"
# Files from this size on get their page ids from worker processes.
PARALLEL_IDS_BYTES = 1 << 30
MIN_CORES_FOR_WORKERS = 4
_ASSEMBLY_WORKERS = min(8, max(2, os.cpu_count() or 2))
_SORT_THREADS = min(16, max(1, os.cpu_count() or 1))
_SORT_PART_MIN = 1 << 18
# A pack whose live pages fall below this share is rewritten by the collector.
REPACK_BELOW = 0.5
ID_CONTEXT = "jupyter-gpu-snapshot 2026-11 page ids"

Ids = npt.NDArray[np.uint8]  # shape (n, 16)
Advance = Callable[[int], None]


def is_chunkable(size: int) -> bool:
    return size >= MIN_CHUNKED_BYTES and size % PAGE == 0


def recipe_name(name: str) -> str:
    return f"{name}{RECIPE_SUFFIX}"


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


def _as_keys(ids: Ids) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
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
        high, low = _as_keys(every)
        pack_of = np.concatenate([np.full(len(a), i, np.int32) for i, a in enumerate(ids)])
        slot_of = np.concatenate([np.arange(len(a), dtype=np.int64) for a in ids])
        # Sorted on the first 8 bytes only: find() looks through ids that share them.
        order = argsort(high)
        return cls(packs, high[order], low[order], pack_of[order], slot_of[order])

    def find(self, ids: Ids) -> npt.NDArray[np.int64]:
        """For each id, its position in the sorted index, or -1 where the store lacks it."""
        high, low = _as_keys(ids)
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
class ChunkedFile:
    """What chunking one image file gave: its digest, recipe, and the bytes written."""

    digest: str
    recipe: bytes
    new_bytes: int
    zero_pages: int


@dataclass
class FollowedFile:
    """What ``dump_follower.DumpFollower`` read of one image while criu wrote it: its size,
    digest and page ids, so that the commit need not read it all again."""

    size: int
    digest: str
    ids: Ids
    zero: npt.NDArray[np.bool_]


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
        high, low = _as_keys(ids)
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
        """Add pages (one buffer, or several written in their order) and their ids."""
        self._open()
        for view in [pages] if isinstance(pages, memoryview) else pages:
            written = 0
            while written < len(view):
                # Released on leaving, error or not: see ``_store_new``.
                with view[written:] as rest:
                    written += os.write(self.fd, rest)
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
        os.fsync(self.fd)
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


@dataclass
class RememberedPlan:
    """Where the pages of one recipe are, by pack name: runs of (pack number, first slot,
    first page of the file, pages), in the file's order; pages in no run are zeros.

    Finding each page of a recipe sorts every id of the store (a second or more for an 8B
    model), so a restore remembers what it found in ``<recipe BLAKE3>.where`` beside the
    packs, and a save finds it for its restores ahead. Nothing in it is trusted: it is used
    only once each page it names holds the recipe's id at that place (the recipe itself
    was checked against the signed manifest), and every byte read through it is still
    compared with the manifest's digest before any code of it runs. A plan that no longer
    holds (a pack collected or rewritten since) or does not parse is found again."""

    packs: list[str]
    runs: npt.NDArray[np.int64]  # shape (n, 4)

    @classmethod
    def of(cls, where: npt.NDArray[np.int64], zero: npt.NDArray[np.bool_],
           index: PackIndex) -> RememberedPlan:
        """The plan of a file whose pages are at ``where`` in ``index`` (``zero``: pages of
        zeros)."""
        real = np.nonzero(~zero)[0]
        packs = index.pack_of[where[real]]
        slots = index.slot_of[where[real]]
        # Runs of pages that follow each other both in the file and in one pack: one read.
        breaks = np.nonzero((np.diff(real) != 1) | (np.diff(packs) != 0)
                            | (np.diff(slots) != 1))[0] + 1
        starts = np.concatenate(([0], breaks)).astype(np.int64) if len(real) else breaks
        lengths = np.diff(np.concatenate((starts, [len(real)])))
        used, numbers = np.unique(packs[starts], return_inverse=True)
        runs = np.stack([numbers.reshape(-1), slots[starts], real[starts], lengths], axis=1)
        return cls([index.packs[int(p)] for p in used],
                   runs.astype(np.int64).reshape(-1, 4))

    def plan(self, dfd: int, opened: dict[str, int], pages: int) -> PagePlan:
        """The ``PagePlan`` of the file of ``pages`` pages, its packs opened (and kept in
        ``opened``, by name)."""
        for pack in self.packs:
            if pack not in opened:
                opened[pack] = safe_fs.open_regular(pack + PACK_SUFFIX, dfd)[0]
        fds = np.asarray([opened[pack] for pack in self.packs], np.int64)
        runs = self.runs
        plan_runs = np.stack([fds[runs[:, 0]] if len(runs) else runs[:, 0], runs[:, 1] * PAGE,
                              runs[:, 2] * PAGE, runs[:, 3] * PAGE], axis=1)
        return PagePlan(pages * PAGE, plan_runs.astype(np.int64).reshape(-1, 4))

    def write(self, dfd: int, key: str) -> None:
        """Kept for the next restore of the recipe whose BLAKE3 is ``key``; a cache, so
        neither durable nor needed: a failure to write it only costs the next restore."""
        head = json.dumps({"packs": self.packs, "runs": len(self.runs)}).encode() + b"\n"
        staged = f".{key}{PLAN_SUFFIX}.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                write_all(fd, _PLAN_MAGIC + head + self.runs.astype("<i8").tobytes())
            finally:
                os.close(fd)
            os.rename(staged, key + PLAN_SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            log.warning("could not keep where the pages of a recipe are: %s", exc)
            with contextlib.suppress(OSError):
                os.unlink(staged, dir_fd=dfd)

    @classmethod
    def read(cls, dfd: int, key: str, ids: Ids,
             ids_of: Callable[[str], Ids]) -> RememberedPlan | None:
        """The plan kept for the recipe ``ids`` (whose BLAKE3 is ``key``), once it holds:
        each page it names has the recipe's id in its pack's ids (``ids_of(pack)``), each
        page it leaves out is zeros. None when there is none, or it does not hold."""
        try:
            fd, size = safe_fs.open_regular(key + PLAN_SUFFIX, dfd)
        except OSError:
            return None
        try:
            raw = _read_all(fd, size) if size <= len(ids) * _PLAN_ROW_BYTES + (1 << 20) else b""
        finally:
            os.close(fd)
        remembered = cls._parsed(raw)
        try:
            if remembered is not None and remembered._holds(ids, ids_of):
                return remembered
        except (OSError, ValueError):
            pass  # a pack gone since, or ids cut short: found again
        return None

    @classmethod
    def _parsed(cls, raw: bytes) -> RememberedPlan | None:
        if not raw.startswith(_PLAN_MAGIC):
            return None
        head, newline, body = raw[len(_PLAN_MAGIC):].partition(b"\n")
        try:
            meta = json.loads(head) if newline else None
        except ValueError:
            return None
        if not isinstance(meta, dict):
            return None
        packs, count = meta.get("packs"), meta.get("runs")
        if (not isinstance(packs, list) or not isinstance(count, int)
                or not all(isinstance(p, str) and _PACK_NAME.fullmatch(p) for p in packs)
                or len(body) != count * _PLAN_ROW_BYTES):
            return None
        runs = np.frombuffer(body, "<i8").astype(np.int64).reshape(-1, 4)
        return cls(list(packs), runs)

    def _holds(self, ids: Ids, ids_of: Callable[[str], Ids]) -> bool:
        runs, pages = self.runs, len(ids)
        if len(runs):
            ends = runs[:, 2] + runs[:, 3]
            if ((runs < 0).any() or (runs[:, 3] == 0).any()
                    or int(runs[:, 0].max()) >= len(self.packs)
                    or (runs[1:, 2] < ends[:-1]).any() or int(ends[-1]) > pages):
                return False
        pack_ids = [ids_of(pack) for pack in self.packs]
        sizes = np.asarray([len(a) for a in pack_ids], np.int64)
        if len(runs) and (runs[:, 1] + runs[:, 3] > sizes[runs[:, 0]]).any():
            return False
        # Every page each run names, and where it is among all the packs' ids.
        counts = runs[:, 3]
        first = np.cumsum(counts) - counts
        step = np.arange(int(counts.sum()), dtype=np.int64)
        page = np.repeat(runs[:, 2] - first, counts) + step
        base = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        slot = np.repeat(base[runs[:, 0]] + runs[:, 1] - first, counts) + step
        every = np.concatenate(pack_ids) if pack_ids else np.zeros((0, ID_BYTES), np.uint8)
        if not np.array_equal(every[slot], ids[page]):
            return False
        covered = np.zeros(pages, bool)
        covered[page] = True
        return not bool(ids[~covered].any())


@dataclass
class PagePlan:
    """Where the bytes of one chunked file are: runs of (pack fd, offset in the pack,
    offset in the file, length), in the file's order. Bytes in no run are zeros."""

    size: int
    runs: npt.NDArray[np.int64]  # shape (n, 4)

    def _parts(self, offset: int, end: int) -> list[tuple[int, int, int, int]]:
        """The runs between ``offset`` and ``end`` of the file, cut to them: (pack fd, offset
        in the pack, offset from ``offset``, length)."""
        starts, lengths = self.runs[:, 2], self.runs[:, 3]
        first = int(np.searchsorted(starts + lengths, offset, side="right"))
        last = int(np.searchsorted(starts, end, side="left"))
        parts = []
        for fd, src, dst, length in self.runs[first:last].tolist():
            lo, hi = max(dst, offset), min(dst + length, end)
            parts.append((fd, src + lo - dst, lo - offset, hi - lo))
        return parts

    def splice_into(self, pipe: int, offset: int, length: int) -> None:
        """Move ``length`` bytes of the file from ``offset`` on into ``pipe`` (criu's),
        from the packs' page cache without copying them, zeros written where no run is."""
        at = 0
        for fd, src, start, size in self._parts(offset, offset + length):
            if start > at:
                write_zeros(pipe, start - at)
            splice_exactly(fd, pipe, src, size, "a pack is shorter than its ids say")
            at = start + size
        if at < length:
            write_zeros(pipe, length - at)

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` on, zeros included."""
        parts = self._parts(offset, offset + len(view))
        if sum(p[3] for p in parts) < len(view):
            np.frombuffer(view, np.uint8).fill(0)
        for fd, src, at, length in parts:
            with view[at:at + length] as part:
                pread_exactly(fd, part, src, "a pack is shorter than its ids say")


class ChunkStore:
    """The ``chunks/`` directory of one snapshot store."""

    def __init__(self, root_fd: int, locks: StoreLocks, id_key: bytes) -> None:
        self.root_fd = root_fd
        self.locks = locks
        self.id_key = id_key

    @contextlib.contextmanager
    def _dir(self) -> Iterator[int]:
        with contextlib.suppress(FileExistsError):
            os.mkdir(CHUNKS_DIR, 0o700, dir_fd=self.root_fd)
        with safe_fs.opened_dir(CHUNKS_DIR, self.root_fd) as dfd:
            yield dfd

    def hold(self, step: str, timeout: float = 600.0) -> HeldLock:
        """The chunks lock, waited for (the collector holds it for seconds at most)."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.locks.try_acquire(LOCK_KEY, step)
            if held is not None:
                return held
            if time.monotonic() > deadline:
                return self.locks.acquire(LOCK_KEY, "the store's page packs", step)
            time.sleep(0.05)

    # -- reading the index -----------------------------------------------------------------
    def _packs(self, dfd: int) -> list[str]:
        """Complete packs (their ids written), in name order."""
        names = []
        for entry in os.listdir(dfd):
            stem = entry.removesuffix(IDS_SUFFIX)
            if entry.endswith(IDS_SUFFIX) and _PACK_NAME.fullmatch(stem):
                names.append(stem)
        return sorted(names)

    def _read_ids(self, dfd: int, pack: str) -> Ids:
        fd, size = safe_fs.open_regular(pack + IDS_SUFFIX, dfd)
        try:
            raw = _read_all(fd, size - size % ID_BYTES)
        finally:
            os.close(fd)
        return np.frombuffer(raw, np.uint8).reshape(-1, ID_BYTES)

    def index(self, dfd: int, ids_of: Callable[[str], Ids] | None = None) -> PackIndex:
        """Every complete pack's ids, sorted; read with ``ids_of`` when given."""
        packs = self._packs(dfd)
        read = ids_of or functools.partial(self._read_ids, dfd)
        return PackIndex.build(packs, [read(p) for p in packs])

    # -- saving ----------------------------------------------------------------------------
    def chunk_files(
        self, image_dfd: int, names: list[str], advance: Advance, digest_only: Iterable[str] = (),
        followed: dict[str, FollowedFile] | None = None,
    ) -> tuple[dict[str, ChunkedFile], str]:
        """Cut each of ``names`` (open in ``image_dfd``) into pages, write the pages the
        store lacks to one new pack, and write ``<name>.chunks`` beside each file. Returns
        what each file gave and the pack's name (empty when nothing was new).

        ``followed``: the ids and digests of files read while criu wrote them
        (``dump_follower``); of those, only the steps holding pages the store lacks are read.

        The caller holds the chunks lock until the recipes are in the snapshot directory,
        where the collector finds them.
        """
        results: dict[str, ChunkedFile] = {}
        with self._dir() as dfd:
            index = self.index(dfd)
            writer = PackWriter(dfd)
            try:
                with mmap.mmap(-1, STEP) as buffer, _id_workers(image_dfd, names) as pool:
                    for name in names:
                        results[name] = self._chunk_one(image_dfd, name, index, writer, buffer,
                                                        advance, pool, (followed or {}).get(name))
                writer.finish()
            except BaseException:
                writer.discard()
                raise
            for name, chunked in results.items():
                staged = f".{recipe_name(name)}.new"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged, dir_fd=image_dfd)
                safe_fs.write_new(staged, image_dfd, chunked.recipe)
                os.rename(staged, recipe_name(name), src_dir_fd=image_dfd, dst_dir_fd=image_dfd)
            os.fsync(image_dfd)
        return results, writer.name if writer.pages else ""

    def _chunk_one(
        self, image_dfd: int, name: str, index: PackIndex, writer: PackWriter,
        buffer: mmap.mmap, advance: Advance, pool: ProcessPoolExecutor | None,
        followed: FollowedFile | None = None,
    ) -> ChunkedFile:
        fd, size = safe_fs.open_regular(name, image_dfd)
        if followed is not None and followed.size == size:
            try:
                return self._chunk_followed(fd, followed, index, writer, buffer, advance)
            finally:
                os.close(fd)
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        recipe = bytearray()
        new_bytes = zero_pages = 0
        ahead: list[Future[tuple[bytes, bytes]]] = []
        try:
            if pool is not None and size >= PARALLEL_IDS_BYTES:
                # The workers reopen the file this fd holds, never a path in the store.
                opened_file = f"/proc/{os.getpid()}/fd/{fd}"
                ahead = [pool.submit(ids_of_range, opened_file, start,
                                     min(start + STEP, size), self.id_key)
                         for start in range(0, size, STEP)]
            offset = 0
            with memoryview(buffer) as view:
                while offset < size:
                    n = os.preadv(fd, [view[: min(STEP, size - offset)]], offset)
                    if n <= 0 or n % PAGE:
                        raise OSError(f"{name} shrank while it was read")
                    with view[:n] as block:
                        hasher.update(block)
                        ids, zero = self._ids(ahead, block)
                        zero_pages += int(zero.sum())
                        new_bytes += self._store_new(block, ids, zero, index, writer)
                        recipe += ids.tobytes()
                    offset += n
                    advance(n)
        finally:
            for pending in ahead:
                pending.cancel()
            os.close(fd)
        return ChunkedFile(hasher.hexdigest(), bytes(recipe), new_bytes, zero_pages)

    def _chunk_followed(
        self, fd: int, followed: FollowedFile, index: PackIndex, writer: PackWriter,
        buffer: mmap.mmap, advance: Advance,
    ) -> ChunkedFile:
        """A file whose ids and digest were made while criu wrote it: each step is looked
        up, and read again only when it holds pages the store lacks."""
        new_bytes = 0
        with memoryview(buffer) as view:
            for start in range(0, followed.size, STEP):
                end = min(start + STEP, followed.size)
                ids = followed.ids[start // PAGE:end // PAGE]
                zero = followed.zero[start // PAGE:end // PAGE]
                candidates = np.nonzero(~zero)[0]
                if len(candidates) and bool((index.find(ids[candidates]) < 0).any()):
                    with view[:end - start] as block:
                        if os.preadv(fd, [block], start) != end - start:
                            raise OSError("an image shrank while it was read")
                        new_bytes += self._store_new(block, ids, zero, index, writer)
                advance(end - start)
        return ChunkedFile(followed.digest, followed.ids.tobytes(), new_bytes,
                           int(followed.zero.sum()))

    def _ids(self, ahead: list[Future[tuple[bytes, bytes]]],
             block: memoryview) -> tuple[Ids, npt.NDArray[np.bool_]]:
        """The block's page ids from the workers, or computed here when there are none or
        they died (a worker's interpreter that could not start, say)."""
        if ahead:
            try:
                return decode_ids(ahead.pop(0).result())
            except BrokenExecutor:
                log.warning("the page-id workers stopped; the rest is hashed in one process")
                ahead.clear()
        return page_ids(block, self.id_key)

    @staticmethod
    def _store_new(block: memoryview, ids: Ids, zero: npt.NDArray[np.bool_],
                   index: PackIndex, writer: PackWriter) -> int:
        """Append the pages of ``block`` that neither the store nor the pack holds yet
        (each once) to the pack."""
        candidates = np.nonzero(~zero)[0]
        if not len(candidates):
            return 0
        missing = candidates[index.find(ids[candidates]) < 0]
        if not len(missing):
            return 0
        _, first = np.unique(ids[missing].view(np.dtype((np.void, ID_BYTES))).ravel(),
                             return_index=True)
        fresh = np.sort(missing[first])
        fresh = fresh[writer.lacks(ids[fresh])]
        if not len(fresh):
            return 0
        # Straight from the block, a slice per run of pages that follow each other: a save
        # whose pages are mostly new writes its blocks without copying them.
        starts = np.concatenate(([0], np.nonzero(np.diff(fresh) != 1)[0] + 1))
        ends = np.concatenate((starts[1:], [len(fresh)]))
        runs = [block[int(fresh[a]) * PAGE:(int(fresh[b - 1]) + 1) * PAGE]
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        try:
            writer.append(runs, ids[fresh].tobytes())
        finally:
            # Released now, not when the garbage collector gets to them: an error's
            # traceback keeps this frame, and a slice alive keeps the page buffer (an mmap)
            # from closing. Its BufferError would then replace the error itself, such as
            # the full disk that stopped the write.
            for run in runs:
                run.release()
        return len(fresh) * PAGE

    # -- restoring -------------------------------------------------------------------------
    @contextlib.contextmanager
    def opened_pages(self, recipes: dict[str, bytes], step: str) -> Iterator[dict[str, PagePlan]]:
        """Where the bytes of each file of ``recipes`` (name → recipe) are: the packs it
        needs, opened under the chunks lock (an open pack stays readable after the collector
        removed it), and its runs of pages. Closed on leaving.

        Nothing read through a plan is checked here: the caller compares each file with its
        manifest digest before any of its code runs. A page the store lacks is an error.
        """
        opened: dict[str, int] = {}  # pack name → fd
        try:
            with self._dir() as dfd, self.hold(step):
                index: PackIndex | None = None
                # Each pack's ids read once, however many recipes' plans or the index need.
                ids_of = functools.cache(functools.partial(self._read_ids, dfd))
                plans = {}
                for name, recipe in recipes.items():
                    ids = np.frombuffer(recipe, np.uint8).reshape(-1, ID_BYTES)
                    key = digest.blake3_hex(recipe)
                    remembered = RememberedPlan.read(dfd, key, ids, ids_of)
                    if remembered is not None:
                        plans[name] = remembered.plan(dfd, opened, len(ids))
                        continue
                    # Found by sorting every id of the store: a second or more for an 8B
                    # model's 4 million pages, remembered for the next restore.
                    if index is None:
                        index = self.index(dfd, ids_of)
                    where = index.find(ids)
                    zero: npt.NDArray[np.bool_] = np.logical_not(ids.any(axis=1))
                    lacking = np.nonzero((where < 0) & ~zero)[0]
                    if len(lacking):
                        raise SnapshotError(
                            step,
                            f"page {int(lacking[0])} of {name} is in no pack of the store",
                            hint="the snapshot is damaged; delete it",
                        )
                    found = RememberedPlan.of(where, zero, index)
                    plans[name] = found.plan(dfd, opened, len(ids))
                    found.write(dfd, key)
            yield plans
        finally:
            for fd in opened.values():
                os.close(fd)

    def assemble(self, recipes: dict[str, bytes], out_dfd: int, advance: Advance) -> None:
        """Write each file of ``recipes`` (name → recipe) into ``out_dfd`` from the packs,
        for a check of the whole snapshot or an upload (a restore streams them instead:
        ``core/image_server.py``). The files are not checked here."""
        with self.opened_pages(recipes, "restore") as plans:
            for name, plan in plans.items():
                _write_file(name, plan, out_dfd, advance)

    # -- moving pages between stores --------------------------------------------------------
    def lacking(self, ids: Ids) -> npt.NDArray[np.bool_]:
        """Which of ``ids`` no pack of the store holds (the zero id never counts as lacking).
        Called by a remote download, whose recipes are in its partial directory first, so
        that the pages found here stay alive."""
        with self._dir() as dfd, self.hold("download"):
            found = self.index(dfd).find(ids)
        lacking: npt.NDArray[np.bool_] = (found < 0) & ids.any(axis=1)
        return lacking

    @contextlib.contextmanager
    def reading(self, ids: Ids) -> Iterator[Callable[[int, int], bytes]]:
        """``read(first, count)``: the pages ``ids[first:first + count]`` from the store's
        packs, for an upload. The packs are opened under the chunks lock (an open pack
        stays readable after the collector removed it); the caller's snapshot keeps the
        pages alive. A page the store lacks is an error."""
        with self._dir() as dfd:
            with self.hold("upload"):
                index = self.index(dfd)
                where = index.find(ids)
                if (where < 0).any():
                    raise SnapshotError(
                        "upload", f"page {int(np.argmax(where < 0))} of the upload is in no "
                        "pack of the store", hint="the snapshot is damaged; delete it")
                opened = {int(p): safe_fs.open_regular(index.packs[int(p)] + PACK_SUFFIX, dfd)[0]
                          for p in np.unique(index.pack_of[where])}
            try:
                packs, slots = index.pack_of[where], index.slot_of[where]

                def read(first: int, count: int) -> bytes:
                    part_packs = packs[first:first + count]
                    part_slots = slots[first:first + count]
                    breaks = np.nonzero((np.diff(part_packs) != 0)
                                        | (np.diff(part_slots) != 1))[0] + 1
                    starts = np.concatenate(([0], breaks)).tolist()
                    ends = [*breaks.tolist(), len(part_packs)]
                    out = []
                    for start, end in zip(starts, ends, strict=True):
                        fd = opened[int(part_packs[start])]
                        length = (end - start) * PAGE
                        data = _read_range(fd, int(part_slots[start]) * PAGE, length)
                        if len(data) != length:
                            raise OSError("a pack is shorter than its ids say")
                        out.append(data)
                    return b"".join(out)

                yield read
            finally:
                for fd in opened.values():
                    os.close(fd)

    def adopt_pack(self, src_dfd: int, src_name: str, ids: bytes) -> str:
        """Make the file ``src_name`` of ``src_dfd`` (pages, in the order of ``ids``; on the
        store's filesystem) a pack of the store: fsynced, renamed into ``chunks/``, then its
        ids written. Called with the chunks lock held by a remote download, once its recipes
        are in its partial directory. Returns the pack's name."""
        fd, size = safe_fs.open_regular(src_name, src_dfd)
        try:
            if size != len(ids) // ID_BYTES * PAGE:
                raise OSError(f"{src_name} does not hold the pages its ids name")
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._dir() as dfd:
            writer = PackWriter(dfd)
            os.rename(src_name, writer.name + PACK_SUFFIX, src_dir_fd=src_dfd, dst_dir_fd=dfd)
            writer.fd = os.open(writer.name + PACK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=dfd)
            writer.ids += ids
            writer.finish()
        return writer.name

    # -- collecting ------------------------------------------------------------------------
    def collect(self, live_recipes: Iterable[bytes]) -> CollectReport:
        """Remove packs no recipe needs, and rewrite those mostly dead. The caller passes
        every recipe of the store's committed snapshots and of saves in progress, and holds
        the chunks lock. Each step leaves the store whole if the process dies after it: a
        rewritten pack is durable before the old one goes, and a pack stops being one when
        its ids go, before its pages do."""
        report = CollectReport()
        live_recipes = list(live_recipes)
        remembered = {digest.blake3_hex(recipe) for recipe in live_recipes}
        with self._dir() as dfd:
            for leftover in os.listdir(dfd):
                stem = leftover.removesuffix(PACK_SUFFIX)
                if leftover.startswith(".") or (
                    leftover.endswith(PACK_SUFFIX) and _PACK_NAME.fullmatch(stem)
                    and safe_fs.entry_kind(stem + IDS_SUFFIX, dfd) == "missing"
                ) or (
                    # Where the pages of a recipe no snapshot holds any more were.
                    leftover.endswith(PLAN_SUFFIX)
                    and leftover.removesuffix(PLAN_SUFFIX) not in remembered
                ):
                    report.freed_bytes += _size_at(leftover, dfd)
                    safe_fs.remove_at(leftover, dfd)
            # Liveness by the first 8 bytes of each id: an id of a dead page that shares
            # them with a live one keeps its page (harmless, and as likely as a collision
            # of 64-bit digests); a page is never dropped for it.
            live_high = _live_high(live_recipes)
            held = PackIndex()  # ids kept so far: a second copy of a page is dead
            for pack in self._packs(dfd):
                ids = self._read_ids(dfd, pack)
                high, _ = _as_keys(ids)
                wanted = _first_of_each(ids) & _members(high, live_high)
                wanted &= held.find(ids) < 0
                keep = np.nonzero(wanted)[0]
                held = PackIndex.build([""], [np.concatenate([_ids_of(held), ids[keep]])])
                if len(keep) == len(ids) or (len(keep) and len(keep) >= REPACK_BELOW * len(ids)):
                    continue
                size = _size_at(pack + PACK_SUFFIX, dfd)
                if len(keep):
                    self._rewrite(dfd, pack, ids, keep)
                    report.rewritten += 1
                os.unlink(pack + IDS_SUFFIX, dir_fd=dfd)  # first: from now on it is no pack
                os.unlink(pack + PACK_SUFFIX, dir_fd=dfd)
                report.freed_bytes += size + (len(ids) - len(keep)) * ID_BYTES - len(keep) * PAGE
                report.removed += 1
            os.fsync(dfd)
        return report

    @staticmethod
    def _rewrite(dfd: int, pack: str, ids: Ids, keep: npt.NDArray[np.intp]) -> None:
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

    # -- sizes -----------------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """What the packs and their ids take on disk."""
        with self._dir() as dfd:
            return sum(_size_at(name, dfd) for name in os.listdir(dfd))


def page_ids(block: memoryview | bytes, key: bytes) -> tuple[Ids, npt.NDArray[np.bool_]]:
    """The id of each page of ``block`` (the zero id for a page of zeros), and which pages
    are zeros."""
    pages = len(block) // PAGE
    words = np.frombuffer(block, np.uint64).reshape(pages, PAGE // 8)
    zero: npt.NDArray[np.bool_] = np.logical_not(words.any(axis=1))
    ids = np.zeros((pages, ID_BYTES), np.uint8)
    real = np.nonzero(~zero)[0]
    view = memoryview(block)
    # One BLAKE3 call per page, about 1.4 GB/s on one core; it holds the GIL, so large files
    # are spread over processes (ids_of_range).
    digests = b"".join([
        blake3.blake3(view[i * PAGE:(i + 1) * PAGE], key=key).digest(ID_BYTES)
        for i in real.tolist()
    ])
    ids[real] = np.frombuffer(digests, np.uint8).reshape(-1, ID_BYTES)
    return ids, zero


def ids_of_range(opened_file: str, start: int, end: int, key: bytes) -> tuple[bytes, bytes]:
    """In a worker process: ``page_ids`` of bytes ``start`` to ``end`` of a file the saving
    process holds open (``/proc/PID/fd/N``), encoded for the trip back.

    The range is mapped, not read: a read would fill fresh memory with a copy of each page
    first, twice the memory traffic, while criu may still be writing the rest of the file
    (the dump follower). A file cut short under the mapping ends this worker with SIGBUS,
    which its pool reports as broken: the commit then reads the images itself."""
    fd = os.open(opened_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < end:
            raise OSError("the file shrank while it was read")
        if end == start:
            return b"", b""
        with mmap.mmap(fd, end - start, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ,
                       offset=start) as mapped, memoryview(mapped) as view:
            ids, zero = page_ids(view, key)
    finally:
        os.close(fd)
    return ids.tobytes(), zero.tobytes()


def decode_ids(encoded: tuple[bytes, bytes]) -> tuple[Ids, npt.NDArray[np.bool_]]:
    ids = np.frombuffer(encoded[0], np.uint8).reshape(-1, ID_BYTES)
    return ids, np.frombuffer(encoded[1], np.bool_)


@contextlib.contextmanager
def _id_workers(dfd: int, names: list[str]) -> Iterator[ProcessPoolExecutor | None]:
    """Worker processes for the page ids when a file is large enough to pay for starting
    them (fresh interpreters: forking a server with threads is unsafe) and cores are free."""
    cores = len(os.sched_getaffinity(0))
    large = any(os.stat(n, dir_fd=dfd, follow_symlinks=False).st_size >= PARALLEL_IDS_BYTES
                for n in names)
    if cores < MIN_CORES_FOR_WORKERS or not large:
        yield None
        return
    pool = ProcessPoolExecutor(min(cores - 1, 16), mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class CollectReport:
    removed: int = 0
    rewritten: int = 0
    freed_bytes: int = 0


_VOID = np.dtype((np.void, ID_BYTES))


def _voids(ids: Ids) -> npt.NDArray[np.void]:
    return np.ascontiguousarray(ids).view(_VOID).ravel()


def recipe_voids(recipe: bytes) -> npt.NDArray[np.void]:
    """The distinct ids of the pages a recipe needs, sorted, without the zero id."""
    unique = np.unique(_voids(np.frombuffer(recipe, np.uint8).reshape(-1, ID_BYTES)))
    needed: npt.NDArray[np.void] = unique[unique != np.frombuffer(ZERO_ID, _VOID)[0]]
    return needed


def _live_high(recipes: Iterable[bytes]) -> npt.NDArray[np.uint64]:
    """The first 8 bytes of every id ``recipes`` need, sorted, distinct."""
    parts = [_as_keys(np.frombuffer(r, np.uint8).reshape(-1, ID_BYTES))[0] for r in recipes]
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
    high, low = _as_keys(ids)
    order = np.argsort(high, kind="stable")
    same_high = high[order][1:] == high[order][:-1]
    if np.all(low[order][1:][same_high] == low[order][:-1][same_high]):
        # Equal first halves are equal ids (the usual case): the first of each run.
        first = np.ones(len(ids), bool)
        first[order[1:][same_high]] = False
        return first
    _, index = np.unique(_voids(ids), return_index=True)
    exact = np.zeros(len(ids), bool)
    exact[index] = True
    return exact


def _ids_of(index: PackIndex) -> Ids:
    """The ids of an index, as 16-byte rows."""
    return np.stack([index.high, index.low], axis=1).view(np.uint8).reshape(-1, ID_BYTES)


def ids_in_order(recipes: Iterable[bytes]) -> Ids:
    """The distinct ids ``recipes`` need, without the zero id, in the order they first
    appear: pages that follow each other in a file stay together in a pack made from
    them, so assembling the file later copies long runs."""
    every = np.concatenate([np.frombuffer(r, np.uint8) for r in recipes] or
                           [np.zeros(0, np.uint8)]).reshape(-1, ID_BYTES)
    _, first = np.unique(_voids(every), return_index=True)
    first.sort()
    ordered: Ids = every[first]
    return ordered[ordered.any(axis=1)]


def _write_file(name: str, plan: PagePlan, out_dfd: int, advance: Advance) -> None:
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=out_dfd)
    try:
        os.ftruncate(out, plan.size)  # pages of zeros stay holes

        def copy_runs(part: npt.NDArray[np.int64]) -> None:
            for fd, src, dst, length in part.tolist():
                copy_range(fd, src, out, dst, length)
                advance(length)

        # Copies run in the kernel, without the GIL: several at once keep a fast disk's
        # queue full when the pages are read back from it.
        with ThreadPoolExecutor(_ASSEMBLY_WORKERS) as pool:
            list(pool.map(copy_runs, np.array_split(plan.runs, _ASSEMBLY_WORKERS * 4)))
        advance(plan.size - int(plan.runs[:, 3].sum()))
    finally:
        os.close(out)


_ZEROS = bytes(1 << 20)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    with view:
        done = 0
        while done < len(view):
            with view[done:] as rest:
                done += os.write(fd, rest)


def write_zeros(fd: int, length: int) -> None:
    while length:
        with memoryview(_ZEROS)[: min(length, len(_ZEROS))] as zeros:
            length -= os.write(fd, zeros)


def splice_exactly(fd: int, pipe: int, offset: int, length: int, short: str) -> None:
    """Move ``length`` bytes of ``fd`` from ``offset`` on into ``pipe``, in the kernel."""
    while length:
        n = os.splice(fd, pipe, min(length, 1 << 30), offset_src=offset)
        if n <= 0:
            raise OSError(short)
        offset += n
        length -= n


def pread_exactly(fd: int, view: memoryview, offset: int, short: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; ``short`` is the error when it ends first."""
    done = 0
    while done < len(view):
        with view[done:] as rest:
            n = os.preadv(fd, [rest], offset + done)
        if n <= 0:
            raise OSError(short)
        done += n


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int) -> None:
    """In the kernel (a reflink where the filesystem shares blocks), else through memory."""
    while length:
        try:
            n = os.copy_file_range(src, dst, length, src_offset, dst_offset)
        except OSError:
            data = os.pread(src, min(length, 8 << 20), src_offset)
            n = os.pwrite(dst, data, dst_offset) if data else 0
        if n <= 0:
            raise OSError("a pack is shorter than its ids say")
        src_offset += n
        dst_offset += n
        length -= n


def _read_range(fd: int, offset: int, length: int) -> bytes:
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        length -= len(data)
    return b"".join(parts)


def _read_all(fd: int, size: int) -> bytes:
    parts = []
    offset = 0
    while offset < size:
        data = os.pread(fd, min(size - offset, 64 << 20), offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
    return b"".join(parts)


def _size_at(name: str, dfd: int) -> int:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0

