"""Refuses a CRIU image whose threads would not run as the caller, unprivileged.

The node agent runs ``criu restore`` as root for unprivileged callers, and CRIU gives every
restored thread the credentials written in the thread's core image: uids, gids,
supplementary groups, capabilities and securebits. A caller could hand root an image that
claims root's or another user's credentials, or capabilities, and get a process holding
them. Before any restore the agent calls :func:`check_image_credentials`, which decodes the
credentials of every ``core-<tid>.img`` and refuses the image unless they are exactly the
caller's, with no capabilities.

Where CRIU keeps them: each thread's ``core_entry.thread_core.creds`` (images/core.proto,
images/creds.proto). An image without them is refused, because CRIU then either leaves the
thread with its own (root) credentials or reads them from an old-format ``creds-<pid>.img``.

What this check cannot see, and the agent must do itself:

- check the very files that criu will read, where the caller cannot change them (the
  agent's store is root's alone);
- run criu with the caller's groups only (``criu_credentials``): a thread whose image
  lists none keeps criu's own, as CRIU calls setgroups only for a non-empty list;
- images with a user namespace, whose ids are relative to it, and LSM labels
  (``lsm_profile``), which root may set to any context, are not judged here.

The decoder below reads only what it needs of protobuf's wire format, with the standard
library, and refuses whatever protobuf-c (CRIU's decoder) might read differently.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidRequest

# criu/include/magic.h: every image but the inventory starts with the common magic, then
# the magic of its kind.
_IMG_COMMON_MAGIC = 0x54564319
_CORE_MAGIC = 0x55053847

# A core image is a few kilobytes. The agent reads files that the caller wrote, so it reads
# no more than this (a caller could name a huge file).
_MAX_IMAGE_BYTES = 16 << 20

# Protobuf wire types. 3 and 4 (groups) appear in no CRIU message: they are refused.
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5

# Field numbers, from CRIU's images/core.proto and images/creds.proto.
_CORE_ENTRY_THREAD_CORE = 5
_THREAD_CORE_CREDS = 10
_CREDS_SCALARS = {
    1: "uid", 2: "gid", 3: "euid", 4: "egid", 5: "suid", 6: "sgid", 7: "fsuid", 8: "fsgid",
    13: "secbits",
}  # fmt: skip
_CREDS_LISTS = {
    9: "cap_inh", 10: "cap_prm", 11: "cap_eff", 12: "cap_bnd", 14: "groups", 19: "cap_amb",
}  # fmt: skip

_UINT32_MAX = 0xFFFFFFFF
_CAPABILITY_SETS = ("cap_inh", "cap_prm", "cap_eff", "cap_amb")

_HINT = (
    "the node agent restores only images of your own unprivileged processes: dump a process "
    "that runs as you, with no capabilities"
)


@dataclass(frozen=True)
class Caller:
    """The unprivileged user asking for a restore, as the agent knows them."""

    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups the caller legitimately has


@dataclass(frozen=True)
class Creds:
    """One thread's credentials as its core image gives them to CRIU.

    The capability sets are tuples of 32-bit words, lowest capabilities first; ``cap_amb``
    is empty in images that predate ambient capabilities.
    """

    uid: int
    gid: int
    euid: int
    egid: int
    suid: int
    sgid: int
    fsuid: int
    fsgid: int
    cap_inh: tuple[int, ...]
    cap_prm: tuple[int, ...]
    cap_eff: tuple[int, ...]
    cap_bnd: tuple[int, ...]
    cap_amb: tuple[int, ...]
    secbits: int
    groups: tuple[int, ...]


class _Malformed(ValueError):
    """The file is not a core image that this module can vouch for."""


def image_credentials(images_dir: Path) -> dict[str, list[Creds]]:
    """The credentials in each ``core-*.img`` of ``images_dir``, by file name.

    A file normally holds one ``Creds``; it holds more only where the creds message is
    repeated, which protobuf merges into one (so every copy must pass). Raises
    :class:`InvalidRequest` for a file that cannot be decoded.
    """
    found: dict[str, list[Creds]] = {}
    for path in sorted(images_dir.glob("core-*.img")):
        try:
            found[path.name] = _decode_core_image(_read_image(path))
        except _Malformed as error:
            raise _refusal(f"{path.name}: {error}") from None
    return found


def check_image_credentials(images_dir: Path, caller: Caller) -> None:
    """Raises :class:`InvalidRequest` unless every thread in the image runs as ``caller``.

    That is: all four uids are the caller's uid, all four gids the caller's gid, every
    supplementary group one the caller has, no capability in the inheritable, permitted,
    effective or ambient sets, and no securebits.
    """
    found = image_credentials(images_dir)
    if not found:
        raise _refusal(f"{images_dir} holds no core-*.img, so it is no CRIU image")
    for name, all_creds in found.items():
        for creds in all_creds:
            problem = _why_not_the_callers(creds, caller)
            if problem:
                raise _refusal(f"{name}: {problem}")


def _refusal(cause: str) -> InvalidRequest:
    return InvalidRequest("restore", cause, hint=_HINT)


def _why_not_the_callers(creds: Creds, caller: Caller) -> str | None:
    uids = {"uid": creds.uid, "euid": creds.euid, "suid": creds.suid, "fsuid": creds.fsuid}
    wrong_uids = [(name, value) for name, value in uids.items() if value != caller.uid]
    if wrong_uids:
        return f"the process would run as {_listed(wrong_uids)}, not as you (uid {caller.uid})"

    gids = {"gid": creds.gid, "egid": creds.egid, "sgid": creds.sgid, "fsgid": creds.fsgid}
    wrong_gids = [(name, value) for name, value in gids.items() if value != caller.gid]
    if wrong_gids:
        return (
            f"the process would run as {_listed(wrong_gids)}, not in your group (gid {caller.gid})"
        )

    foreign_groups = sorted(set(creds.groups) - caller.groups - {caller.gid})
    if foreign_groups:
        listed = ", ".join(str(group) for group in foreign_groups)
        return f"the process would be in supplementary groups {listed}, which you are not in"

    held = [
        f"{name} " + " ".join(f"{word:#010x}" for word in getattr(creds, name))
        for name in _CAPABILITY_SETS
        if any(getattr(creds, name))
    ]
    if held:
        return (
            f"the process would hold capabilities ({'; '.join(held)}), "
            "and an unprivileged process holds none"
        )

    # Setting securebits needs CAP_SETPCAP, and CRIU sets the image's bits while it still
    # has root's capabilities, so an image could hand the caller bits they never had. Any
    # bit can mislead a setuid-root program the process runs: NO_SETUID_FIXUP or KEEP_CAPS
    # keep its capabilities when it drops to the caller's uid, NOROOT leaves it without the
    # CAP_SETUID it needs to drop its saved uid. An unprivileged process has bits only when
    # a privileged ancestor set them (systemd's SecureBits=); such images are refused too.
    if creds.secbits:
        return (
            f"the process would run with securebits {creds.secbits:#x}, "
            "which only a privileged process can set"
        )
    return None


def _listed(fields: list[tuple[str, int]]) -> str:
    """``uid 0 (euid 0, suid 0)``: the first field that is wrong, then the others."""
    (first_name, first_value), *others = fields
    text = f"{first_name} {first_value}"
    if others:
        text += " (" + ", ".join(f"{name} {value}" for name, value in others) + ")"
    return text


def _read_image(path: Path) -> bytes:
    # Root opens a file that the caller named: a link could point at a file the caller may
    # not read, a FIFO would block, /dev/zero would never end. Only a regular file will do.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise _Malformed(f"cannot be opened ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Malformed("is not a regular file")
        data = file.read(_MAX_IMAGE_BYTES + 1)
    if len(data) > _MAX_IMAGE_BYTES:
        raise _Malformed(f"is larger than a core image can be ({_MAX_IMAGE_BYTES} bytes)")
    return data


def _decode_core_image(data: bytes) -> list[Creds]:
    if len(data) < 8:
        raise _Malformed("is truncated: too short for a CRIU image header")
    common_magic, magic = struct.unpack_from("<II", data)
    if (common_magic, magic) != (_IMG_COMMON_MAGIC, _CORE_MAGIC):
        raise _Malformed(
            f"is not a CRIU core image (magic {common_magic:#010x} {magic:#010x}, "
            f"not {_IMG_COMMON_MAGIC:#010x} {_CORE_MAGIC:#010x})"
        )
    entries = list(_entries(data, 8))
    # CRIU writes one core_entry and reads only the first: a second would be a place to
    # hide what CRIU reads, so none is accepted.
    if len(entries) != 1:
        raise _Malformed(f"holds {len(entries)} entries where a core image holds one")
    creds = [
        _decode_creds(creds_message)
        for thread_core in _messages(entries[0], _CORE_ENTRY_THREAD_CORE)
        for creds_message in _messages(thread_core, _THREAD_CORE_CREDS)
    ]
    if not creds:
        raise _Malformed(
            "has no thread_core.creds: CRIU would leave the thread with its own (root) "
            "credentials or read them from elsewhere"
        )
    return creds


def _entries(data: bytes, position: int) -> Iterator[bytes]:
    """CRIU's entries: each a little-endian uint32 length, then that many bytes."""
    while position < len(data):
        if position + 4 > len(data):
            raise _Malformed("is truncated: an entry's length is cut short")
        (length,) = struct.unpack_from("<I", data, position)
        position += 4
        if position + length > len(data):
            raise _Malformed("is truncated: an entry runs past the end of the file")
        yield data[position : position + length]
        position += length


