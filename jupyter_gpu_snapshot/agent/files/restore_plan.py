"""What ``criu restore`` would open for an image, and how the node agent hands it over.

criu opens a restored process's files and mappings again, and follows links. Run as root
for a user, opening a path the user controls would let a file of theirs swapped for a link
to a root-only file come back open, readable and writable (docs/cluster.md). So the agent
has criu dump every regular file and directory of the tree as external
(``dump_externals``): the image holds criu's key for it, ``file[MNT:INODE]``, the signed
manifest its path. Before a restore, ``plan_openings`` lists what criu will need: one
opening per key, with the access its every use needs, which a helper running as the caller
makes (``opener``) and criu takes through ``--inherit-fd``, reopening it through
``/proc`` with each file's own flags and position.

What criu may still open by path, as root: each process's root, which must be ``/`` (the
root of its own mount namespace, which no user can swap), its working directory (looked up
with ``O_PATH`` inside the restored mount namespace, where no descriptor from outside could
serve: the caller opens it first and the restore checks what criu found before the tree
runs, ``caller_hook``), device files under ``/dev`` (no user can create one) and the
kernel's own ``/proc`` (criu mounts it afresh for the restored PID namespace). Anything
else named by its path is refused, as is what criu would create or open by path as root:

- deleted files kept open (ghost files and link remaps): criu creates them again, as root,
  in the directory the file was in;
- Unix sockets bound to or connected by a path: criu binds and connects by that path;
- FIFOs, terminals and files of other types that criu opens by path.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidRequest
from ...core.user_paths import UserPath
from ..credentials.criu_wire import (
    FILES_MAGIC,
    FS_MAGIC,
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
_REG_ID, _REG_FLAGS, _REG_NAME, _REG_EXT, _REG_MODE = 1, 2, 6, 9, 10
# images/fs.proto
_FS_CWD_ID, _FS_ROOT_ID = 1, 2
# images/mm.proto and vma.proto, and criu/include/image.h's VMA status bits
_MM_EXE_FILE_ID, _MM_VMAS = 12, 14
_VMA_SHMID, _VMA_PROT, _VMA_FLAGS, _VMA_STATUS, _VMA_FDFLAGS = 4, 5, 6, 7, 10
_VMA_AREA_REGULAR, _VMA_FILE_PRIVATE, _VMA_FILE_SHARED = 1 << 0, 1 << 6, 1 << 7
_VMA_AREA_MEMFD, _VMA_EXT_PLUGIN = 1 << 14, 1 << 27
_PROT_WRITE, _MAP_SHARED = 2, 1
# images/sk-unix.proto
_UNIX_NAME = 11

_HINT_CLOSE = "close it in the kernel (or let the kernel open it again after the restore), "


@dataclass(frozen=True)
class ReopenedFile:
    """One regular file (or directory) of the image that criu would open."""

    id: int
    name: str  # the path as the dump recorded it, or criu's key of an external file
    external: bool
    flags: int  # the open(2) flags it had
    mode: int | None  # st_mode at the dump, where recorded


def files_to_reopen(images_dir: Path) -> list[ReopenedFile]:
    """Every regular file of the image in ``images_dir`` that criu would open.

    Raises :class:`InvalidRequest` if the image holds anything else criu would create or
    open by path as root, or cannot be read as CRIU writes it."""
    _refuse_remaps(images_dir)
    data = read_image(images_dir / "files.img", _MAX_FILES_IMAGE_BYTES)
    entries = image_entries(data, FILES_MAGIC, "files")
    return [f for f in (_file(entry) for entry in entries) if f is not None]


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
        elif number in (_REG_ID, _REG_FLAGS, _REG_EXT, _REG_MODE):
            if wire_type != VARINT or isinstance(value, bytes):
                raise MalformedImage(f"has reg_file_entry field {number} in the wrong encoding")
            scalars[number] = value
    if name is None or _REG_ID not in scalars or _REG_FLAGS not in scalars:
        raise MalformedImage("has a regular file entry without its id, flags or name")
    text = name.decode("utf-8", errors="surrogateescape")
    external = bool(scalars.get(_REG_EXT))
    if "\0" in text or not text.startswith("file[" if external else "/"):
        raise MalformedImage(f"has a file name criu would not write: {text!r}")
    mode = scalars.get(_REG_MODE)
    return ReopenedFile(
        id=uint32(scalars[_REG_ID]), name=text, external=external,
        flags=uint32(scalars[_REG_FLAGS]), mode=None if mode is None else uint32(mode),
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
    """One file the agent opens as the caller and hands to criu under ``key``, criu's name
    of an external file; criu reopens it for each of its uses with that use's own flags.
    ``executable``: some process's executable, whose identity the restore checks."""

    key: str
    path: str
    flags: int
    executable: bool = False
    mapped: bool = False

    @property
    def what(self) -> UserPath:
        if self.executable:
            return UserPath.EXECUTABLE
        return UserPath.MAPPED_FILE if self.mapped else UserPath.OPEN_FILE


@dataclass(frozen=True)
class RestorePlan:
    """What a restore of an image needs of the caller's files: the ``openings`` to hand
    criu, and the ``working_directories`` criu looks up by path (each checked)."""

    openings: list[Opening]
    working_directories: list[str]


