"""Bytes moved between descriptors: exactly, in the kernel where it can be (``splice``,
``copy_file_range``), never through a path. Used by the packs, their plans and the image
server."""

from __future__ import annotations

import ctypes
import os

_ZEROS = bytes(1 << 20)
# sync_file_range(2)'s flag: start writing the range's dirty pages, wait for none of it.
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the disk start writing ``length`` bytes of ``fd`` from ``offset`` now, without
    waiting for it: the page cache would otherwise hold them until the final fsync, or until
    the kernel's own writeback wakes, and the disk would idle meanwhile. A hint only: where
    it fails (no such call, a filesystem without it) nothing is lost, and any write error
    comes back from the fsync that makes the file durable."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


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


def read_range(fd: int, offset: int, length: int) -> bytes:
    parts = []
    while length > 0:
        data = os.pread(fd, length, offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        length -= len(data)
    return b"".join(parts)


def read_all(fd: int, size: int) -> bytes:
    parts = []
    offset = 0
    while offset < size:
        data = os.pread(fd, min(size - offset, 64 << 20), offset)
        if not data:
            break
        parts.append(data)
        offset += len(data)
    return b"".join(parts)


def size_at(name: str, dfd: int) -> int:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0
