"""criu's image-streamer protocol, as a restore's ``ImageStreamer`` speaks it: every byte
that crosses criu's image socket is read or written here.

FORMAT (criu's ``img-streamer.c`` and ``images/img-streamer.proto``, and our criu patch's
extents, ``scripts/criu-patches``)

criu (``criu restore --stream -D <dir>``) connects once to ``<dir>/streamer-serve.sock``
(``SOCKET_NAME``); its restoring processes share that connection, one request at a time.

- A request: a u32 length in the host's byte order, then that many bytes (at most 4096
  here) of ``img_streamer_request_entry``, a protobuf with one field, 1, the file name
  (``0x0A``, a varint length, the name's bytes) and nothing else (``read_request``).
- A reply: a u32 length, then ``img_streamer_reply_entry``, field 1, ``exists``, a varint
  (``0x08 0x00`` or ``0x08 0x01``) (``send_reply``).
- After a reply that the file exists, criu sends one byte with the write end of a pipe
  (``SCM_RIGHTS``) and reads the whole file from the other end, in order
  (``receive_pipe``); a name the streamer does not serve, or a malformed one, is answered
  as missing.

Our criu's fill workers read a large pages image in place instead, in two more requests
(``Asked``):

- ``pages-<N>.img@extents``: answered like a file, on a pipe criu sends, with the image's
  extents: rows of four little-endian unsigned 64-bit integers (``EXTENT_WORD``, 32 bytes a
  row), the file's number among the image's files, the offset in that file, the offset in
  the image, the length; in the image's order, not overlapping. Bytes of the image in no
  extent are zeros. Answered as missing when the image lies in no file criu could read,
  or was read and checked whole before criu asked (it then goes from memory, on its pipe).
- ``pages-<N>.img@file/<K>`` (``K`` up to four digits): the ``K``-th of those files, in
  the order their numbers give. After a reply that it exists, the streamer sends one byte
  (``\\0``) with the file, open for reading (``SCM_RIGHTS``, ``send_file``); criu sends no pipe
  for this request. A ``K`` past the files of the extents sent is answered as missing.

criu checks the extents before it reads through them (a run of no length, runs out of
order or overlapping, a file number of 4096 or more, or an offset that overflows makes it
read the pipe instead), and the streamer hashes the same files beside it: every byte criu
read is compared with the signed manifest before any code of the tree runs.
"""
from __future__ import annotations

import os
import re
import socket
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SOCKET_NAME = "streamer-serve.sock"
PAGES_PREFIX = "pages-"
_MAX_REQUEST_BYTES = 4096
_FILE_SPEC = re.compile(r"file/(\d{1,4})", re.ASCII)
# One extent of a pages image, as criu's patch reads it (scripts/criu-patches): four of
# these, the file (its number among the image's files), the offset in it, the offset in
# the image, the length.
EXTENT_WORD = np.dtype("<u8")

# Where a file's bytes lie: rows of (open fd, offset in it, offset in the file, length), in
# the file's order; bytes in no row are zeros.
Extents = npt.NDArray[np.int64]


class ProtocolError(Exception):
    """criu sent what its image-streamer protocol does not."""


@dataclass(frozen=True)
class Asked:
    """What one request of criu names. Plain, an image file, sent on criu's pipe. Our
    criu's fill workers (scripts/criu-patches) read a pages image in place instead: they
    ask for "pages-N.img@extents", the image's extents (``EXTENT_WORD``) on a pipe,
    then for "pages-N.img@file/K", the K-th file they lie in, handed over open for
    reading."""

    image: str
    extents: bool = False
    file: int | None = None

    @classmethod
    def of(cls, name: str) -> Asked | None:
        """What ``name`` asks for; None when malformed (answered as a missing file)."""
        base, at, spec = name.partition("@")
        if not at:
            return cls(name)
        if not base.startswith(PAGES_PREFIX):
            return None
        if spec == "extents":
            return cls(base, extents=True)
        match = _FILE_SPEC.fullmatch(spec)
        return cls(base, file=int(match.group(1))) if match else None


def read_request(conn: socket.socket) -> str | None:
    """The file name of criu's next request, or None once criu closed the connection."""
    header = _recv_exactly(conn, 4)
    if header is None:
        return None
    (size,) = struct.unpack("=I", header)
    if size > _MAX_REQUEST_BYTES:
        raise ProtocolError(f"a request of {size} bytes")
    body = _recv_exactly(conn, size)
    if body is None:
        raise ProtocolError("the connection ended inside a request")
    # img_streamer_request_entry: field 1 (filename), length-delimited, nothing else.
    if not body or body[0] != 0x0A:
        raise ProtocolError("a request without a file name")
    length, at = _varint(body, 1)
    if at + length != len(body):
        raise ProtocolError("a request with more than a file name")
    return body[at:].decode("utf-8", "surrogateescape")


def send_reply(conn: socket.socket, exists: bool) -> None:
    """Whether the file of criu's request exists."""
    conn.sendall(_reply(exists))


def receive_pipe(conn: socket.socket, name: str) -> int:
    """The write end of the pipe criu sends after a reply that ``name`` exists."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 4)
    if not fds:
        raise ProtocolError(f"no pipe came with the request for {name}")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


def send_file(conn: socket.socket, fd: int) -> None:
    """``fd``, a file a pages image lies in, handed to criu open (after a reply that it
    exists), in place of a pipe."""
    socket.send_fds(conn, [b"\0"], [fd])


def extents_table(extents: Extents) -> tuple[list[int], bytes]:
    """The files ``extents`` lie in (the K-th is what "@file/K" asks for), and the extents
    as criu reads them: each file by its number, four ``EXTENT_WORD`` a row."""
    fds, numbers = np.unique(extents[:, 0], return_inverse=True)
    table = np.column_stack([numbers.reshape(-1), extents[:, 1:]])
    return fds.tolist(), table.astype(EXTENT_WORD).tobytes()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(data) and shift < 35:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    raise ProtocolError("a malformed length in a request")


def _reply(exists: bool) -> bytes:
    # img_streamer_reply_entry: field 1 (exists), a varint.
    body = bytes([0x08, int(exists)])
    return struct.pack("=I", len(body)) + body


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            if data:
                raise ProtocolError("the connection ended inside a message")
            return None
        data += part
    return data
