"""What ``criu restore`` would open by path, read from an image, and whether the node agent
can hand each to criu opened as the caller instead.

CRIU reopens a restored process's regular files, mappings, working directory, root and
executable by the paths they had at the dump, and it follows links. Run as root for a user,
that resolves paths the user controls with root's privileges: a file of the user's swapped
for a link to a root-only file between the save and the restore comes back open, readable
and writable (docs/cluster.md). So the agent resolves none of them as root: it opens every
one as the caller (``open_as_caller``) and hands criu the descriptors (``--inherit-fd``,
keyed by the path criu would have opened, which CRIU consults before it opens anything).

Everything else in an image that criu would create or open by path as root is refused here,
before criu runs:

- deleted files kept open (ghost files and link remaps): criu creates them again, as root,
  in the directory the file was in;
- Unix sockets bound to or connected by a path: criu binds and connects by that path;
- FIFOs, terminals and files of other types that criu opens by path.

Files on the kernel's own /proc are left to criu: that /proc is the one criu mounts for the
restored PID namespace, where the caller can plant nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidRequest
from .criu_wire import (
    FILES_MAGIC,
    MM_MAGIC,
    REMAP_FPATH_MAGIC,
    VARINT,
    MalformedImage,
    fields,
    image_entries,
    messages,
    read_image,
    uint32,
)

# files.img holds one entry per open file of the tree: a few hundred bytes each.
_MAX_FILES_IMAGE_BYTES = 64 << 20

# images/fdinfo.proto: file_entry's fields and fd_types.
_FILE_TYPE, _FILE_REG, _FILE_UNIXSK = 1, 3, 16
_FD_REG, _FD_UNIXSK = 1, 5
# Types whose restore opens nothing by path, or opens it from the image's own data.
_FD_TYPES_WITHOUT_PATHS = {
    2: "pipe", 4: "inet socket", 6: "eventfd", 7: "eventpoll", 8: "inotify", 9: "signalfd",
    12: "fanotify", 13: "netlink socket", 17: "timerfd", 18: "memfd", 19: "BPF map",
    20: "pidfd",
}  # fmt: skip
_FD_TYPES_REFUSED = {
    3: "FIFO", 10: "packet socket", 11: "terminal", 14: "namespace file", 15: "tun device",
    16: "external file",
}  # fmt: skip

# images/regfile.proto
_REG_ID, _REG_FLAGS, _REG_POS, _REG_NAME, _REG_MNT_ID, _REG_SIZE, _REG_MODE = 1, 2, 3, 6, 7, 8, 10
# images/mm.proto and vma.proto, and criu/include/image.h's VMA status bits
_MM_VMAS = 14
_VMA_SHMID, _VMA_PROT, _VMA_FLAGS, _VMA_STATUS, _VMA_FDFLAGS = 4, 5, 6, 7, 10
_VMA_AREA_REGULAR, _VMA_FILE_PRIVATE, _VMA_FILE_SHARED = 1 << 0, 1 << 6, 1 << 7
_VMA_AREA_MEMFD, _VMA_EXT_PLUGIN = 1 << 14, 1 << 27
_PROT_WRITE, _MAP_SHARED = 2, 1
# images/sk-unix.proto
_UNIX_NAME = 11

_HINT_CLOSE = "close it in the kernel (or let the kernel open it again after the restore), "


@dataclass(frozen=True)
class ReopenedFile:
    """One regular file (or directory) of the image that criu would open by path."""

    id: int
    path: str  # absolute, as the dump recorded it
    flags: int  # the open(2) flags it had
    pos: int
    size: int | None  # where recorded: criu refuses a file whose size changed
    mode: int | None  # st_mode at the dump, where recorded

    @property
    def criu_key(self) -> str:
        """The name criu looks the file up by in its ``--inherit-fd`` list: the path without
        its leading slash, ``.`` for the root directory (criu's ``collect_one_regfile``)."""
        return self.path[1:] or "."


def files_to_reopen(images_dir: Path) -> list[ReopenedFile]:
    """Every file criu would open by path to restore the image in ``images_dir``.

    Raises :class:`InvalidRequest` if the image holds anything else criu would create or
    open by path as root, or cannot be read as CRIU writes it."""
    try:
        _refuse_remaps(images_dir)
        data = read_image(images_dir / "files.img", _MAX_FILES_IMAGE_BYTES)
        entries = image_entries(data, FILES_MAGIC, "files")
        found = [f for f in (_file(entry) for entry in entries) if f is not None]
    except MalformedImage as error:
        raise InvalidRequest(
            "restore", f"files.img {error}",
            hint="the snapshot's images are damaged; restore another snapshot") from None
    return [f for f in found if not _on_own_proc(f.path)]


def _on_own_proc(path: str) -> bool:
    return path == "/proc" or path.startswith("/proc/")


def _file(entry: bytes) -> ReopenedFile | None:
    kind = None
    for number, wire_type, value in fields(entry):
        if number == _FILE_TYPE and wire_type == VARINT:
            kind = uint32(value)
    if kind is None:
        raise MalformedImage("has a file entry without a type")
    if kind == _FD_REG:
        regs = messages(entry, _FILE_REG)
        if len(regs) != 1:
            raise MalformedImage(f"has a regular file entry with {len(regs)} reg messages")
        return _regular_file(regs[0])
    if kind == _FD_UNIXSK:
        for socket_entry in messages(entry, _FILE_UNIXSK):
            _refuse_named_socket(socket_entry)
        return None
    if kind in _FD_TYPES_WITHOUT_PATHS:
        return None
    what = _FD_TYPES_REFUSED.get(kind, f"file of type {kind}")
    raise InvalidRequest(
        "restore", f"the kernel had a {what} open, which criu would open by its path as "
        "root; the node agent does not restore those for you",
        hint=_HINT_CLOSE + "then save it again")


def _regular_file(message: bytes) -> ReopenedFile:
    scalars: dict[int, int] = {}
    name: bytes | None = None
    for number, wire_type, value in fields(message):
        if number == _REG_NAME:
            if not isinstance(value, bytes):
                raise MalformedImage("has a file name in the wrong encoding")
            name = value
        elif number in (_REG_ID, _REG_FLAGS, _REG_POS, _REG_SIZE, _REG_MODE, _REG_MNT_ID):
            if wire_type != VARINT or isinstance(value, bytes):
                raise MalformedImage(f"has reg_file_entry field {number} in the wrong encoding")
            scalars[number] = value
    if name is None or _REG_ID not in scalars or _REG_FLAGS not in scalars:
        raise MalformedImage("has a regular file entry without its id, flags or name")
    path = name.decode("utf-8", errors="surrogateescape")
    if not path.startswith("/") or "\0" in path:
        raise MalformedImage(f"has a file name that is no absolute path: {path!r}")
    mode = scalars.get(_REG_MODE)
    return ReopenedFile(
        id=uint32(scalars[_REG_ID]), path=path, flags=uint32(scalars[_REG_FLAGS]),
        pos=scalars.get(_REG_POS, 0), size=scalars.get(_REG_SIZE),
        mode=None if mode is None else uint32(mode),
    )


def _refuse_named_socket(message: bytes) -> None:
    for number, _, value in fields(message):
        # An abstract name starts with a NUL byte and lives in no directory.
        if number == _UNIX_NAME and isinstance(value, bytes) and value and value[0] != 0:
            path = value.decode("utf-8", errors="replace")
            raise InvalidRequest(
                "restore", f"the kernel had a Unix socket at {path}, which criu would bind "
                "or connect by its path as root; the node agent does not restore those "
                "for you",
                hint=_HINT_CLOSE + "or use an abstract or TCP socket, then save it again")


def _refuse_remaps(images_dir: Path) -> None:
    ghosts = sorted(p.name for p in images_dir.glob("ghost-file-*.img"))
    remap_file = images_dir / "remap-fpath.img"
    remaps = (image_entries(read_image(remap_file, _MAX_FILES_IMAGE_BYTES),
                            REMAP_FPATH_MAGIC, "remap-fpath")
              if os.path.lexists(remap_file) else [])
    if ghosts or remaps:
        raise InvalidRequest(
            "restore", "the kernel held a deleted file open, which criu would create again "
            "as root in the directory it was in; the node agent does not restore those "
            "for you",
            hint="close deleted files in the kernel (temporary files, say) before you save "
            "it, then save it again")


@dataclass(frozen=True)
class Opening:
    """One file the agent opens as the caller and hands to criu under ``key``: every file
    of the image with that path is restored from this one opening."""

    key: str
    path: str
    flags: int
    pos: int | None  # None: no position to restore (O_PATH, or mapped only)
    size: int | None
    mode: int | None


# Flags that say nothing about how a file must be opened again.
_NOT_COMPARED = os.O_CLOEXEC | getattr(os, "O_LARGEFILE", 0)
_WRITE_ACCESS = (os.O_WRONLY, os.O_RDWR)


def plan_openings(images_dir: Path) -> list[Opening]:
    """The openings that stand for every file criu would open by path for this image.

    CRIU looks inherited files up by path, so all the files of one path share an opening:
    allowed where they were opened alike (every task's working directory, say) or only
    mapped; refused where they had different modes or positions, which one opening
    cannot restore."""
    files = files_to_reopen(images_dir)
    mapped = _mapping_access(images_dir)
    by_key: dict[str, list[ReopenedFile]] = {}
    for found in files:
        by_key.setdefault(found.criu_key, []).append(found)
    return [_opening(key, entries, mapped) for key, entries in by_key.items()]


def _opening(key: str, entries: list[ReopenedFile], mapped: dict[int, int]) -> Opening:
    path = entries[0].path
    opened = {(f.flags & ~_NOT_COMPARED, f.pos) for f in entries if f.id not in mapped}
    needs_write = any(mapped[f.id] & os.O_ACCMODE in _WRITE_ACCESS
                      for f in entries if f.id in mapped)
    if len(opened) > 1:
        raise _cannot_share(path, f"open {len(opened)} ways (different modes or positions)")
    if opened:
        ((flags, pos),) = opened
        access = flags & os.O_ACCMODE
        if len(opened) < len(entries) and (
                flags & os.O_PATH or access == os.O_WRONLY
                or (needs_write and access != os.O_RDWR)):
            raise _cannot_share(path, "both open and mapped, with different access")
        position: int | None = None if flags & os.O_PATH else pos
    else:
        flags, position = (os.O_RDWR if needs_write else os.O_RDONLY), None
    size = next((f.size for f in entries if f.size is not None), None)
    mode = next((f.mode for f in entries if f.mode is not None), None)
    return Opening(key, path, flags & ~os.O_CLOEXEC, position, size, mode)


def _cannot_share(path: str, how: str) -> InvalidRequest:
    return InvalidRequest(
        "restore", f"the kernel had {path} {how}; the node agent restores each file "
        "through one opening made as you",
        hint="close the extra openings of that file in the kernel, then save it again")


def _mapping_access(images_dir: Path) -> dict[int, int]:
    """The file ids of the image's file mappings, each with the access criu opens it with
    (the mapping's own flags, or criu's guess where the image has none)."""
    access: dict[int, int] = {}
    try:
        for mm_image in sorted(images_dir.glob("mm-*.img")):
            data = read_image(mm_image, _MAX_FILES_IMAGE_BYTES)
            for entry in image_entries(data, MM_MAGIC, "mm"):
                for vma in messages(entry, _MM_VMAS):
                    _add_mapping(vma, access)
    except MalformedImage as error:
        raise InvalidRequest(
            "restore", f"an mm image {error}",
            hint="the snapshot's images are damaged; restore another snapshot") from None
    return access


def _add_mapping(vma: bytes, access: dict[int, int]) -> None:
    values: dict[int, int] = {}
    for number, wire_type, value in fields(vma):
        if number in (_VMA_SHMID, _VMA_PROT, _VMA_FLAGS, _VMA_STATUS, _VMA_FDFLAGS):
            if wire_type != VARINT or isinstance(value, bytes):
                raise MalformedImage(f"has vma_entry field {number} in the wrong encoding")
            values[number] = value
    status = values.get(_VMA_STATUS, 0)
    if (not status & _VMA_AREA_REGULAR
            or not status & (_VMA_FILE_PRIVATE | _VMA_FILE_SHARED)
            or status & (_VMA_AREA_MEMFD | _VMA_EXT_PLUGIN)):
        return
    if _VMA_FDFLAGS in values:
        flags = uint32(values[_VMA_FDFLAGS])
    elif values.get(_VMA_PROT, 0) & _PROT_WRITE and values.get(_VMA_FLAGS, 0) & _MAP_SHARED:
        flags = os.O_RDWR  # criu's collect_filemap guesses so
    else:
        flags = os.O_RDONLY
    file_id = values.get(_VMA_SHMID, -1)
    previous = access.get(file_id, os.O_RDONLY)
    access[file_id] = os.O_RDWR if os.O_RDWR in (flags & os.O_ACCMODE, previous) else flags
