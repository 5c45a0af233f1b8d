"""Restores read the images where the store keeps them (``core/streamer.py``).

End to end, with real criu and real kernels: a restore from packs on another file system
than criu's working directory, criu killed while it reads the pages, and the bytes criu got
checked. Then the server's side of criu's image-streamer protocol, spoken by a client that
does what criu's ``img-streamer.c`` does, for what a real criu never shows on purpose:
damage past what criu read, criu closing a pipe early, a request after the gate.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore, digest, streamer
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from jupyter_gpu_snapshot.core.store.streamer import ImageFile, ImageStreamer
from jupyter_gpu_snapshot.launch.liveness import kernel_answers
from testkit.criu_fill import criu_fills_on_workers
from testkit.criu_wrappers import _real, _value_of, install
from tests.conftest import KernelHandle, execute, run

# 96 MiB of the kernel's memory that only this state produces: its pages image is streamed.
STATE = """
import hashlib, numpy as np
rng = np.random.default_rng(20261127)
block = rng.integers(0, 2**63, size=12 << 20, dtype=np.int64)
print(hashlib.sha256(block.tobytes()).hexdigest())
"""


def _save(engine: SnapshotEngine, kernel: KernelHandle, name: str) -> Snapshot:
    target = SaveTarget(pid=kernel.root_pid, connection_info=kernel.km.get_connection_info(),
                        kernel_name="python3-snapshot")
    snap = run(engine.save(target, name=name, stop=True))
    kernel.km.provisioner.process.wait(timeout=10)
    return snap  # type: ignore[no-any-return]


def _same_state(client: object, expected: str) -> None:
    out = execute(client, "print(hashlib.sha256(block.tobytes()).hexdigest())")  # type: ignore[arg-type]
    assert out.strip() == expected


@pytest.fixture
def other_file_system(tmp_path: Path):
    """A tmpfs of its own, unmounted after the test."""
    mount = tmp_path / "other-fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0700", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_store_on_another_file_system_restores_from_its_packs(
    other_file_system, kernel, restored
):
    store = SnapshotStore(other_file_system / "store")
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    snap = _save(engine, kernel, "elsewhere")
    assert os.stat(store.root).st_dev != os.stat("/tmp").st_dev
    assert any(p.name.endswith(".chunks") for p in snap.path.iterdir())
    # The save found where its pages lie, for this restore (packs.RememberedPlan).
    assert list((store.root / "chunks").glob("*.where"))

    back = run(engine.restore(snap.id))
    client = restored.connect(back.connection_info, back.pid)
    _same_state(client, expected)
    served = back.notes["images"]
    # criu's workers read the pages from the packs in place (a stock criu reads them from
    # the stream's pipe), hashed beside them from the same packs; the rest was checked
    # first, before criu got a byte of it.
    if criu_fills_on_workers():
        assert served["read_in_place"] == 1 and served["files_handed"] >= 1
    else:
        assert served["read_in_place"] == 0 and served["files_handed"] == 0
    assert served["checked_beside_bytes"] >= 96 << 20
    assert served["checked_first_bytes"] > 0
    assert served["checked_beside_bytes"] + served["checked_first_bytes"] \
        + served["checked_after_bytes"] >= snap.size_bytes
    assert "assemble" not in back.timings
    # Nothing of the restore is left in the store or beside criu.
    assert not [p for p in store.root.iterdir() if p.name.startswith(".assembled-")]


def test_a_snapshot_kept_whole_is_read_in_place_and_checked_beside(tmp_path, kernel, restored):
    store = SnapshotStore(tmp_path / "store", chunk_images=False)
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    snap = _save(engine, kernel, "whole")
    assert not any(p.name.endswith(".chunks") for p in snap.path.iterdir())

    back = run(engine.restore(snap.id))
    _same_state(restored.connect(back.connection_info, back.pid), expected)
    # criu read the files where they are: nothing went through the server's pipes.
    assert back.notes["images"]["streamed_bytes"] == 0
    procfs.kill_tree(back.pid)

    pages = max(snap.path.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(SnapshotError) as err:
        run(engine.restore(snap.id))
    assert err.value.step == "verify" and f"image file {pages.name}" in err.value.message
    assert procfs.ports_in_use(snap.connection_info) == []


def _kill_criu_once_it_reads_pages() -> str:
    """A wrapper that SIGKILLs the real criu restore once its log shows it reading pages
    (from the stream's one pipe, or a pages image handed over in place, which its workers
    read from the store's packs next), so criu dies with its pipe or packs half read."""
    return (
        'case "$1" in restore)\n'
        + _value_of("-W", "work")
        + """  "{real}" "$@" & pid=$!
  for i in $(seq 4000); do
    grep -qE "Read page from self|over in place" "$work/restore.log" \
      2>/dev/null && break
    sleep 0.005
  done
  kill -9 $pid; wait $pid; exit 137;;
*) exec "{real}" "$@";;
esac
""".format(real=_real())
    )


def test_criu_killed_while_it_reads_the_stream_leaves_the_snapshot_restorable(
    store, kernel, tmp_path, restored
):
    engine = SnapshotEngine(store, kernel_answers=kernel_answers)
    expected = kernel.execute(STATE).strip()
    snap = _save(engine, kernel, "midway")
    killer = SnapshotEngine(store, CriuRunner(install(tmp_path, _kill_criu_once_it_reads_pages())),
                            kernel_answers=kernel_answers)
    threads_before = threading.active_count()
    with pytest.raises(SnapshotError) as err:
        run(killer.restore(snap.id))
    assert err.value.step == "restore" and "signal 9" in err.value.message
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before:
        assert time.monotonic() < deadline, "the image streamer's threads outlived the restore"
        time.sleep(0.05)
    assert [s.id for s in store.list()] == [snap.id]
    store.verify(store.get(snap.id))

    # The sockets criu had restored end in TIME_WAIT, which the system alone frees, within
    # a minute: until then a restore says so, and then it brings the kernel back. The
    # killed tree's processes close them as they end, a moment after the restore failed.
    deadline = time.monotonic() + 30
    while procfs.ports_in_use(snap.connection_info) and not procfs.ports_closing(
            snap.connection_info):
        assert time.monotonic() < deadline, "a process holds the ports of the killed restore"
        time.sleep(0.05)
    if procfs.ports_in_use(snap.connection_info):
        with pytest.raises(SnapshotError, match="closing connections of an interrupted"):
            run(engine.restore(snap.id))
    deadline = time.monotonic() + 90
    while procfs.ports_in_use(snap.connection_info):
        assert procfs.ports_closing(snap.connection_info), \
            "a process holds the ports of the killed restore"
        assert time.monotonic() < deadline, "the ports stayed busy"
        time.sleep(1)
    back = run(engine.restore(snap.id))
    _same_state(restored.connect(back.connection_info, back.pid), expected)


# -- the protocol, as criu speaks it -------------------------------------------------------


class CriuSide:
    """What criu's img-streamer.c does on one connection."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))

    def open(self, name: str, extra: bytes = b"") -> int | None:
        """Ask for ``name`` (``extra``: more fields of the request); the read end of its
        pipe, or None when it does not exist."""
        reply = self._ask(name, extra)
        if not reply[1]:
            return None
        assert len(reply) == 2, "a place came in reply to a plain request"
        return self._pipe()

    def open_in_place(self, name: str) -> InPlace | int | None:
        """Ask for ``name`` in place (the request's ``in_place``), as our criu asks for a
        pages image: its place and the files handed over, or the read end of its pipe
        where the server sends it through one, or None when it does not exist."""
        reply = self._ask(name, b"\x10\x01")
        if not reply[1]:
            return None
        if len(reply) == 2:
            return self._pipe()
        assert reply[2] == 0x12  # field 2, the place
        length, at = _varint(reply, 3)
        place = InPlace.parse(reply[at:at + length])
        fds: list[int] = []
        while len(fds) < place.nr_files:
            _, got, _, _ = socket.recv_fds(self.sock, 1, 252)
            fds += got
        place.fds = fds
        return place

    def _ask(self, name: str, extra: bytes) -> bytes:
        raw = name.encode()
        body = bytes([0x0A, len(raw)]) + raw + extra
        self.sock.sendall(struct.pack("=I", len(body)) + body)
        header = self._recv(4)
        (size,) = struct.unpack("=I", header)
        reply = self._recv(size)
        assert reply[0] == 0x08
        return reply

    def _pipe(self) -> int:
        read_end, write_end = os.pipe()
        socket.send_fds(self.sock, [b"\0"], [write_end])
        os.close(write_end)
        return read_end

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self.sock.recv(n - len(data))
            assert part, "the server closed the connection"
            data += part
        return data

    def close(self) -> None:
        self.sock.close()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


@dataclass
class InPlace:
    """A pages image handed over in place, as criu reads the answer
    (img_streamer_place_entry): its size, its extents (offset in the image, length, offset
    in the file, the file's number), and the files."""

    size: int
    nr_files: int
    extents: list[tuple[int, int, int, int]]
    fds: list[int] = field(default_factory=list)

    @classmethod
    def parse(cls, data: bytes) -> InPlace:
        size = nr_files = 0
        extents = []
        at = 0
        while at < len(data):
            key, at = _varint(data, at)
            if key == 0x08:
                size, at = _varint(data, at)
            elif key == 0x10:
                nr_files, at = _varint(data, at)
            else:
                assert key == 0x1A and data[at] == 32, "an extent of another form"
                entry = data[at + 1:at + 33]
                assert entry[0::9][:4] == bytes([0x09, 0x11, 0x19, 0x25])
                off, length, file_off = struct.unpack_from("<Q", entry, 1)[0], \
                    struct.unpack_from("<Q", entry, 10)[0], struct.unpack_from("<Q", entry, 19)[0]
                extents.append((off, length, file_off, struct.unpack_from("<I", entry, 28)[0]))
                at += 33
        return cls(size, nr_files, extents)

    def read(self) -> bytes:
        """The image, read where the extents say; zeros in no extent."""
        data = bytearray(self.size)
        for off, length, file_off, number in self.extents:
            data[off:off + length] = os.pread(self.fds[number], length, file_off)
        return bytes(data)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _read_all(fd: int, limit: int | None = None) -> bytes:
    out = bytearray()
    while limit is None or len(out) < limit:
        part = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - len(out)))
        if not part:
            break
        out += part
    return bytes(out)


def _image(name: str, data: bytes, recorded: bytes | None = None) -> ImageFile:
    """An image whose manifest digest is that of ``recorded`` (default: of ``data``)."""
    hasher = digest.Incremental(digest.BLAKE3)
    hasher.update(recorded if recorded is not None else data)

    def read_into(view: memoryview, offset: int) -> None:
        view[:] = data[offset:offset + len(view)]

    def splice_into(pipe: int, offset: int, length: int) -> None:
        view = memoryview(data)[offset:offset + length]
        while len(view):
            view = view[os.write(pipe, view):]

    return ImageFile(name, len(data), hasher.hexdigest(), read_into, splice_into)


def _served(tmp_path: Path, images: list[ImageFile]) -> ImageStreamer:
    directory = tmp_path / "images"
    directory.mkdir()
    snapshot = Snapshot(id="s1", path=tmp_path, manifest={"digest": digest.BLAKE3, "files": {}})
    return ImageStreamer(snapshot, {i.name: i for i in images}, directory, lambda n: None)


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setattr(streamer, "CHECKED_FIRST_BYTES", 64 << 10)
    monkeypatch.setattr(streamer, "BLOCK_BYTES", 256 << 10)


def test_small_files_are_checked_before_criu_reads_a_byte(tmp_path, small_limits):
    core = os.urandom(4096)
    server = _served(tmp_path, [_image("core-1.img", core, recorded=b"other")])
    with server, pytest.raises(SnapshotError) as err:
        server.prepare()
    assert err.value.step == "verify" and "image file core-1.img" in err.value.message
    assert not (tmp_path / "images" / "core-1.img").exists()


def test_files_are_served_in_full_and_missing_ones_are_said_to_be(tmp_path, small_limits):
    core, pages = os.urandom(4096), os.urandom(1 << 20)
    with _served(tmp_path, [_image("core-1.img", core), _image("pages-1.img", pages)]) as server:
        server.prepare()
        # The hooks read the checked small files from the images directory.
        assert (tmp_path / "images" / "core-1.img").read_bytes() == core
        criu = CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)
        assert criu.open("stats-restore.img") is None
        assert criu.open("../manifest.json") is None
        fd = criu.open("pages-1.img")
        assert fd is not None and _read_all(fd) == pages
        fd2 = criu.open("core-1.img")
        assert fd2 is not None and _read_all(fd2) == core
        assert server.verify_all() >= 0
        assert server.stats.streamed_bytes == len(pages)
        criu.close()


