"""Plans: where the bytes of a file kept as a recipe are, in the store's packs.

A ``PagePlan`` is what a restore reads through: runs of (pack fd, offset in the pack, offset
in the file, length). A ``RememberedPlan`` is the same by pack name, kept beside the packs,
so that the next restore of the recipe need not sort every id of the store to find its
pages.

FORMAT (``RememberedPlan`` writes and reads it; nothing else does)

``<store>/chunks/<key>.where``, where ``<key>`` is the BLAKE3 (hex) of the recipe's bytes,
the value of its manifest entry's ``"chunks"``:

- the line ``jgs-where 1`` and a newline (12 bytes, the format's magic and version);
- one line of JSON, ``{"packs": [<pack name>, ...], "runs": <n>}``, and a newline: the
  packs the runs name, by their number in this list;
- ``n`` runs of four little-endian signed 64-bit integers (32 bytes each): the pack's number,
  the first page's slot in the pack, the first page's index in the file, the number of
  pages. Runs follow the file's order and do not overlap; pages in no run are zeros.

It is a cache: written ``O_EXCL`` (0600) to ``.<key>.where.<pid>.<thread>``, renamed into
place, never fsynced; a failure to write it is only logged. Nothing in it is trusted: it is
read only when at most 32 bytes a page of the recipe and 1 MiB more, and used only once
every page it names holds, in its pack's ids, the recipe's id for that page, and every
page it leaves out is a zero id (``RememberedPlan.read``). Else the pages are found again
from every pack's ids. The collector removes plans no live recipe has.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ... import safe_fs
from .fd_io import copy_range, pread_exactly, read_all, splice_exactly, write_all, write_zeros
from .layout import ID_BYTES, PACK_NAME, PACK_SUFFIX, PAGE, Ids, PackIndex

log = logging.getLogger(__name__)

# Where a recipe's pages were found last, named by the recipe's BLAKE3: ``RememberedPlan``.
PLAN_SUFFIX = ".where"
_PLAN_MAGIC = b"jgs-where 1\n"
_PLAN_ROW_BYTES = 4 * 8  # a run: pack number, first slot, first page, pages; little-endian
_ASSEMBLY_WORKERS = min(8, max(2, os.cpu_count() or 2))

Advance = Callable[[int], None]


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
            raw = read_all(fd, size) if size <= len(ids) * _PLAN_ROW_BYTES + (1 << 20) else b""
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
                or not all(isinstance(p, str) and PACK_NAME.fullmatch(p) for p in packs)
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


def write_file(name: str, plan: PagePlan, out_dfd: int, advance: Advance) -> None:
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
