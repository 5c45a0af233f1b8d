"""The caller's checks, run by the engine of each of their operations as its last hook:
right before criu, refuse a tree or an image whose processes are not (or would not be)
the caller's own unprivileged ones (CRIU restores credentials from the image), and keep
criu from resolving, as root, the paths of the caller's kernel (``files``)."""

from __future__ import annotations

import asyncio
import os
import stat

from ..core import procfs
from ..core.errors import InvalidRequest
from ..core.file_access import FileAccess
from ..core.hooks import RestoreContext, SaveContext, SnapshotHook
from ..core.safe_fs import kind_of
from ..core.user_paths import UserPath
from .credentials import in_images
from .credentials.ownership import Caller, PodCaller, require_own_tree
from .files import dump_externals, opener, restore_plan
from .files.restore_plan import Opening

# The manifest's section of the files dumped as external: criu's key -> path.
EXTERNAL_FILES = "external_files"
# The manifest's section of the device and inode of each of them and of each working
# directory at the save, by path.
PATH_IDENTITIES = "path_identities"
_MOVED_HINT = ("put the directory back where it was (the kernel's own, not a copy), or "
               "start a new kernel there")


class CallerCredentials(SnapshotHook):
    """Refuses, right before criu runs, a tree or an image whose processes are not (or would
    not be) the caller's own unprivileged ones: CRIU restores credentials from the image.

    The check before a dump repeats the one ``op_save`` made before the engine's preflight,
    closer to the moment criu freezes the tree (the hook runs last); what is left of the
    window is said in ``credentials/ownership``. Made for one operation of one caller
    (``realms.engine_launch``)."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        # The working directories the caller's helper opened before criu ran: the
        # identities criu must have found.
        self._directories: dict[tuple[int, int], str] = {}

    async def before_dump(self, ctx: SaveContext) -> None:
        await asyncio.to_thread(require_own_tree, ctx.root_pid, self.caller)
        # Every file of the tree dumped as external: the restore then opens none by its
        # path as root (files/dump_externals, files/restore_plan).
        found = await asyncio.to_thread(dump_externals.external_files, ctx.root_pid)
        ctx.criu.externals = sorted(found.paths)
        ctx.manifest[EXTERNAL_FILES] = found.paths
        ctx.manifest[PATH_IDENTITIES] = found.identities

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        # An image the agent could never restore is refused now, while the kernel still
        # runs (the save rolls back), not at the restore. A stopping dump has ended the
        # kernel: its image is kept, and the restore names what it cannot reopen.
        if error is None and not ctx.stop:
            try:
                await asyncio.to_thread(restore_plan.plan_openings, ctx.images_dir,
                                        ctx.manifest.get(EXTERNAL_FILES) or {})
            except InvalidRequest as refused:
                raise InvalidRequest(
                    "save", f"the node agent could not restore this kernel: {refused.cause}",
                    hint=refused.hint) from None

    async def before_restore(self, ctx: RestoreContext) -> None:
        assert ctx.images_dir is not None
        await asyncio.to_thread(
            in_images.check_image_credentials, ctx.images_dir, self.caller)
        manifest = ctx.snapshot.manifest
        recorded = manifest.get(EXTERNAL_FILES)
        plan = await asyncio.to_thread(
            restore_plan.plan_openings, ctx.images_dir,
            recorded if isinstance(recorded, dict) else {})
        identities = manifest.get(PATH_IDENTITIES)
        # A new pod is a new container: its files are others than the old pod's, whatever
        # their paths. There only the caller's own opening decides.
        expected = (identities if isinstance(identities, dict)
                    and not isinstance(self.caller, PodCaller) else {})
        self._directories = await asyncio.to_thread(
            _open_directories, plan.working_directories, ctx.files, expected)
        # criu, root, opens none of the paths of the caller's files: they are opened as
        # the caller (files/opener) and handed to it.
        opened = await asyncio.to_thread(opener.open_for_criu, plan.openings, ctx.files)
        try:
            _require_files_or_directories(opened, plan.openings)
            for opening in plan.openings:
                if opening.executable:
                    _require_identity(opened[opening.key], opening.path,
                                      expected.get(opening.path), "executable")
        except BaseException:
            for fd in opened.values():
                os.close(fd)
            raise
        for key, fd in opened.items():
            # The caller's opening stands for the file, whoever else offered one.
            replaced = ctx.criu.inherited_fds.pop(key, None)
            if replaced is not None:
                os.close(replaced)
            ctx.criu.inherited_fds[key] = fd
        # criu names each by its descriptor; its errors are told by its path.
        ctx.criu.file_names.update({o.key: o.path for o in plan.openings})

    async def before_resume(self, ctx: RestoreContext) -> None:
        """criu looked each working directory up by its path, in the restored mount
        namespace; refuse the tree (before it runs, where criu left it stopped) unless
        each process sits in a directory the caller's helper opened just before."""
        await asyncio.to_thread(_require_directories, ctx.root_pid, self._directories)