_READS, _WRITES = (os.O_RDONLY, os.O_RDWR), (os.O_WRONLY, os.O_RDWR)


def plan_openings(images_dir: Path, external_paths: dict[str, str]) -> RestorePlan:
    """What criu needs for the image in ``images_dir``; ``external_paths`` maps criu's key
    of each external file to its path (the signed manifest's).

    Raises :class:`InvalidRequest` for what the agent does not restore: a file named by a
    path criu would open as root, a root other than ``/``, an external file without a
    recorded path, and what ``files_to_reopen`` refuses."""
    try:
        files = files_to_reopen(images_dir)
        mapped = _mapping_access(images_dir)
        cwds, roots = _task_directories(images_dir)
        executables = _executables(images_dir)
    except MalformedImage as error:
        raise InvalidRequest(
            "restore", f"an image file {error}",
            hint="the snapshot's images are damaged; restore another snapshot") from None
    needs: dict[str, list[int]] = {}
    executable_keys: set[str] = set()
    mapped_keys: set[str] = set()
    directories: list[str] = []
    for found in files:
        if not found.external:
            if found.id in roots and found.name != "/":
                raise InvalidRequest(
                    "restore", f"a process of the kernel had {found.name} as its root "
                    "(chroot); the node agent restores only processes rooted at /",
                    hint="save a kernel that does not chroot")
            if found.id in cwds:
                if found.name not in directories:
                    directories.append(found.name)
            elif found.id not in roots and not _left_to_criu(found):
                raise InvalidRequest(
                    "restore", f"the image names {found.name} by its path, which criu "
                    "would open as root; the node agent has criu open only what you can",
                    hint="save the kernel again (a file it opened during the save itself "
                    "is named so), then restore that snapshot")
            continue
        if found.id in executables:
            executable_keys.add(found.name)
        if found.id in mapped:
            mapped_keys.add(found.name)
        access = mapped.get(found.id, found.flags)
        needs.setdefault(found.name, []).append(access)
    openings = []
    for key, accesses in needs.items():
        path = external_paths.get(key)
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidRequest(
                "restore", f"the snapshot does not record which file {key} was",
                hint="the snapshot's manifest is incomplete; restore another snapshot")
        openings.append(Opening(key, path, _widest(accesses), key in executable_keys,
                                key in mapped_keys))
    return RestorePlan(openings, directories)


def _widest(accesses: list[int]) -> int:
    """One opening that every use may be reopened from: all of them need its access."""
    if all(a & os.O_PATH for a in accesses):
        return os.O_PATH
    modes = {a & os.O_ACCMODE for a in accesses if not a & os.O_PATH}
    reads, writes = bool(modes & set(_READS)), bool(modes & set(_WRITES))
    return os.O_RDWR if reads and writes else os.O_WRONLY if writes else os.O_RDONLY


def _left_to_criu(found: ReopenedFile) -> bool:
    """Opened by criu by its path, as root, harmlessly: the kernel's own /proc (mounted
    afresh by criu), and device files under /dev, which no user can create."""
    path = found.name
    if path == "/proc" or path.startswith("/proc/"):
        return True
    is_device = found.mode is not None and (stat.S_ISCHR(found.mode) or stat.S_ISBLK(found.mode))
    return is_device and path.startswith("/dev/")


def _task_directories(images_dir: Path) -> tuple[set[int], set[int]]:
    """The file ids of every task's working directory, and of every task's root."""
    cwds: set[int] = set()
    roots: set[int] = set()
    for fs_image in sorted(images_dir.glob("fs-*.img")):
        for entry in image_entries(read_image(fs_image, _MAX_FILES_IMAGE_BYTES), FS_MAGIC, "fs"):
            for number, wire_type, value in fields(entry):
                if wire_type == VARINT and number in (_FS_CWD_ID, _FS_ROOT_ID):
                    (cwds if number == _FS_CWD_ID else roots).add(uint32(value))
    return cwds, roots


def _executables(images_dir: Path) -> set[int]:
    """The file ids of every task's executable."""
    ids: set[int] = set()
    for mm_image in sorted(images_dir.glob("mm-*.img")):
        for entry in image_entries(read_image(mm_image, _MAX_FILES_IMAGE_BYTES), MM_MAGIC, "mm"):
            ids |= {uint32(v) for n, t, v in fields(entry)
                    if n == _MM_EXE_FILE_ID and t == VARINT}
    return ids


def _mapping_access(images_dir: Path) -> dict[int, int]:
    """The file ids of the image's file mappings, each with the access criu opens it with
    (the mapping's own flags, or criu's guess where the image has none)."""
    access: dict[int, int] = {}
    for mm_image in sorted(images_dir.glob("mm-*.img")):
        data = read_image(mm_image, _MAX_FILES_IMAGE_BYTES)
        for entry in image_entries(data, MM_MAGIC, "mm"):
            for vma in messages(entry, _MM_VMAS):
                _add_mapping(vma, access)
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
    previous = access.get(file_id, flags)
    access[file_id] = _widest([previous, flags])
