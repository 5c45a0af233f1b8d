"""Files a kernel has open or mapped, which a CRIU image does not hold, and so a restore
could get wrong without a word.

At save (``OpenFilesHook.preflight_save``), from ``/proc/PID/maps`` and ``/proc/PID/fd`` of
every process of the tree:
- file-backed shared mappings (``np.memmap``): the image holds no content; a writable one
  shows, after a restore, the writes made after the save: a warning;
- files in ``/dev/shm`` (POSIX semaphores and shared memory, ``dev_shm``): named ones are
  not in the image, one warning per kind says what a restore needs of them; unlinked ones
  are carried in the image up to ``ghost_limit``; ones criu cannot dump refuse the save;
- regular files open read-only, and shared mappings: size and mtime (and the sha256 of small
  ones) are recorded in the manifest as ``open_files``;
- deleted files still open: criu carries their content only up to ``ghost_limit``; a larger
  one is refused before the kernel is touched, naming the setting.

At restore (``preflight_restore``), a recorded file that changed since the save refuses the
restore, or with ``changed_files="warn"`` lets it go on with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from .._constants import format_bytes
from . import procfs
from .dev_shm import DEV_SHM, ShmFiles
from .errors import NotReady
from .file_access import OWN_FILES, FileAccess
from .hooks import Progress, RestoreContext, SaveContext, SnapshotHook
from .user_paths import UserPath

# Files up to this size also get a digest: a same-size, same-mtime change is then caught.
DIGEST_LIMIT = 1 << 20
DELETED = " (deleted)"
# Not files a user changes: device and kernel interfaces, and anonymous memory (memfd, which
# the CUDA driver uses and criu dumps whole).
SYSTEM_PREFIXES = ("/dev/", "/proc/", "/sys/", "/memfd:", "/SYSV")
# The system's own files (glibc maps gconv-modules.cache shared): an upgrade must not make
# every snapshot unrestorable; criu checks what it maps from there itself.
OS_PREFIXES = ("/usr/", "/lib/", "/lib64/", "/etc/", "/var/cache/")


@dataclass
class KernelFiles:
    """What the tree of one kernel has open or mapped that the image will not hold."""

    shared_writable: set[str] = field(default_factory=set)
    shared_memory: ShmFiles = field(default_factory=ShmFiles)
    recorded: set[str] = field(default_factory=set)  # read-only fds and shared mappings
    deleted: dict[str, int] = field(default_factory=dict)  # path -> bytes

    def warnings(self) -> list[str]:
        found = [
            f"{path} is mapped shared and writable (np.memmap 'r+' or 'w+'?): the snapshot "
            "does not hold its content, and a restore sees the file as it is then, later "
            "writes included"
            for path in sorted(self.shared_writable)
        ]
        return found + self.shared_memory.warnings()

    def ghosts(self) -> dict[str, int]:
        """The deleted files criu must carry in the image, and their bytes."""
        # A segment in /dev/shm counts by the bytes it holds: criu 4.2.1 dumped a 3 MiB
        # segment with one page written under a 1 MiB ghost limit, and refused it written.
        shm = {f.path: f.allocated for f in self.shared_memory.unlinked}
        return {**self.deleted, **shm}


def _read_only(pid: int, fd: str) -> bool:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE == os.O_RDONLY
    return False


def _mapped_bytes(pid: int, addresses: str) -> int:
    """Bytes the file behind a mapping holds (0 when /proc does not tell: not root)."""
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}/map_files/{addresses}").st_blocks * 512
    return 0


def inspect_files(root_pid: int, files: FileAccess = OWN_FILES) -> KernelFiles:
    """What the tree under ``root_pid`` has open or mapped, from /proc; its /dev/shm read
    through ``files``."""
    found = KernelFiles()
    for proc in procfs.tree(root_pid):
        pid = proc.pid
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or parts[1][3] != "s" or not parts[5].startswith("/"):
                    continue
                path = parts[5].rstrip("\n")
                if path.startswith(DEV_SHM):
                    major, minor = (int(n, 16) for n in parts[3].split(":"))
                    found.shared_memory.add(
                        pid, path, (os.makedev(major, minor), int(parts[4])),
                        _mapped_bytes(pid, parts[0]),
                    )
                elif not path.endswith(DELETED) and not path.startswith(
                    (*SYSTEM_PREFIXES, *OS_PREFIXES)
                ):
                    found.recorded.add(path)
                    if "w" in parts[1]:
                        found.shared_writable.add(path)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError, ValueError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if not target.startswith("/"):
                        continue  # sockets, pipes, anon inodes
                    info = os.stat(f"/proc/{pid}/fd/{fd}")
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if target.startswith(DEV_SHM):
                        found.shared_memory.add(
                            pid, target, (info.st_dev, info.st_ino), info.st_blocks * 512
                        )
                    elif target.startswith(SYSTEM_PREFIXES):
                        continue
                    elif target.endswith(DELETED):
                        found.deleted[target.removesuffix(DELETED)] = info.st_size
                    elif _read_only(pid, fd) and not target.startswith(OS_PREFIXES):
                        found.recorded.add(target)
    found.shared_memory.resolve(files)
    return found


def describe_file(path: str, files: FileAccess = OWN_FILES) -> dict[str, Any] | None:
    """Size, mtime and (for small regular files) sha256 of a file, or None when it is gone
    or cannot be opened by ``files`` (as the kernel's user, for the node agent)."""
    try:
        fd = files.open(path, os.O_RDONLY, UserPath.OPEN_FILE)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        entry: dict[str, Any] = {
            "path": path, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
        # Only a regular file is read: a FIFO or a device opened without waiting stays so.
        if stat.S_ISREG(info.st_mode) and info.st_size <= DIGEST_LIMIT:
            with contextlib.suppress(OSError):
                entry["sha256"] = hashlib.sha256(file.read(DIGEST_LIMIT + 1)).hexdigest()
    return entry


def changes(recorded: list[dict[str, Any]], files: FileAccess = OWN_FILES) -> list[str]:
    """How each recorded file differs now (each opened by ``files``); empty when all are as
    they were."""
    found = []
    for entry in recorded:
        path = str(entry.get("path"))
        now = describe_file(path, files)
        if now is None:
            found.append(f"{path} is missing")
        elif now["size"] != entry.get("size"):
            found.append(f"{path} has {now['size']} bytes, {entry.get('size')} at the save")
        elif "sha256" in entry and now.get("sha256") != entry["sha256"]:
            found.append(f"{path} has other content than at the save")
        elif "sha256" not in entry and now["mtime_ns"] != entry.get("mtime_ns"):
            found.append(f"{path} was modified after the save")
    return found


class OpenFilesHook(SnapshotHook):
    """Records and checks the files a kernel depends on that its image does not hold."""

    name = "open-files"

    def __init__(self, ghost_limit: int = 1 << 20, changed_files: str = "refuse") -> None:
        self.ghost_limit = ghost_limit
        self.changed_files = changed_files

    async def preflight_save(self, ctx: SaveContext) -> None:
        """Called by ``SnapshotEngine.save`` before anything touches the kernel."""
        files = await asyncio.to_thread(inspect_files, ctx.root_pid, ctx.files)
        undumpable = files.shared_memory.refusal()
        if undumpable is not None:
            raise NotReady(
                "preflight",
                undumpable,
                hint="create the multiprocessing objects (and torch DataLoaders) with the "
                "'fork' start method: multiprocessing.get_context('fork'), "
                "DataLoader(multiprocessing_context='fork'); or let go of them (and end the "
                "processes that use them) before the save",
            )
        too_big = {p: n for p, n in files.ghosts().items() if n > self.ghost_limit}
        if too_big:
            path, size = max(too_big.items(), key=lambda item: item[1])
            raise NotReady(
                "preflight",
                f"the kernel holds a deleted file of {format_bytes(size)} ({path}); "
                f"criu carries deleted files only up to {format_bytes(self.ghost_limit)}",
                hint="close the file in the kernel, or raise c.GPUSnapshot.ghost_limit",
            )
        recorded = await asyncio.to_thread(lambda: [
            e for p in sorted(files.recorded)
            if (e := describe_file(p, ctx.files)) is not None])
        warnings = files.warnings()
        ctx.manifest["open_files"] = recorded
        ctx.manifest["warnings"] = [*ctx.manifest.get("warnings", []), *warnings]
        for warning in warnings:
            ctx.report(Progress("preflight", message=f"warning: {warning}"))

    async def preflight_restore(self, ctx: RestoreContext) -> None:
        """Called by ``SnapshotEngine.restore`` after the checksums, before criu runs."""
        recorded = ctx.snapshot.manifest.get("open_files") or []
        if not isinstance(recorded, list):
            return
        changed = await asyncio.to_thread(
            changes, [e for e in recorded if isinstance(e, dict)], ctx.files)
        if not changed:
            return
        what = "; ".join(changed)
        if self.changed_files == "warn":
            ctx.report(Progress(
                "preflight",
                message=f"warning: files the kernel had open changed since the save: {what}",
            ))
            return
        raise NotReady(
            "preflight",
            f"files the kernel had open changed since snapshot {ctx.snapshot.id}: {what}; "
            "the restored kernel would read the new content as if it were the old",
            hint="put the files back as they were",
            # For whoever runs the server, not the notebook's user: docs/server.md says it.
            details={"changed_files": changed,
                     "setting": "c.GPUSnapshot.changed_files = 'warn' restores anyway"},
        )