def test_damage_past_what_criu_read_is_still_found(tmp_path, small_limits):
    pages = bytearray(os.urandom(1 << 20))
    recorded = bytes(pages)
    pages[-1] ^= 1
    with _served(tmp_path, [_image("pages-1.img", bytes(pages), recorded)]) as server:
        server.prepare()
        criu = CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)
        fd = criu.open("pages-1.img")
        assert fd is not None
        assert _read_all(fd, 4096) == recorded[:4096]
        os.close(fd)  # criu stops reading early; the server still checks the whole file
        with pytest.raises(SnapshotError) as err:
            server.verify_all()
        assert err.value.step == "verify" and "pages-1.img" in err.value.message
        criu.close()


def test_files_criu_never_asked_for_are_checked_at_the_gate_and_refused_after(
    tmp_path, small_limits
):
    pages, other = os.urandom(1 << 20), os.urandom(1 << 20)
    with _served(tmp_path, [_image("pages-1.img", pages), _image("pages-2.img", other)]) as server:
        server.prepare()
        criu = CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)
        fd = criu.open("pages-1.img")
        assert fd is not None and _read_all(fd) == pages
        server.verify_all()
        assert server.stats.checked_after_bytes == len(other)
        # Once the gate opened, a large file would reach criu unchecked: refused.
        assert criu.open("pages-2.img") is None
        criu.close()


