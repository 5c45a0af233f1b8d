"""POSIX semaphores and shared memory segments (files in /dev/shm) that a kernel's processes
hold, and what criu does with each, as measured with CRIU 4.2.1:

- **unlinked** (no name left; multiprocessing's semaphores under the 'fork' start method,
  Linux's default before Python 3.14 and what torch DataLoader workers then use, and torch's
  tensors shared by file descriptor): criu carries them in the image as ghost files, the
  content and the sharing between the processes included, and a restore works with nothing
  of them left in /dev/shm, as after a reboot or on another node. Their bytes count against
  ``ghost_limit``.
- **named** (``multiprocessing.shared_memory``, torch's 'file_system' sharing strategy, a
  semaphore opened by name): the image holds only the name. A restore maps the file as it
  is then, later writes included, and fails while the file is missing. Such files outlive
  the kernel (measured: after a stopping save, and after a shutdown of the kernel) and are
  gone after a reboot, on another node, or once something unlinks them.
- **renamed** (the kernel maps the file under a temporary name removed since, while the
  file lives on under another name: glibc's ``sem_open`` creates every semaphore so, and
  multiprocessing's 'spawn' and 'forkserver' start methods keep the name): criu's dump
  fails ("Can't create link remap ... Use link-remap option"), so the save is refused
  before the kernel is touched.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .user_paths import OWN_OPENER, OpensUserPaths, UserPath

DEV_SHM = "/dev/shm/"
DELETED = " (deleted)"
# Names listed in a warning; the rest are counted.
SHOWN_NAMES = 3


# Who makes files named so: (name prefix, semaphores?, the pattern shown, the library).
KINDS = (
    ("sem.mp-", True, "sem.mp-*", "multiprocessing, which torch DataLoader workers use"),
    ("sem.", True, "sem.*", None),
    ("psm_", False, "psm_*", "multiprocessing.shared_memory"),
    ("torch_", False, "torch_*", "PyTorch tensors shared between processes"),
)


@dataclass(frozen=True)
class ShmKind:
    semaphore: bool
    pattern: str
    library: str | None

    def describe(self, files: list[ShmFile]) -> str:
        """``19 POSIX semaphores in /dev/shm (sem.mp-*, multiprocessing, ...) held by 3
        processes``."""
        what = "POSIX semaphore" if self.semaphore else "shared memory segment"
        source = f", {self.library}" if self.library else ""
        pids = len(set().union(*(f.pids for f in files)))
        return (
            f"{_count(len(files), what)} in /dev/shm ({self.pattern}{source}) held by "
            f"{_count(pids, 'process', 'processes')}"
        )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


@dataclass
class ShmFile:
    """One file of /dev/shm, however many processes map it or hold it open."""

    path: str  # as the kernel's processes see it, without " (deleted)"
    allocated: int  # bytes the file holds (criu's ghost limit counts these)
    pids: set[int] = field(default_factory=set)
    shown_deleted: bool = False  # some process holds it under a name removed since
    name: str | None = None  # where the file is now (``resolve``), None once no name is left

    @property
    def kind(self) -> ShmKind:
        base = Path(self.name or self.path).name
        for prefix, semaphore, pattern, library in KINDS:
            if base.startswith(prefix):
                return ShmKind(semaphore, pattern, library)
        return ShmKind(False, "*", None)


@dataclass
class ShmFiles:
    """The /dev/shm files of one kernel tree, by (device, inode)."""

    files: dict[tuple[int, int], ShmFile] = field(default_factory=dict)

    def add(self, pid: int, shown: str, key: tuple[int, int], allocated: int) -> None:
        """Called by ``open_files.inspect_files`` for each mapping and open fd of a file in
        /dev/shm, as /proc shows its path."""
        deleted = shown.endswith(DELETED)
        found = self.files.setdefault(key, ShmFile(shown.removesuffix(DELETED), allocated))
        if found.shown_deleted and not deleted:
            found.path = shown  # the name it lives under beats a temporary one
        found.shown_deleted |= deleted
        found.allocated = max(found.allocated, allocated)
        found.pids.add(pid)

    def resolve(self, files: OpensUserPaths = OWN_OPENER) -> None:
        """Called by ``open_files.inspect_files`` once every process was read: where each
        file lives now, in /dev/shm as ``files`` opens it (the kernel's user's, for the
        node agent). Read after the processes, so a file made meanwhile is not taken for
        an unlinked one."""
        names = names_in_dev_shm(files)
        for key, found in self.files.items():
            found.name = names.get(key)

    @property
    def unlinked(self) -> list[ShmFile]:
        return [f for f in self.files.values() if f.name is None]

    @property
    def named(self) -> list[ShmFile]:
        return [f for f in self.files.values() if f.name is not None and not f.shown_deleted]

    @property
    def renamed(self) -> list[ShmFile]:
        return [f for f in self.files.values() if f.name is not None and f.shown_deleted]

    def warnings(self) -> list[str]:
        """One warning per kind of named file: what a restore needs of them."""
        groups: dict[ShmKind, list[ShmFile]] = defaultdict(list)
        for found in self.named:
            groups[found.kind].append(found)
        return [
            f"{kind.describe(files)}: the snapshot holds their names, not their content. A "
            "restore maps the files as they are then (writes made after the save show "
            "through) and fails while any is missing: they stay in /dev/shm after the kernel "
            "ends, but are gone after a reboot, on another node, or once something unlinks "
            f"them ({_listed(f.path for f in files)})"
            for kind, files in sorted(groups.items(), key=lambda item: item[0].pattern)
        ]

    def refusal(self) -> str | None:
        """Why criu cannot dump the tree, or None."""
        groups: dict[ShmKind, list[ShmFile]] = defaultdict(list)
        for found in self.renamed:
            groups[found.kind].append(found)
        if not groups:
            return None
        what = "; ".join(
            f"{kind.describe(files)} ({_listed(str(f.name) for f in files)})"
            for kind, files in sorted(groups.items(), key=lambda item: item[0].pattern)
        )
        return (
            f"{what}: the kernel maps them under temporary names removed since, while the "
            "files live on under the names listed (multiprocessing's 'spawn' and 'forkserver' "
            "start methods keep them); criu cannot dump such mappings"
        )


def _listed(paths: Iterable[str]) -> str:
    ordered = sorted(paths)
    more = len(ordered) - SHOWN_NAMES
    return ", ".join(ordered[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def names_in_dev_shm(files: OpensUserPaths = OWN_OPENER) -> dict[tuple[int, int], str]:
    """Every file of /dev/shm by (device, inode): where a renamed file lives on. The
    directory is opened by ``files`` (by default, this process) and read by its descriptor:
    each entry's inode comes with its name, so no path in it is looked up."""
    found: dict[tuple[int, int], str] = {}
    flags = os.O_RDONLY | os.O_DIRECTORY
    try:
        fd = files.open(DEV_SHM, flags, UserPath.DEV_SHM)
    except OSError:
        return found
    try:
        device = os.fstat(fd).st_dev
        with contextlib.suppress(OSError), os.scandir(fd) as entries:
            for entry in entries:
                found[(device, entry.inode())] = DEV_SHM + entry.name
    finally:
        os.close(fd)
    return found
