"""A restore's images handed to criu where they lie in the store, through criu's image-streamer
protocol (``criu restore --stream``): nothing is assembled or copied before criu runs.

Why this way, and not packs laid out as criu's own pages images, is in
docs/architecture.md ("Restoring from the packs").

The protocol (criu's ``img-streamer.c``), every byte of it, is ``streamer_protocol.py``'s:
criu asks for one image file at a time over one socket, and reads each from a pipe it hands
over; our criu may ask for a pages image in place instead, and read it from the files it
lies in.

A snapshot whose files are all kept whole is not served: criu reads them in place (faster
than through pipes, see docs/performance.md) while ``verify_all``'s check runs beside from
the start. Otherwise every byte criu gets is checked against the signed manifest:

- a file of up to ``CHECKED_FIRST_BYTES`` (every image but the large pages images) is read
  whole and compared with its digest before criu gets a byte of it, so criu parses nothing
  unchecked. Checked copies of those but the pages images are also written to the images
  directory, for the hooks that read an image before criu runs (the node agent's checks);
- a larger file (a pages image) is spliced into criu's pipe from the page cache, without a
  copy, while a thread beside hashes the same pages and compares the digest at the end;
  criu only copies those bytes into the tree's memory. Our criu asks for a pages image in
  place instead (the request's ``in_place``): the answer says where its bytes lie (its
  extents) and hands over the files they lie in, open, and criu's fill workers read them
  there, as from a file kept whole; the file is still hashed once, from the same files.
  ``verify_all`` returns once every file matched, and no code of the tree runs before it
  returned: criu's CUDA plugin waits for it (the broker's gate), and without the plugin
  the tree stays stopped until then.
  A large file asked for after that is refused, so criu fails rather than read it
  unchecked. The hash and criu read the same cached pages; only a writer of the store's
  own files (its owner, root for the node agent) could change them in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SnapshotError
from . import digest
from .images import mismatch
from .packs import pread_exactly, splice_exactly, write_all
from .snapshot import Snapshot
from .streamer_protocol import (
    PAGES_PREFIX,
    SOCKET_NAME,
    Extents,
    ProtocolError,
    read_request,
    receive_pipe,
    send_place,
    send_reply,
)

log = logging.getLogger(__name__)

CHECKED_FIRST_BYTES = 16 << 20
# Read from the store this much at a time, the next block while the last goes to criu.
BLOCK_BYTES = 16 << 20
# criu's pipes hold 64 KiB; a wider one lets criu copy more per read.
PIPE_BYTES = 8 << 20
_SUN_PATH_MAX = 107
_DAMAGED = "the snapshot is damaged; delete it"

ReadInto = Callable[[memoryview, int], None]
SpliceInto = Callable[[int, int, int], None]


@dataclass(frozen=True)
class ImageFile:
    """One image file of a snapshot as a restore reads it, from wherever the store keeps
    it: ``read_into(view, offset)`` fills ``view`` with its bytes from ``offset`` on;
    ``splice_into(pipe, offset, length)`` moves them into a pipe from the page cache;
    ``extents`` says where they lie, for criu to read them in place."""

    name: str
    size: int
    digest: str
    read_into: ReadInto
    splice_into: SpliceInto
    extents: Extents | None = None  # None: in no file criu could read
    kept_whole: bool = False  # a file of the snapshot's directory, criu may read in place

    @classmethod
    def whole(cls, name: str, fd: int, size: int, expected: str) -> ImageFile:
        short = f"{name} shrank while it was read"

        def read_into(view: memoryview, offset: int) -> None:
            pread_exactly(fd, view, offset, short)

        def splice_into(pipe: int, offset: int, length: int) -> None:
            splice_exactly(fd, pipe, offset, length, short)

        extents = np.asarray([[fd, 0, 0, size]] if size else [], np.int64).reshape(-1, 4)
        return cls(name, size, expected, read_into, splice_into, extents, kept_whole=True)


@dataclass
class ServeStats:
    """Where a restore's image time went, for the benchmarks."""

    checked_first_bytes: int = 0
    streamed_bytes: int = 0  # through criu's pipes
    checked_beside_bytes: int = 0  # hashed beside criu, as it read them
    checked_after_bytes: int = 0
    read_seconds: float = 0.0  # reading the store (packs or whole files)
    hash_seconds: float = 0.0
    pipe_seconds: float = 0.0  # handing bytes to criu, waiting while it is busy
    requests: int = 0
    read_in_place: int = 0  # pages images handed over in place, read from their files
    files_handed: int = 0  # the files they lie in, handed over to criu
    extents_sent: int = 0  # the runs of those files, each a read of criu's workers

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ImageStreamer:
    """criu's image streamer for one restore: serves ``files`` of ``snapshot`` to one
    ``criu restore --stream -D directory``, and checks each against the signed manifest."""

    def __init__(self, snapshot: Snapshot, files: dict[str, ImageFile], directory: Path,
                 advance: Callable[[int], None]) -> None:
        self.snapshot = snapshot
        self.files = files
        self.directory = directory
        self.stats = ServeStats()
        self._advance = advance
        self._algorithm = str(snapshot.manifest["digest"])
        self._checked_first: dict[str, bytes] = {}
        self._verified: set[str] = set()
        self._failure: SnapshotError | None = None
        self._gate_passed = False
        self._checking = 0  # checks under way; the gate waits for them, not for criu's reads
        self._checks_started: set[str] = set()
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._closing = threading.Event()

    # -- before criu -----------------------------------------------------------------------
    @property
    def streams(self) -> bool:
        """Whether criu gets the images through this server (``--stream``): else every file
        is kept whole and criu reads them in place, faster than through pipes, while this
        server checks them beside it from the start, as before the store kept pages."""
        return not all(image.kept_whole for image in self.files.values())

    def prepare(self) -> None:
        """Check every small file, write the checked copies to the directory, and listen;
        where criu reads the files in place, start checking them all. Runs in a thread,
        before the hooks' ``before_restore``."""
        if not self.streams:
            with self._lock:
                self._checking += 1
            self._start(self._check_in_place, "check")
            return
        for name, image in self.files.items():
            if image.size > CHECKED_FIRST_BYTES:
                continue
            data = self._read_checked(image)
            self._verified.add(name)
            self.stats.checked_first_bytes += image.size
            self._checked_first[name] = data
            if name.startswith(PAGES_PREFIX):
                continue  # the kernel's memory: criu's alone, never a file of ours
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd())
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        path = os.fsencode(self.directory / SOCKET_NAME)
        if len(path) > _SUN_PATH_MAX:
            raise SnapshotError(
                "restore", f"the path of criu's image socket is too long: {path.decode()}",
                hint="set TMPDIR to a shorter directory")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(path)
        listener.listen(4)
        self._listener = listener
        self._start(self._accept, "accept")

    def _dir_fd(self) -> int:
        if not hasattr(self, "_dfd"):
            self._dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC)
        return self._dfd

    # -- while criu runs -------------------------------------------------------------------
    def _start(self, target: Callable[..., None], label: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"image-streamer-{label}")
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._start(self._serve, "connection", conn)

    def _serve(self, conn: socket.socket) -> None:
        """Answer one connection's requests until criu closes it."""
        with conn:
            try:
                while (request := read_request(conn)) is not None:
                    image = self._servable(request.name)
                    if image is None:
                        send_reply(conn, False)
                        continue
                    self._check_beside_once(image)
                    # A file read from memory, checked already, goes through its pipe.
                    if (request.in_place and image.extents is not None
                            and image.name not in self._checked_first):
                        self._hand_over(conn, image, image.extents)
                        continue
                    send_reply(conn, True)
                    pipe = receive_pipe(conn, request.name)
                    with self._lock:
                        self.stats.requests += 1
                    self._start(self._send, request.name, image, pipe)
            except (OSError, ProtocolError) as exc:
                if not self._closing.is_set():
                    log.warning("criu's image connection ended: %s", exc)

    def _check_beside_once(self, image: ImageFile) -> None:
        """Check ``image`` beside criu, not in its way, once however often criu asks for
        it: the hash reads the same page cache, ahead of criu."""
        with self._lock:
            beside = (image.name not in self._checked_first
                      and image.name not in self._checks_started)
            if beside:
                self._checks_started.add(image.name)
                self._checking += 1
        if beside:
            self._start(self._check_beside, f"check-{image.name}", image)

    def _hand_over(self, conn: socket.socket, image: ImageFile, extents: Extents) -> None:
        """``image`` in place (``send_place``): where its bytes lie, then the files they
        lie in, open for reading; criu reads them itself and sets up no pipe."""
        handed = send_place(conn, image.size, extents)
        with self._lock:
            self.stats.read_in_place += 1
            self.stats.files_handed += handed.files
            self.stats.extents_sent += handed.extents

    def _servable(self, name: str) -> ImageFile | None:
        image = self.files.get(name)
        with self._lock:
            if image is not None and self._gate_passed and name not in self._checked_first:
                # Every digest was checked already; bytes read now would not be.
                log.warning("criu asked for %s after the images were checked; refused", name)
                return None
        return image

    def _send(self, image: ImageFile, pipe: int) -> None:
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe, fcntl.F_SETPIPE_SZ, _pipe_bytes())
            ranges = _blocks_of(image.size)
            checked = self._checked_first.get(image.name)
            if checked is not None:
                with contextlib.suppress(BrokenPipeError):
                    for offset, length in ranges:
                        write_all(pipe, checked[offset:offset + length])
            else:
                self._splice(image, pipe, ranges)
        except SnapshotError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(self._unreadable(image, exc))
        finally:
            os.close(pipe)

    def _splice(self, image: ImageFile, pipe: int, ranges: Iterator[tuple[int, int]]) -> None:
        """Move ``ranges`` of ``image`` into criu's pipe, until criu stops reading."""
        for offset, length in ranges:
            if self._closing.is_set():
                raise SnapshotError("restore", "the restore was stopped")
            t = time.monotonic()
            try:
                image.splice_into(pipe, offset, length)
            except BrokenPipeError:
                return  # criu stopped reading; the check goes on beside
            with self._lock:
                self.stats.pipe_seconds += time.monotonic() - t
                self.stats.streamed_bytes += length

    def _check_in_place(self) -> None:
        try:
            for image in self.files.values():
                try:
                    self._check(image)
                except OSError as exc:
                    raise self._unreadable(image, exc) from exc
                with self._lock:
                    self.stats.checked_beside_bytes += image.size
        except SnapshotError as exc:
            self._fail(exc)
        finally:
            self._checked_one()

    def _check_beside(self, image: ImageFile) -> None:
        try:
            self._check(image)
            with self._lock:
                self.stats.checked_beside_bytes += image.size
        except SnapshotError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(self._unreadable(image, exc))
        finally:
            self._checked_one()

    def _checked_one(self) -> None:
        with self._lock:
            self._checking -= 1
            self._lock.notify_all()

    def _check(self, image: ImageFile) -> None:
        """Hash ``image`` block by block; compare with the manifest at the end."""
        hasher = digest.Incremental(self._algorithm)
        for block in self._blocks(image):
            t = time.monotonic()
            hasher.update(block)
            with self._lock:
                self.stats.hash_seconds += time.monotonic() - t
            self._advance(len(block))
        if hasher.hexdigest() != image.digest:
            raise mismatch(self.snapshot, image.name)
        with self._lock:
            self._verified.add(image.name)

    def _blocks(self, image: ImageFile) -> Iterator[memoryview]:
        """``image`` in blocks, each next one read while the last is used."""
        buffers = [mmap.mmap(-1, BLOCK_BYTES), mmap.mmap(-1, BLOCK_BYTES)]

        def read(i: int, offset: int) -> memoryview:
            view = memoryview(buffers[i])[: min(BLOCK_BYTES, image.size - offset)]
            t = time.monotonic()
            image.read_into(view, offset)
            with self._lock:
                self.stats.read_seconds += time.monotonic() - t
            return view

        with ThreadPoolExecutor(1, thread_name_prefix="image-read") as pool:
            offsets = range(0, image.size, BLOCK_BYTES)
            ahead: Future[memoryview] | None = pool.submit(read, 0, 0) if offsets else None
            for k, offset in enumerate(offsets):
                if self._closing.is_set():
                    raise SnapshotError("restore", "the restore was stopped")
                assert ahead is not None
                block = ahead.result()
                following = offset + BLOCK_BYTES
                ahead = pool.submit(read, (k + 1) % 2, following) \
                    if following < image.size else None
                yield block

    def _read_checked(self, image: ImageFile) -> bytes:
        data = bytearray(image.size)
        try:
            image.read_into(memoryview(data), 0)
        except OSError as exc:
            raise self._unreadable(image, exc) from exc
        hasher = digest.Incremental(self._algorithm)
        hasher.update(data)
        if hasher.hexdigest() != image.digest:
            raise mismatch(self.snapshot, image.name)
        self._advance(image.size)
        return bytes(data)

    def _unreadable(self, image: ImageFile, exc: OSError) -> SnapshotError:
        return SnapshotError(
            "verify", f"cannot read image file {image.name} of {self.snapshot.id}: {exc}",
            hint=_DAMAGED)

    def _fail(self, exc: SnapshotError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    # -- the gate --------------------------------------------------------------------------
    def verify_all(self) -> float:
        """Wait for the checks of the files criu asked for, then check those it never
        asked for; raise the first mismatch. Returns the seconds it waited and checked.
        Blocks: call it in a thread, once criu read the tree's memory (the CUDA plugin's
        restore, or criu's end). It never waits for criu to read: criu may be waiting
        for it."""
        started = time.monotonic()
        with self._lock:
            while self._checking and not self._closing.is_set():
                self._lock.wait(0.2)
            if self._failure is not None:
                raise self._failure
            unchecked = [image for name, image in self.files.items()
                         if name not in self._verified]
        for image in unchecked:
            try:
                self._check(image)
            except OSError as exc:
                raise self._unreadable(image, exc) from exc
            self.stats.checked_after_bytes += image.size
        with self._lock:
            self._gate_passed = True
            if self._failure is not None:
                raise self._failure
        return time.monotonic() - started

    def close(self) -> None:
        """Stop serving: criu has ended (or will fail reading)."""
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)
        if hasattr(self, "_dfd"):
            os.close(self._dfd)
            del self._dfd

    def __enter__(self) -> ImageStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _blocks_of(size: int) -> Iterator[tuple[int, int]]:
    """A whole file of ``size`` bytes, BLOCK_BYTES at a time."""
    for offset in range(0, size, BLOCK_BYTES):
        yield offset, min(BLOCK_BYTES, size - offset)


def _pipe_bytes() -> int:
    """``PIPE_BYTES``, or the most an unprivileged process may ask for when less."""
    if os.geteuid() == 0:
        return PIPE_BYTES
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            return min(PIPE_BYTES, int(f.read()))
    except (OSError, ValueError):
        return 1 << 20