def test_the_gate_never_waits_for_criu_to_read(tmp_path, small_limits):
    pages = os.urandom(3 * streamer.PIPE_BYTES)  # more than criu's pipe holds
    with _served(tmp_path, [_image("pages-1.img", pages)]) as server:
        server.prepare()
        criu = CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)
        fd = criu.open("pages-1.img")
        assert fd is not None
        # criu holds the pipe unread (it may be waiting for the gate itself): the check
        # beside still ends, and the gate opens.
        gate = threading.Thread(target=server.verify_all)
        gate.start()
        gate.join(timeout=30)
        assert not gate.is_alive(), "the gate waited for criu to read"
        assert _read_all(fd) == pages
        criu.close()


def _image_in_files(name: str, directory: Path) -> tuple[ImageFile, bytes]:
    """A pages image of 1 MiB kept in two files, as a store keeps one in its packs: its
    first quarter from one, its last half from the other, zeros between; and its bytes."""
    first, second = os.urandom(512 << 10), os.urandom(1 << 20)
    paths = [directory / "pack-a", directory / "pack-b"]
    paths[0].write_bytes(first)
    paths[1].write_bytes(second)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    data = first[4096:4096 + (256 << 10)] + bytes(256 << 10) + second[:512 << 10]
    extents = np.array([[fds[0], 4096, 0, 256 << 10], [fds[1], 0, 512 << 10, 512 << 10]],
                       np.int64)
    image = _image(name, data)
    return ImageFile(image.name, image.size, image.digest, image.read_into, image.splice_into,
                     extents), data


