"""The page ids and digests of a save's large images, computed while criu writes them.

A commit of pages kept by content used to read every image back after the dump, the kernel
running again by then: on a 17.9 GB image the page ids and the whole-file digest took most
of the 14 s between the end of the pause and the snapshot being durable. criu writes each
``pages-*.img`` from its start to its end, once; ``DumpFollower`` reads behind it, a step at
a time, out of the page cache, and hands the ids and digests to the commit
(``PageStore.chunk_files``), which then only looks the ids up and writes the pages the
store lacks.

The ids come from worker processes at a lower priority than criu and the driver, so that the
pause is not made longer; the follower runs only where there are cores to spare for them
(``id_workers.MIN_CORES_FOR_WORKERS``). What it read is checked again where it matters: the
restore compares every file it assembles with the digest the manifest signs, so a file that
changed behind the follower (criu does not do that) is refused, never restored wrong.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import os
import threading
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from dataclasses import dataclass

import blake3
import numpy as np
import numpy.typing as npt

from ... import safe_fs
from . import id_workers
from .layout import ID_BYTES, PAGE, Ids
from .recipes import is_chunkable

log = logging.getLogger(__name__)

# criu's page images: the files large enough to be worth following.
PAGES_PREFIX = "pages-"
# How often the follower looks at what criu has written.
POLL_SECONDS = 0.05
# Niceness of the id workers: criu and the driver's checkpoint copies come first.
WORKER_NICENESS = 10
# criu writes a GPU kernel's pages at about 2 GB/s and a worker makes ids at about 1.4 GB/s,
# so a few keep up. More do not finish sooner: they read the page cache criu is filling at
# the same time. With 14 workers copying their ranges, the 8B shape's pause was 4.7 s longer
# than the same save kept whole; with 4 mapping them, 0.7 s (docs/performance.md).
MAX_WORKERS = 4


@dataclass
class FollowedFile:
    """What ``DumpFollower`` read of one image while criu wrote it: its size, digest and page
    ids, so that the commit need not read it all again."""

    size: int
    digest: str
    ids: Ids
    zero: npt.NDArray[np.bool_]


class _Followed:
    """One image file as far as it has been read: its digest so far and the ids of each
    step, in order (from workers: futures, decoded at the end)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.offset = 0
        self.hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.steps: list[Future[tuple[bytes, bytes]] | tuple[bytes, bytes]] = []


class DumpFollower:
    """Reads the page images criu writes into ``image_dfd`` as they grow; ``finish`` once
    criu has ended well gives each file's ``FollowedFile``, ``cancel`` otherwise.

    A thread of its own does the reading and the digest; the ids are computed by worker
    processes that open the file through this process's fd (never a path in the store).
    """

    def __init__(self, image_dfd: int, id_key: bytes, workers: int) -> None:
        self.dfd = os.dup(image_dfd)
        self.id_key = id_key
        self.files: dict[str, _Followed] = {}
        self.pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=os.nice, initargs=(WORKER_NICENESS,))
        # Started now, before the pause: spawning interpreters is work criu should not share
        # the cores with.
        for _ in range(workers):
            self.pool.submit(os.getpid)
        self.buffer = mmap.mmap(-1, id_workers.STEP)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._follow, name="dump-follower", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, image_dfd: int, id_key: bytes) -> DumpFollower | None:
        """A follower of the images going into ``image_dfd``; None on a machine without the
        cores to spare (the commit then reads the images as before)."""
        cores = len(os.sched_getaffinity(0))
        if cores < id_workers.MIN_CORES_FOR_WORKERS:
            return None
        return cls(image_dfd, id_key, max(1, min(cores - 2, MAX_WORKERS)))

    # -- the thread ------------------------------------------------------------------------
    def _follow(self) -> None:
        try:
            while not self.stop.wait(POLL_SECONDS):
                self._read(final=False)
        except BaseException as exc:  # kept for finish(): the commit reads the images itself
            self.error = exc

    def _read(self, final: bool) -> None:
        """Read every complete step criu has written (with ``final``, the rest too)."""
        for name in sorted(os.listdir(self.dfd)):
            if not name.startswith(PAGES_PREFIX):
                continue
            followed = self.files.get(name)
            if followed is None:
                try:
                    fd, _ = safe_fs.open_regular(name, self.dfd)
                except FileNotFoundError:
                    continue
                followed = self.files[name] = _Followed(fd)
            size = os.fstat(followed.fd).st_size
            while size - followed.offset >= id_workers.STEP or (final and followed.offset < size):
                self._step(followed, min(id_workers.STEP, size - followed.offset))

    def _step(self, followed: _Followed, length: int) -> None:
        if length % PAGE:
            raise OSError("an image ends inside a page")
        with memoryview(self.buffer) as view, view[:length] as block:
            n = os.preadv(followed.fd, [block], followed.offset)
            if n != length:
                raise OSError("an image shrank while it was read")
            followed.hasher.update(block)
        opened = f"/proc/{os.getpid()}/fd/{followed.fd}"
        followed.steps.append(self.pool.submit(
            id_workers.ids_of_range, opened, followed.offset, followed.offset + length,
            self.id_key))
        followed.offset += length

    # -- the end ---------------------------------------------------------------------------
    def finish(self) -> dict[str, FollowedFile]:
        """Once criu has written everything: the rest of each file read, and each file's
        size, digest and page ids. Files whose following failed are left out: the commit
        reads them itself."""
        self.stop.set()
        self.thread.join()
        found: dict[str, FollowedFile] = {}
        try:
            if self.error is None:
                self._read(final=True)
            for name, followed in self.files.items():
                if self.error is not None:
                    break
                ids, zero = [], []
                for step in followed.steps:
                    encoded = step.result() if isinstance(step, Future) else step
                    decoded = id_workers.decode_ids(encoded)
                    ids.append(decoded[0])
                    zero.append(decoded[1])
                if not is_chunkable(followed.offset):
                    continue
                found[name] = FollowedFile(
                    followed.offset, followed.hasher.hexdigest(),
                    np.concatenate(ids) if ids else np.zeros((0, ID_BYTES), np.uint8),
                    np.concatenate(zero) if zero else np.zeros(0, np.bool_))
        except (OSError, BrokenExecutor) as exc:
            self.error = exc
        finally:
            self._close()
        if self.error is not None:
            log.warning("the images were not followed as criu wrote them (%s); the commit "
                        "reads them itself", self.error)
            return {}
        return found

    def cancel(self) -> None:
        """The dump failed or was stopped: nothing is kept."""
        self.stop.set()
        self.thread.join()
        self._close()

    def _close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for followed in self.files.values():
            with contextlib.suppress(OSError):
                os.close(followed.fd)
        self.files.clear()
        with contextlib.suppress(OSError):
            os.close(self.dfd)
        self.buffer.close()
