"""The page store: the ``chunks/`` directory of one snapshot store, as saves, restores,
transfers and the collector use it.

A save's commit cuts its large image files into pages and writes the pages the store lacks
to one new pack (``chunk_files``, recipes beside the files); a restore opens the packs and
the plans of the files it needs (``opened_pages``); a remote transfer reads or adds pages by
their ids; the collector (``collector.py``) frees what no recipe needs. The layout of the
directory is ``layout.py``'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor

import blake3
import numpy as np
import numpy.typing as npt

from ... import safe_fs
from ...errors import SnapshotError
from ...locks import HeldLock, StoreLocks
from .. import digest
from . import collector, id_workers
from .collector import CollectReport
from .fd_io import read_range, size_at
from .follower import FollowedFile
from .layout import (
    CHUNKS_DIR,
    ID_BYTES,
    LOCK_KEY,
    PACK_SUFFIX,
    PAGE,
    Ids,
    PackIndex,
    PackWriter,
    list_packs,
    read_ids,
)
from .plans import Advance, PagePlan, RememberedPlan, write_file
from .recipes import FileRecipe, write_recipe

log = logging.getLogger(__name__)


class PageStore:
    """The ``chunks/`` directory of one snapshot store: its packs of pages, by their ids."""

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
    def index(self, dfd: int, ids_of: Callable[[str], Ids] | None = None) -> PackIndex:
        """Every complete pack's ids, sorted; read with ``ids_of`` when given."""
        packs = list_packs(dfd)
        read = ids_of or functools.partial(read_ids, dfd)
        return PackIndex.build(packs, [read(p) for p in packs])

    # -- saving ----------------------------------------------------------------------------
    def chunk_files(
        self, image_dfd: int, names: list[str], advance: Advance, digest_only: Iterable[str] = (),
        followed: dict[str, FollowedFile] | None = None,
    ) -> tuple[dict[str, FileRecipe], str]:
        """Cut each of ``names`` (open in ``image_dfd``) into pages, write the pages the
        store lacks to one new pack, and write ``<name>.chunks`` beside each file. Returns
        what each file gave and the pack's name (empty when nothing was new).

        ``followed``: the ids and digests of files read while criu wrote them
        (``follower.DumpFollower``); of those, only the steps holding pages the store lacks
        are read.

        The caller holds the chunks lock until the recipes are in the snapshot directory,
        where the collector finds them.
        """
        results: dict[str, FileRecipe] = {}
        with self._dir() as dfd:
            index = self.index(dfd)
            writer = PackWriter(dfd)
            try:
                with (mmap.mmap(-1, id_workers.STEP) as buffer,
                      id_workers.worker_pool(image_dfd, names) as pool):
                    for name in names:
                        results[name] = self._chunk_one(image_dfd, name, index, writer, buffer,
                                                        advance, pool, (followed or {}).get(name))
                writer.finish()
            except BaseException:
                writer.discard()
                raise
            for name, chunked in results.items():
                write_recipe(image_dfd, name, chunked.recipe)
            os.fsync(image_dfd)
        return results, writer.name if writer.pages else ""

    def _chunk_one(
        self, image_dfd: int, name: str, index: PackIndex, writer: PackWriter,
        buffer: mmap.mmap, advance: Advance, pool: ProcessPoolExecutor | None,
        followed: FollowedFile | None = None,
    ) -> FileRecipe:
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
            if pool is not None and size >= id_workers.PARALLEL_IDS_BYTES:
                # The workers reopen the file this fd holds, never a path in the store.
                opened_file = f"/proc/{os.getpid()}/fd/{fd}"
                ahead = [pool.submit(id_workers.ids_of_range, opened_file, start,
                                     min(start + id_workers.STEP, size), self.id_key)
                         for start in range(0, size, id_workers.STEP)]
            offset = 0
            with memoryview(buffer) as view:
                while offset < size:
                    n = os.preadv(fd, [view[: min(id_workers.STEP, size - offset)]], offset)
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
        return FileRecipe(hasher.hexdigest(), bytes(recipe), new_bytes, zero_pages)

    def _chunk_followed(
        self, fd: int, followed: FollowedFile, index: PackIndex, writer: PackWriter,
        buffer: mmap.mmap, advance: Advance,
    ) -> FileRecipe:
        """A file whose ids and digest were made while criu wrote it: each step is looked
        up, and read again only when it holds pages the store lacks."""
        new_bytes = 0
        with memoryview(buffer) as view:
            for start in range(0, followed.size, id_workers.STEP):
                end = min(start + id_workers.STEP, followed.size)
                ids = followed.ids[start // PAGE:end // PAGE]
                zero = followed.zero[start // PAGE:end // PAGE]
                candidates = np.nonzero(~zero)[0]
                if len(candidates) and bool((index.find(ids[candidates]) < 0).any()):
                    with view[:end - start] as block:
                        if os.preadv(fd, [block], start) != end - start:
                            raise OSError("an image shrank while it was read")
                        new_bytes += self._store_new(block, ids, zero, index, writer)
                advance(end - start)
        return FileRecipe(followed.digest, followed.ids.tobytes(), new_bytes,
                           int(followed.zero.sum()))

    def _ids(self, ahead: list[Future[tuple[bytes, bytes]]],
             block: memoryview) -> tuple[Ids, npt.NDArray[np.bool_]]:
        """The block's page ids from the workers, or computed here when there are none or
        they died (a worker's interpreter that could not start, say)."""
        if ahead:
            try:
                return id_workers.decode_ids(ahead.pop(0).result())
            except BrokenExecutor:
                log.warning("the page-id workers stopped; the rest is hashed in one process")
                ahead.clear()
        return id_workers.page_ids(block, self.id_key)

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
                ids_of = functools.cache(functools.partial(read_ids, dfd))
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
        ``streamer.py``). The files are not checked here."""
        with self.opened_pages(recipes, "restore") as plans:
            for name, plan in plans.items():
                write_file(name, plan, out_dfd, advance)

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
                        data = read_range(fd, int(part_slots[start]) * PAGE, length)
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
        """Remove packs no recipe needs, and rewrite those mostly dead (``collector.collect``).
        The caller passes every recipe of the store's committed snapshots and of saves in
        progress, and holds the chunks lock."""
        with self._dir() as dfd:
            return collector.collect(dfd, live_recipes)

    # -- sizes -----------------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """What the packs and their ids take on disk."""
        with self._dir() as dfd:
            return sum(size_at(name, dfd) for name in os.listdir(dfd))

