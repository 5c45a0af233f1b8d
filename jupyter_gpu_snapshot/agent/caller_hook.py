"""The caller's checks, run by the engine of each of their operations as its last hook:
right before criu, refuse a tree or an image whose processes are not (or would not be)
the caller's own unprivileged ones (CRIU restores credentials from the image), and keep
criu from opening by path, as root, the files of the caller's kernel (``files``)."""

from __future__ import annotations

import asyncio
import os

from ..core.errors import InvalidRequest
from ..core.hooks import RestoreContext, SaveContext, SnapshotHook
from .credentials import in_images
from .credentials.ownership import Caller, PodCaller, require_own_tree
from .files import dump_externals, opener, restore_plan

# The manifest's section of the files dumped as external: criu's key -> path.
EXTERNAL_FILES = "external_files"


class CallerCredentials(SnapshotHook):
    """Refuses, right before criu runs, a tree or an image whose processes are not (or would
    not be) the caller's own unprivileged ones: CRIU restores credentials from the image.

    The check before a dump repeats the one ``op_save`` made before the engine's preflight,
    closer to the moment criu freezes the tree (the hook runs last); what is left of the
    window is said in ``credentials/ownership``. Made for one operation of one caller
    (``realms.engine_launch``)."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    async def before_dump(self, ctx: SaveContext) -> None:
        await asyncio.to_thread(require_own_tree, ctx.root_pid, self.caller)
        # Every file of the tree dumped as external: the restore then opens none by its
        # path as root (files/dump_externals, files/restore_plan).
        found = await asyncio.to_thread(dump_externals.external_files, ctx.root_pid)
        ctx.criu.externals = sorted(found)
        ctx.manifest[EXTERNAL_FILES] = found

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
        # criu, root, opens none of the paths of the caller's files: they are opened as
        # the caller and handed to it (files/opener).
        recorded = ctx.snapshot.manifest.get(EXTERNAL_FILES)
        openings = await asyncio.to_thread(
            restore_plan.plan_openings, ctx.images_dir,
            recorded if isinstance(recorded, dict) else {})
        # In a pod, each path is the caller's container's (its root, its links).
        root = (f"/proc/{self.caller.peer_pid}/root" if isinstance(self.caller, PodCaller)
                else None)
        opened = await asyncio.to_thread(
            opener.open_for_criu, openings, self.caller, root=root)
        for key, fd in opened.items():
            # The caller's opening stands for the file, whoever else offered one.
            replaced = ctx.criu.inherited_fds.pop(key, None)
            if replaced is not None:
                os.close(replaced)
            ctx.criu.inherited_fds[key] = fd