def _open_directories(paths: list[str], files: FileAccess,
                      expected: dict[str, object]) -> dict[tuple[int, int], str]:
    """Each working directory, opened as the caller (``O_PATH``: nothing planted there
    can hold the open) and refused unless a directory with the recorded device and inode
    (where recorded); the identities found, by (device, inode)."""
    found: dict[tuple[int, int], str] = {}
    for path in paths:
        try:
            fd = files.open(path, os.O_PATH | os.O_DIRECTORY, UserPath.WORKING_DIRECTORY)
        except OSError as error:
            raise InvalidRequest(
                "restore", f"the kernel's working directory {path} cannot be opened as you: "
                f"{error.strerror}", hint=_MOVED_HINT) from None
        try:
            info = _require_identity(fd, path, expected.get(path), "working directory")
        finally:
            os.close(fd)
        found[(info.st_dev, info.st_ino)] = path
    return found


def _require_identity(fd: int, path: str, recorded: object, what: str) -> os.stat_result:
    """What ``fd`` is; refused unless it is (a directory, for a working directory) the
    file of the recorded ``[device, inode]``, where one is recorded."""
    info = os.fstat(fd)
    if what == "working directory" and not stat.S_ISDIR(info.st_mode):
        raise InvalidRequest("restore", f"the kernel's working directory {path} is no "
                             "directory now", hint=_MOVED_HINT)
    if (isinstance(recorded, list) and len(recorded) == 2
            and [info.st_dev, info.st_ino] != recorded):
        raise InvalidRequest(
            "restore", f"the kernel's {what} {path} is another file than at the save "
            "(moved, replaced or linked elsewhere)",
            hint=_MOVED_HINT if what == "working directory" else "put the kernel's "
            "environment back as it was at the save, then restore again")
    return info


def _require_directories(root_pid: int, directories: dict[tuple[int, int], str]) -> None:
    for proc in procfs.tree(root_pid):
        # The process's working directory itself, through its magic link in /proc.
        info = os.stat(f"/proc/{proc.pid}/cwd")
        if (info.st_dev, info.st_ino) not in directories:
            raise InvalidRequest(
                "restore", f"process {proc.pid} of the restored kernel is in another "
                "working directory than the one you could open "
                f"({', '.join(sorted(directories.values())) or 'none'}): it was moved or "
                "replaced during the restore", hint=_MOVED_HINT)


def _require_files_or_directories(opened: dict[str, int], openings: list[Opening]) -> None:
    """Refuse openings that are no regular file or directory, which is all a kernel's
    external files are at its save (``dump_externals``): criu reopens each through its
    descriptor without ``O_NONBLOCK``, and a FIFO put in a file's place would hold it (and
    the restore) for good. The caller closes the descriptors."""
    for opening in openings:
        fd = opened.get(opening.key)
        if fd is None:
            continue
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise InvalidRequest(
                "restore", f"the kernel had {opening.path} open as a file; it is "
                f"{kind_of(mode)} now", hint="put the file back where it was")
