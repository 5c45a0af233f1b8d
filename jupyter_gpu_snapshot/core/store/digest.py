"""Digests of snapshot files, computed on every core at once.

BLAKE3 hashes one file on all cores by itself; without it, sha256 runs over 64 MiB chunks in
a thread pool (hashlib releases the GIL) and the file's digest is the sha256 of the chunks'
digests. The manifest names the algorithm, so either can check what the other wrote.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import SnapshotError

_blake3: Any
try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover - blake3 is a dependency; sha256 is the fallback
    _blake3 = None

BLAKE3 = "blake3"
SHA256_TREE = "sha256-tree-64MiB"
ALGORITHMS = (BLAKE3, SHA256_TREE)
TREE_CHUNK = 64 << 20
TREE_TAG = b"jupyter-gpu-snapshot sha256 tree, 64 MiB chunks\n"
# BLAKE3 reads this much per call: large enough for all cores, small enough for progress.
_BLAKE3_STEP = 64 << 20

Advance = Callable[[int], None]


def blake3_hex(data: bytes) -> str:
    """BLAKE3 of bytes in memory (recipes), on all cores."""
    assert _blake3 is not None
    return str(_blake3.blake3(data, max_threads=_blake3.blake3.AUTO).hexdigest())


def preferred_algorithm() -> str:
    return BLAKE3 if _blake3 is not None else SHA256_TREE


class Cancelled(Exception):
    """Raised inside a digest when the caller no longer needs it."""


def _workers() -> int:
    return max(2, os.cpu_count() or 2)


def _read_buffer(size: int) -> mmap.mmap:
    """An anonymous mapping to pread into. Its pages are first touched by the kernel inside
    preadv, without the GIL; a bytearray of that size is zeroed with the GIL held, and the
    page faults of 64 MiB stall every other thread of the server for a tenth of a second or
    more on a virtual machine."""
    return mmap.mmap(-1, max(size, mmap.PAGESIZE))


def _blake3_fd(
    fd: int, size: int, buffer: mmap.mmap, advance: Advance, cancel: threading.Event | None
) -> str:
    assert _blake3 is not None
    hasher = _blake3.blake3(max_threads=_blake3.blake3.AUTO)
    # pread into a buffer, not a mapping of the file: a file that shrank under a mapping
    # would be SIGBUS.
    offset = 0
    with memoryview(buffer) as view:  # released on errors too, so the buffer can close
        while offset < size:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            n = os.preadv(fd, [view[: min(len(buffer), size - offset)]], offset)
            if n <= 0:
                raise OSError("the file shrank while it was read")
            with view[:n] as chunk:
                hasher.update(chunk)  # multi-threaded, without the GIL
            offset += n
            advance(n)
    return str(hasher.hexdigest())


def _sha256_chunk(
    fd: int, offset: int, size: int, advance: Advance, cancel: threading.Event | None
) -> bytes:
    digest = hashlib.sha256()
    end = min(offset + TREE_CHUNK, size)
    while offset < end:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        data = os.pread(fd, min(8 << 20, end - offset), offset)
        if not data:
            raise OSError("the file shrank while it was read")
        digest.update(data)
        offset += len(data)
        advance(len(data))
    return digest.digest()


def digest_files(
    fds: Sequence[tuple[int, int]],
    algorithm: str,
    advance: Advance | None = None,
    cancel: threading.Event | None = None,
) -> list[str]:
    """Digests of already opened files, given as ``(fd, size)`` pairs, in their order.

    ``advance`` gets byte counts as they are hashed (from several threads, serialised
    here). Setting ``cancel`` makes the call raise ``Cancelled`` soon after.
    """
    lock = threading.Lock()

    def step(n: int) -> None:
        if advance is not None:
            with lock:
                advance(n)

    if algorithm == BLAKE3:
        if _blake3 is None:
            raise SnapshotError(
                "verify",
                "the snapshot's digests are BLAKE3, and the blake3 package is not installed",
                hint="pip install blake3",
            )
        largest = max((size for _, size in fds), default=0)
        with _read_buffer(min(_BLAKE3_STEP, largest)) as buffer:
            return [_blake3_fd(fd, size, buffer, step, cancel) for fd, size in fds]
    if algorithm != SHA256_TREE:
        raise SnapshotError("verify", f"unknown digest algorithm {algorithm!r}")
    jobs = [(i, off) for i, (_, size) in enumerate(fds) for off in range(0, max(size, 1),
                                                                           TREE_CHUNK)]

    def run(job: tuple[int, int]) -> bytes:
        fd, size = fds[job[0]]
        return _sha256_chunk(fd, job[1], size, step, cancel)

    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        parts = list(pool.map(run, jobs))
    by_file: list[list[bytes]] = [[] for _ in fds]
    for (i, _), part in zip(jobs, parts, strict=True):
        by_file[i].append(part)
    return [hashlib.sha256(TREE_TAG + b"".join(p)).hexdigest() for p in by_file]


class Incremental:
    """One file's digest, fed its bytes in order: a restore hashes what it hands to criu
    as it goes (``streamer.py``). Gives what ``digest_files`` gives for the file."""

    def __init__(self, algorithm: str) -> None:
        if algorithm == BLAKE3 and _blake3 is None:
            raise SnapshotError(
                "verify",
                "the snapshot's digests are BLAKE3, and the blake3 package is not installed",
                hint="pip install blake3",
            )
        if algorithm not in ALGORITHMS:
            raise SnapshotError("verify", f"unknown digest algorithm {algorithm!r}")
        self.algorithm = algorithm
        self._blake3 = _blake3.blake3(max_threads=_blake3.blake3.AUTO) if algorithm == BLAKE3 \
            else None
        self._chunk = hashlib.sha256()
        self._in_chunk = 0
        self._chunks: list[bytes] = []

    def update(self, data: memoryview | bytes | bytearray) -> None:
        if self._blake3 is not None:
            self._blake3.update(data)  # multi-threaded, without the GIL
            return
        view = memoryview(data)
        while len(view):
            take = min(len(view), TREE_CHUNK - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == TREE_CHUNK:
                self._chunks.append(self._chunk.digest())
                self._chunk, self._in_chunk = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        if self._blake3 is not None:
            return str(self._blake3.hexdigest())
        parts = self._chunks + ([self._chunk.digest()] if self._in_chunk or not self._chunks
                                else [])
        return hashlib.sha256(TREE_TAG + b"".join(parts)).hexdigest()
