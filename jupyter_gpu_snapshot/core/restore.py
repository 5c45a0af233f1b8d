"""The restore sequence: how a snapshot becomes a running kernel again, in one place.

``restore_snapshot`` claims the snapshot in the store; ``_restore`` then takes these
steps, in order:

1. preflight  the manifest read again and authenticated; the kernel's ports free; this node
              can run it (``check_compatibility``); criu's version; hooks may refuse
              (``preflight_restore``: the GPU layer checks the driver and picks the GPUs)
2. restore    ``criu restore`` into a new PID namespace while every digest of the images is
              checked on all cores (``_restore_checked``), after the hooks'
              ``before_restore``. CUDA happens inside criu: the GPU layer's plugin restores
              each process (onto the chosen GPUs) and unlocks it before its threads run,
              once the digests matched. Without a plugin, criu leaves the tree stopped.
3. resume     the tree continued (where criu left it stopped); hooks' ``after_restore``
              (the GPU layer checks the processes run on the GPU)

If criu or a digest fails, the tree is killed before any code of the image ran, and the
hooks hear ``restore_failed``; if a hook fails at resume, the half-restored tree is killed.
The sequence runs shielded, as a save does (``finish_despite_cancel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import kernel_log, locks, procfs
from .background import run_in_background
from .compatibility import NodeCompatibility, refusal
from .errors import InvalidRequest, NotFound, PortsInUse, SnapshotError
from .file_access import OWN_FILES, FileAccess
from .hooks import Progress, ProgressCallback, RestoreContext, SnapshotHook
from .progress import byte_counter
from .sequences import EngineParts, finish_despite_cancel, keep_log, work_dir
from .store import Snapshot

# The image streamer is imported by the restore that runs it: ``RestoredKernel`` alone, as
# node/ holds it, needs neither it nor numpy.
if TYPE_CHECKING:
    from .store import ImageFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredKernel:
    """A kernel brought back by ``restore``; it listens with its original connection info."""

    pid: int
    connection_info: dict[str, Any]
    snapshot: Snapshot
    timings: dict[str, float]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def kernel_pid(self) -> int:
        found = procfs.kernel_of(self.pid)
        return found.pid if found else self.pid


async def restore_snapshot(
    engine: EngineParts,
    snapshot: Snapshot,
    report: ProgressCallback,
    gpus: Sequence[str] | None,
) -> RestoredKernel:
    """Bring ``snapshot`` back as a running process tree in a new PID namespace."""
    with engine.store.locks.hold(
        locks.snapshot_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})",
        "preflight", note="restore",
    ):
        if not await asyncio.to_thread(snapshot.path.is_dir):
            raise NotFound("preflight", f"snapshot {snapshot.id} was deleted meanwhile")
        # Once criu runs, its kernel must be seen to the end, even by a cancelled caller.
        chosen = None if gpus is None else [str(g) for g in gpus]
        work = asyncio.ensure_future(_restore(engine, snapshot, report, chosen))
        return await finish_despite_cancel(work, asyncio.Event())


async def check_ports(snapshot: Snapshot) -> None:
    """Raise PortsInUse when a port the restored kernel would listen on is taken.

    Called by ``restore`` once the manifest is authenticated: taken ports refuse the
    restore anyway, so before criu and the digests run.
    """
    info = snapshot.connection_info
    busy = await asyncio.to_thread(procfs.ports_in_use, info)
    closing = bool(busy) and await asyncio.to_thread(procfs.ports_closing, info)
    if closing:
        raise PortsInUse(
            "preflight",
            f"{', '.join(busy)} of {info.get('ip', '127.0.0.1')} are still held by the "
            "closing connections of an interrupted restore",
            hint="the system frees them within a minute; try again then",
            details={"ports": busy},
        )
    if busy:
        raise PortsInUse(
            "preflight",
            f"{', '.join(busy)} of {info.get('ip', '127.0.0.1')} in use",
            hint="is the original kernel, or another restore of it, still running? "
            "Shut it down first",
            details={"ports": busy},
        )


async def check_compatibility(
    compatibility: NodeCompatibility,
    snapshot: Snapshot,
    report: ProgressCallback,
    timings: dict[str, float],
    gpu_targets: Sequence[str] | None = None,
    files: FileAccess = OWN_FILES,
) -> None:
    """Raise Incompatible when this node cannot run the snapshot (see compatibility); its
    mapped files are opened by ``files``.

    Called by ``restore`` once the manifest is authenticated and before criu runs;
    ``gpu_targets`` are the models of the GPUs chosen for the restore, by default this
    node's GPUs.
    """
    t = time.monotonic()
    report(Progress("preflight", message="checking that this node can run the snapshot"))
    findings = await run_in_background(
        compatibility.differences, snapshot.manifest, gpu_targets, None, files)
    timings["compatibility"] = time.monotonic() - t
    for note in findings.skipped:
        log.info("restore of %s: %s", snapshot.id, note)
        report(Progress("preflight", message=f"note: {note}"))
    for warning in findings.warnings:
        log.warning("restore of %s: %s", snapshot.id, warning)
        report(Progress("preflight", message=f"warning: {warning}"))
    if findings.refusals:
        node = snapshot.manifest.get("node") or {}
        raise refusal(snapshot.id, str(node.get("hostname") or snapshot.manifest.get(
            "host", "")), findings)


async def _restore(
    engine: EngineParts, snapshot: Snapshot, report: ProgressCallback, gpus: list[str] | None
) -> RestoredKernel:
    timings: dict[str, float] = {}
    started = time.monotonic()
    report(Progress("preflight"))
    # Read again from disk: nothing of a snapshot is used before its signature matched.
    snapshot = await asyncio.to_thread(engine.store.reload, snapshot)
    # Entered and left in a thread: the store's packs are opened and the pages of each
    # recipe found (a second for an 8B model's 4 million pages) while the checks run.
    served = engine.store.served_images(snapshot)
    opening = asyncio.ensure_future(asyncio.to_thread(served.__enter__))
    try:
        ctx = await _preflight(engine, snapshot, report, gpus, timings)
    except BaseException:
        with contextlib.suppress(BaseException):
            await opening
            await asyncio.to_thread(served.__exit__, None, None, None)
        raise
    files = await opening
    try:
        # Checked (and a missing one made) before criu runs; criu reopens them, through the
        # node agent from descriptors its user opened (agent/files/).
        logs = await asyncio.to_thread(kernel_log.open_log_files, ctx.snapshot, engine.files)
        for fd in logs.values():
            os.close(fd)
        ctx.root_pid = await _restore_checked(engine, ctx, files, timings, started)
    finally:
        await asyncio.to_thread(served.__exit__, None, None, None)
    await _resume(engine, ctx, timings)
    timings["total"] = time.monotonic() - started
    report(Progress("done"))
    return RestoredKernel(
        ctx.root_pid, ctx.snapshot.connection_info, ctx.snapshot, timings, ctx.notes
    )


async def _preflight(
    engine: EngineParts,
    snapshot: Snapshot,
    report: ProgressCallback,
    gpus: list[str] | None,
    timings: dict[str, float],
) -> RestoreContext:
    """Refuse what cannot be restored here, before criu runs; the context for the hooks.
    ``snapshot`` was read again from disk and authenticated."""
    await check_ports(snapshot)
    await check_compatibility(engine.compatibility, snapshot, report, timings, files=engine.files)
    criu_version = await asyncio.to_thread(engine.criu.require_version)
    ctx = RestoreContext(snapshot, report, gpus=gpus, criu_version=criu_version)
    ctx.criu.pids = engine.criu.launch.pids
    ctx.files = engine.files
    for hook in engine.hooks:
        await hook.preflight_restore(ctx)
    if gpus is not None and not ctx.gpus_taken:
        raise InvalidRequest(
            "preflight",
            f"gpus was given, but snapshot {snapshot.id} holds no CUDA state to place",
            hint="restore it without gpus",
        )
    return ctx


async def _restore_checked(
    engine: EngineParts,
    ctx: RestoreContext,
    files: dict[str, ImageFile],
    timings: dict[str, float],
    started: float,
) -> int:
    """Run ``criu restore --stream``, its images served from the store and checked against
    their digests as criu reads them (``ImageStreamer``).

    Returns the root pid of the restored tree once criu and every digest succeeded: still
    stopped with ``ctx.criu.leave_stopped``, else let run by criu's plugin after the digests
    matched. If either fails, the tree is killed before any of its code ran.
    """
    from .store import ImageStreamer

    snapshot, report, store, criu = ctx.snapshot, ctx.report, engine.store, engine.criu
    total = snapshot.size_bytes
    report(Progress("restore", 0, total))
    work, work_lock = work_dir("restore")
    served_dir = work / "images"
    served_dir.mkdir(mode=0o700)
    pidfile = work / "restore.pid"
    root_pid = 0
    hooked: list[SnapshotHook] = []
    streamer = ImageStreamer(snapshot, files, served_dir, byte_counter(
        lambda done, whole: report(Progress("restore", min(done, whole), whole)), total))
    images_dir = served_dir if streamer.streams else snapshot.path
    t = time.monotonic()
    verifying = _Gate(lambda: run_in_background(streamer.verify_all))
    try:
        await asyncio.to_thread(streamer.prepare)
        timings["images_checked_first"] = time.monotonic() - t
        timings["preflight"] = time.monotonic() - started
        t = time.monotonic()
        ctx.images_verified = verifying
        ctx.images_dir = images_dir
        for hook in engine.hooks:
            await hook.before_restore(ctx)
            hooked.append(hook)
        run = await criu.run(
            criu.restore_argv(images_dir, work, pidfile, leave_stopped=ctx.criu.leave_stopped,
                              extras=ctx.criu, stream=streamer.streams),
            work / "restore.log", env=ctx.criu.env,
            pass_fds=tuple(ctx.criu.inherited_fds.values()), track_children=True,
        )
        timings["restore"] = time.monotonic() - t
        if run.returncode != 0:
            # A criu that died midway leaves its half-restored tree running on, orphaned,
            # holding the kernel's ports: nothing would restore the snapshot again.
            left = await asyncio.to_thread(procfs.kill_orphans, run.children,
                                           snapshot.connection_info,
                                           time.time() - run.seconds - 5)
            if left:
                log.warning("restore of %s: killed the tree criu left (pids %s)",
                            snapshot.id, left)
        if run.returncode == 0:
            with contextlib.suppress(OSError, ValueError):
                root_pid = ctx.criu.pids.from_criu(int(pidfile.read_text().strip()))
        failure: SnapshotError | None = None
        if run.returncode != 0:
            kept = await asyncio.to_thread(keep_log, store, run.log_path, "restore")
            failure = criu.failure("restore", run, kept, ctx.criu.file_names)
        elif root_pid <= 0:
            failure = SnapshotError("restore", "criu reported success but wrote no pid file")
        if failure is not None:
            # A damaged image is the likelier cause of a failed restore: say so if it is.
            try:
                await verifying
            except SnapshotError as damaged:
                raise damaged from failure
            raise failure
        t_wait = time.monotonic()
        timings["verify"] = await verifying
        timings["verify_wait"] = time.monotonic() - t_wait
    except BaseException as exc:
        await asyncio.to_thread(streamer.close)
        if root_pid > 0:
            await asyncio.to_thread(procfs.kill_tree, root_pid)
        if verifying.started:
            with contextlib.suppress(BaseException):
                await verifying
        for hook in reversed(hooked):
            with contextlib.suppress(Exception):
                await hook.restore_failed(ctx, exc)
        raise
    finally:
        await asyncio.to_thread(streamer.close)
        ctx.notes["images"] = streamer.stats.as_dict()
        ctx.criu.close_inherited()
        await asyncio.to_thread(shutil.rmtree, work, True)
        work_lock.release()
    return root_pid


class _Gate:
    """The check of every digest, started when first awaited: by criu's CUDA plugin once
    criu read the tree's memory, else by the restore once criu ended. Started earlier, it
    would read itself the files criu is about to ask for."""

    def __init__(self, start: Callable[[], Awaitable[float]]) -> None:
        self._start = start
        self._task: asyncio.Future[float] | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def __await__(self) -> Generator[Any, None, float]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._start())
        return self._task.__await__()


async def _resume(engine: EngineParts, ctx: RestoreContext, timings: dict[str, float]) -> None:
    """Let the tree run and the hooks bring back the rest; a failure kills the tree."""
    # Every digest and the signature matched: only now may code of the image run (a
    # hook's criu plugin has already let it run, gated on the same digests).
    t = time.monotonic()
    try:
        for hook in engine.hooks:
            await hook.before_resume(ctx)
        if ctx.criu.leave_stopped:
            await asyncio.to_thread(ctx.resume_tree, ctx.root_pid)
        ctx.report(Progress("resume"))
        for hook in engine.hooks:
            await hook.after_restore(ctx)
    except BaseException as exc:
        # A half-restored kernel (CUDA not back) must not linger holding the ports.
        await asyncio.to_thread(procfs.kill_tree, ctx.root_pid)
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError("resume", f"{type(exc).__name__}: {exc}") from exc
    timings["resume"] = time.monotonic() - t