def test_a_pages_image_is_handed_over_in_place_where_criu_asks_for_it(tmp_path, small_limits):
    (tmp_path / "packs").mkdir()
    pages, data = _image_in_files("pages-1.img", tmp_path / "packs")
    with _served(tmp_path, [pages]) as server:
        server.prepare()
        with contextlib.closing(CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)) as criu:
            place = criu.open_in_place("pages-1.img")
            assert isinstance(place, InPlace), "the image came through a pipe"
            try:
                assert (place.size, place.nr_files, len(place.extents)) == (1 << 20, 2, 2)
                assert place.read() == data
            finally:
                place.close()
            # Asked for again plainly (as criu does when it refuses a place), it comes
            # through a pipe.
            fd = criu.open("pages-1.img")
            assert fd is not None and _read_all(fd) == data
        # The server answers a connection's requests in turn, so it counted the first one
        # before it read the second: that pipe is the only one asked for; the image handed
        # over in place is still checked beside, from the same files.
        assert server.stats.requests == 1
        assert (server.stats.read_in_place, server.stats.files_handed,
                server.stats.extents_sent) == (1, 2, 2)
        assert server.verify_all() >= 0
        assert server.stats.streamed_bytes == len(data)


def test_what_cannot_be_read_in_place_comes_through_a_pipe(tmp_path, small_limits):
    core, pages = os.urandom(4096), os.urandom(1 << 20)
    with _served(tmp_path, [_image("core-1.img", core), _image("pages-1.img", pages)]) as server:
        server.prepare()
        criu = CriuSide(tmp_path / "images" / streamer.SOCKET_NAME)
        # Checked before criu ran, from memory: its pipe, whatever criu asks.
        fd = criu.open_in_place("core-1.img")
        assert isinstance(fd, int) and _read_all(fd) == core
        # Kept in no file criu could read.
        fd = criu.open_in_place("pages-1.img")
        assert isinstance(fd, int) and _read_all(fd) == pages
        assert criu.open_in_place("pages-2.img") is None
        # A field the server does not know (a later criu's) is skipped.
        fd = criu.open("core-1.img", extra=b"\x48\x07")
        assert fd is not None and _read_all(fd) == core
        assert server.stats.read_in_place == 0
        criu.close()