def _decode_creds(message: bytes) -> Creds:
    scalars: dict[str, int] = {}
    lists: dict[str, list[int]] = {name: [] for name in _CREDS_LISTS.values()}
    for number, wire_type, value in _fields(message):
        if number in _CREDS_SCALARS:
            if wire_type != _VARINT:
                raise _Malformed(f"has creds.{_CREDS_SCALARS[number]} in the wrong encoding")
            # A later copy of a field replaces an earlier one, as in protobuf.
            scalars[_CREDS_SCALARS[number]] = _uint32(value)
        elif number in _CREDS_LISTS:
            words = lists[_CREDS_LISTS[number]]
            if wire_type == _VARINT:  # a repeated field written one value at a time
                words.append(_uint32(value))
            elif isinstance(value, bytes):  # packed: the values back to back, no keys
                position = 0
                while position < len(value):
                    word, position = _varint(value, position)
                    words.append(_uint32(word))
            else:
                raise _Malformed(f"has creds.{_CREDS_LISTS[number]} in the wrong encoding")
    # Required in creds.proto: protobuf-c refuses a creds message without them, so CRIU
    # would too; refusing here keeps the two in step.
    missing = [name for name in _CREDS_SCALARS.values() if name not in scalars]
    if missing:
        raise _Malformed(f"has creds without {', '.join(missing)}")
    return Creds(
        uid=scalars["uid"], gid=scalars["gid"], euid=scalars["euid"], egid=scalars["egid"],
        suid=scalars["suid"], sgid=scalars["sgid"],
        fsuid=scalars["fsuid"], fsgid=scalars["fsgid"],
        cap_inh=tuple(lists["cap_inh"]), cap_prm=tuple(lists["cap_prm"]),
        cap_eff=tuple(lists["cap_eff"]), cap_bnd=tuple(lists["cap_bnd"]),
        cap_amb=tuple(lists["cap_amb"]),
        secbits=scalars["secbits"], groups=tuple(lists["groups"]),
    )  # fmt: skip


