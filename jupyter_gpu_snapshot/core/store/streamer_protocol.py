"""criu's image-streamer protocol, as a restore's ``ImageStreamer`` speaks it: every byte
that crosses criu's image socket is read or written here.

FORMAT (criu's ``img-streamer.c`` and ``images/img-streamer.proto``, with the field our
criu series adds, ``scripts/criu-patches/0003-*``)

criu (``criu restore --stream -D <dir>``) connects once to ``<dir>/streamer-serve.sock``
(``SOCKET_NAME``); its restoring processes share that connection, one request at a time.

- A request: a u32 length in the host's byte order, then that many bytes (at most 4096
  here) of ``img_streamer_request_entry``, a protobuf: field 1, the file name (``0x0A``, a
  varint length, the name's bytes); field 2, ``in_place``, a varint (``0x10 0x01``), which
  our criu sets when it asks for a pages image it can read in place. Fields this module
  does not know are skipped, as protobuf's readers do (``read_request``).
- A reply: a u32 length, then ``img_streamer_reply_entry``: field 1, ``exists``, a varint
  (``0x08 0x00`` or ``0x08 0x01``) (``send_reply``).
- After a reply that the file exists, with no place, criu sends one byte with the write end
  of a pipe (``SCM_RIGHTS``) and reads the whole file from the other end, in order
  (``receive_pipe``). A name the streamer does not serve is answered as missing.

In reply to a request with ``in_place``, the streamer may hand the file over in place
instead (``send_place``): the reply carries field 2, ``place``, an
``img_streamer_place_entry``:

- field 1, ``size``, the file's size, and field 2, ``nr_files``, varints;
- field 3, ``extents``, repeated, each an ``img_streamer_extent_entry`` of fixed-width
  fields (``EXTENT_ENTRY``, 34 bytes with its tag and length): ``off`` and ``len``, bytes
  of the file, ``file_off``, where they are in the ``file``-th file handed over; in the
  file's order, not overlapping; bytes in no extent are zeros.

The ``nr_files`` files follow the reply, open for reading, at most 252 descriptors to a
message, each message one byte (``\\0``); criu sends no pipe for that file. criu checks the
place before it reads through it (an extent of no length, out of order or overlapping,
past the size, or in no file handed over makes it log the place as malformed and ask for
the file again without ``in_place``). The streamer hashes the same files beside it: every
byte criu read is compared with the signed manifest before any code of the tree runs.
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SOCKET_NAME = "streamer-serve.sock"
PAGES_PREFIX = "pages-"
_MAX_REQUEST_BYTES = 4096
# One extent of a file handed over in place (img_streamer_extent_entry), with the tag and
# length that make it field 3 of img_streamer_place_entry: fixed-width fields, so the
# table is written at once.
EXTENT_ENTRY = np.dtype([("tag", "u1"), ("size", "u1"),
                         ("off_tag", "u1"), ("off", "<u8"), ("len_tag", "u1"), ("len", "<u8"),
                         ("file_off_tag", "u1"), ("file_off", "<u8"),
                         ("file_tag", "u1"), ("file", "<u4")])
# criu takes descriptors at most this many to a message (CR_SCM_MAX_FD).
FDS_PER_MESSAGE = 252

# Where a file's bytes lie: rows of (open fd, offset in it, offset in the file, length), in
# the file's order; bytes in no row are zeros.
Extents = npt.NDArray[np.int64]


class ProtocolError(Exception):
    """criu sent what its image-streamer protocol does not."""


@dataclass(frozen=True)
class Request:
    """One request of criu: the file it names, and whether it may take the file in place
    (our criu asks so for a pages image)."""

    name: str
    in_place: bool = False


@dataclass(frozen=True)
class Handed:
    """What ``send_place`` handed over: the files and the extents."""

    files: int
    extents: int


def read_request(conn: socket.socket) -> Request | None:
    """criu's next request, or None once criu closed the connection."""
    header = _recv_exactly(conn, 4)
    if header is None:
        return None
    (size,) = struct.unpack("=I", header)
    if size > _MAX_REQUEST_BYTES:
        raise ProtocolError(f"a request of {size} bytes")
    body = _recv_exactly(conn, size)
    if body is None:
        raise ProtocolError("the connection ended inside a request")
    name: str | None = None
    in_place = False
    at = 0
    while at < len(body):
        key, at = _read_varint(body, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _read_varint(body, at)
            if field == 2:
                in_place = bool(value)
        elif wire == 2:
            length, at = _read_varint(body, at)
            if at + length > len(body):
                raise ProtocolError("a request that ends inside a field")
            if field == 1:
                name = body[at:at + length].decode("utf-8", "surrogateescape")
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ProtocolError(f"a request with a field of wire type {wire}")
    if name is None or at != len(body):
        raise ProtocolError("a request without a file name")
    return Request(name, in_place)


def send_reply(conn: socket.socket, exists: bool) -> None:
    """Whether the file of criu's request exists; if it does, criu sends a pipe next."""
    conn.sendall(_reply(exists))


def receive_pipe(conn: socket.socket, name: str) -> int:
    """The write end of the pipe criu sends after a reply that ``name`` exists."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 4)
    if not fds:
        raise ProtocolError(f"no pipe came with the request for {name}")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


def send_place(conn: socket.socket, size: int, extents: Extents) -> Handed:
    """A file of ``size`` bytes, asked for in place, handed over where ``extents`` say
    it lies: the reply with its place (each file numbered by its place among those handed
    over), then the files, open for reading."""
    fds, numbers = np.unique(extents[:, 0], return_inverse=True)
    table = np.zeros(len(extents), EXTENT_ENTRY)
    table["tag"], table["size"] = 0x1A, EXTENT_ENTRY.itemsize - 2
    table["off_tag"], table["len_tag"] = 0x09, 0x11
    table["file_off_tag"], table["file_tag"] = 0x19, 0x25
    table["file_off"], table["off"], table["len"] = extents[:, 1], extents[:, 2], extents[:, 3]
    table["file"] = numbers.reshape(-1)
    place = b"\x08" + _varint(size) + b"\x10" + _varint(len(fds)) + table.tobytes()
    conn.sendall(_reply(True, place))
    for at in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(conn, [b"\0"], fds[at:at + FDS_PER_MESSAGE].tolist())
    return Handed(len(fds), len(extents))


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    raise ProtocolError("a malformed varint in a request")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _reply(exists: bool, place: bytes | None = None) -> bytes:
    # img_streamer_reply_entry: field 1 (exists), a varint; field 2 (place), when the file
    # is handed over in place.
    body = bytes([0x08, int(exists)])
    if place is not None:
        body += b"\x12" + _varint(len(place)) + place
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
