"""Reading CRIU image files as the node agent must: only what it needs, with the standard
library, refusing whatever protobuf-c (CRIU's decoder) might read differently.

A CRIU image is a header of magic numbers, then entries: each a little-endian uint32
length and that many bytes of one protobuf message. The agent decodes two kinds before it
lets criu restore for a caller: the threads' credentials (``in_images``) and the files
criu would reopen (``files/restore_plan``).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

# criu/include/magic.h: every image but the inventory starts with the common magic, then
# the magic of its kind.
IMG_COMMON_MAGIC = 0x54564319
CORE_MAGIC = 0x55053847
FILES_MAGIC = 0x56303138
MM_MAGIC = 0x57492820
FS_MAGIC = 0x51403912
REMAP_FPATH_MAGIC = 0x59133954

# Protobuf wire types. 3 and 4 (groups) appear in no CRIU message: they are refused.
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5

_UINT32_MAX = 0xFFFFFFFF


class MalformedImage(ValueError):
    """The file is not an image of the kind the agent can vouch for."""


def read_image(path: Path, max_bytes: int) -> bytes:
    """The bytes of image file ``path``, at most ``max_bytes`` of them.

    Root opens a file in a directory it does not trust to hold only images: a link could
    point at a file the caller may not read, a FIFO would block, /dev/zero would never
    end. Only a regular file will do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise MalformedImage(f"cannot be opened ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MalformedImage("is not a regular file")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MalformedImage(f"is larger than such an image can be ({max_bytes} bytes)")
    return data


def image_entries(data: bytes, magic: int, kind: str) -> list[bytes]:
    """The entries of an image whose header must be the common magic, then ``magic``."""
    if len(data) < 8:
        raise MalformedImage("is truncated: too short for a CRIU image header")
    common_magic, found = struct.unpack_from("<II", data)
    if (common_magic, found) != (IMG_COMMON_MAGIC, magic):
        raise MalformedImage(
            f"is not a CRIU {kind} image (magic {common_magic:#010x} {found:#010x}, "
            f"not {IMG_COMMON_MAGIC:#010x} {magic:#010x})"
        )
    return list(_entries(data, 8))


def _entries(data: bytes, position: int) -> Iterator[bytes]:
    while position < len(data):
        if position + 4 > len(data):
            raise MalformedImage("is truncated: an entry's length is cut short")
        (length,) = struct.unpack_from("<I", data, position)
        position += 4
        if position + length > len(data):
            raise MalformedImage("is truncated: an entry runs past the end of the file")
        yield data[position : position + length]
        position += length


def uint32(value: int | bytes) -> int:
    """A uint32 field's value. protobuf-c keeps the low 32 bits of a larger number (2**32
    would read as 0), so a larger one is refused rather than read two ways."""
    if isinstance(value, bytes) or value > _UINT32_MAX:
        raise MalformedImage("has a field that is no 32-bit number")
    return value


def messages(message: bytes, number: int) -> list[bytes]:
    """Every copy of embedded message field ``number``: protobuf merges them all."""
    found = []
    for field_number, _, value in fields(message):
        if field_number == number:
            if not isinstance(value, bytes):
                raise MalformedImage(f"has field {number} in the wrong encoding")
            found.append(value)
    return found


def fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """A protobuf message's fields in order: (field number, wire type, value).

    A varint or fixed-size value comes as an int, a length-delimited one as its bytes.
    """
    position = 0
    while position < len(message):
        key, position = varint(message, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise MalformedImage("is corrupt: a protobuf field numbered 0")
        value: int | bytes
        if wire_type == VARINT:
            value, position = varint(message, position)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if position + size > len(message):
                raise MalformedImage("is truncated: a protobuf field is cut short")
            value = int.from_bytes(message[position : position + size], "little")
            position += size
        elif wire_type == LENGTH_DELIMITED:
            length, position = varint(message, position)
            if position + length > len(message):
                raise MalformedImage("is truncated: a protobuf field is cut short")
            value = message[position : position + length]
            position += length
        else:
            raise MalformedImage(f"is corrupt: protobuf wire type {wire_type}")
        yield number, wire_type, value


def varint(data: bytes, position: int) -> tuple[int, int]:
    """The base-128 number at ``position`` (7 bits a byte, low first), and where it ends."""
    value = 0
    for shift in range(0, 70, 7):  # protobuf's varints are at most 10 bytes long
        if position >= len(data):
            raise MalformedImage("is truncated: a protobuf number is cut short")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
    raise MalformedImage("is corrupt: a protobuf number longer than 10 bytes")