def _uint32(value: int | bytes) -> int:
    # protobuf-c keeps the low 32 bits of a larger number: 2**32 would read as uid 0.
    if isinstance(value, bytes) or value > _UINT32_MAX:
        raise _Malformed("has a credential that is no 32-bit number")
    return value


def _messages(message: bytes, number: int) -> list[bytes]:
    """Every copy of embedded message field ``number``: protobuf merges them all."""
    found = []
    for field_number, _, value in _fields(message):
        if field_number == number:
            if not isinstance(value, bytes):
                raise _Malformed(f"has field {number} in the wrong encoding")
            found.append(value)
    return found


def _fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """A protobuf message's fields in order: (field number, wire type, value).

    A varint or fixed-size value comes as an int, a length-delimited one as its bytes.
    """
    position = 0
    while position < len(message):
        key, position = _varint(message, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise _Malformed("is corrupt: a protobuf field numbered 0")
        value: int | bytes
        if wire_type == _VARINT:
            value, position = _varint(message, position)
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            if position + size > len(message):
                raise _Malformed("is truncated: a protobuf field is cut short")
            value = int.from_bytes(message[position : position + size], "little")
            position += size
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(message, position)
            if position + length > len(message):
                raise _Malformed("is truncated: a protobuf field is cut short")
            value = message[position : position + length]
            position += length
        else:
            raise _Malformed(f"is corrupt: protobuf wire type {wire_type}")
        yield number, wire_type, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The base-128 number at ``position`` (7 bits a byte, low first), and where it ends."""
    value = 0
    for shift in range(0, 70, 7):  # protobuf's varints are at most 10 bytes long
        if position >= len(data):
            raise _Malformed("is truncated: a protobuf number is cut short")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
    raise _Malformed("is corrupt: a protobuf number longer than 10 bytes")
