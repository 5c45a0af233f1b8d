"""Bytes moved between descriptors: exactly, in the kernel where it can be (``splice``,
``copy_file_range``), never through a path. Used by the packs, their plans and the image
server."""

from __future__ import annotations

import os

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
