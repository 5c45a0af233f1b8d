"""Restores read the images where the store keeps them (``core/streamer.py``).

End to end, with real criu and real kernels: a restore from packs on another file system
than criu's working directory, criu killed while it reads the pages, and the bytes criu got
checked. Then the server's side of criu's image-streamer protocol, spoken by a client that
does what criu's ``img-streamer.c`` does, for what a real criu never shows on purpose:
damage past what criu read, criu closing a pipe early, a request after the gate.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

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
    # criu's workers read the pages from the packs in place, hashed beside them from the
    # same packs; the rest was checked first, before criu got a byte of it.
    assert served["read_in_place"] == 1 and served["files_handed"] >= 1
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
    (from the stream's one pipe, or its workers from the store's packs in place), so criu
    dies with its pipe or packs half read."""
    return (
        'case "$1" in restore)\n'
        + _value_of("-W", "work")
        + """  "{real}" "$@" & pid=$!
  for i in $(seq 4000); do
    grep -qE "Read page from self|pages from [0-9]+ files in place" "$work/restore.log" \
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
    # a minute: until then a restore says so, and then it brings the kernel back.
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

    def open(self, name: str) -> int | None:
        """Ask for ``name``; the read end of its pipe, or None when it does not exist."""
        raw = name.encode()
        body = bytes([0x0A, len(raw)]) + raw
        self.sock.sendall(struct.pack("=I", len(body)) + body)
        header = self._recv(4)
        (size,) = struct.unpack("=I", header)
        reply = self._recv(size)
        assert reply[0] == 0x08
        if not reply[1]:
            return None
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
