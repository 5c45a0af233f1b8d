"""Page ids: one BLAKE3, keyed, per 4 KiB page, computed here or in worker processes.

A page's id is the first ``ID_BYTES`` of its BLAKE3 keyed with the store's id key
(``layout.ID_CONTEXT``); a page of zeros gets the zero id and is never hashed. One BLAKE3
call per page holds the GIL, so large files are spread over fresh interpreters that map the
file through this process's descriptor (``/proc/PID/fd/N``), never a path in the store.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import blake3
import numpy as np
import numpy.typing as npt

from .layout import ID_BYTES, PAGE, Ids

# Read this much of an image per step: one BLAKE3 update on all cores, then its pages.
STEP = 64 << 20
# Files from this size on get their page ids from worker processes.
PARALLEL_IDS_BYTES = 1 << 30
MIN_CORES_FOR_WORKERS = 4


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
def worker_pool(dfd: int, names: list[str]) -> Iterator[ProcessPoolExecutor | None]:
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
