"""The save sequence: how a running kernel becomes a snapshot, in one place.

``save_kernel`` claims the kernel and the name in the store (``save_claims``: the name
asked for, or one made from the notebook and the local time); ``_Save.run`` then takes
these steps, in order, each a method of ``_Save``:

1. preflight  read what the manifest records while the tree exists (criu's version, the
              kernel's logs, interpreter and mapped files); hooks may refuse
              (``preflight_save``: the GPU layer checks the driver, the plugin and the host
              RAM that will stage GPU memory); enough free disk for the image
2. draft      the partial directory, owned by a lock, with a draft manifest, so a recovery
              knows whose it is; the kernel writes its portable copy there when asked
              (``SaveTarget.portable``), while it still runs; then the mapped files are
              digested in a thread meanwhile
3. suspend    hooks' ``before_dump``: the GPU layer starts its broker (``gpu/broker.py``)
              and loads CRIU's CUDA plugin into the dump. Nothing is locked or frozen yet.
4. dump       ``criu dump`` (``--leave-running`` unless stopping). CUDA happens here, inside
              criu, the plugin making each driver call through the broker: it locks CUDA in
              each process as criu seizes it (its threads still running), checkpoints it
              once criu has frozen every thread, and, for a keep-running save or a failed
              dump, restores and unlocks it before criu lets the threads run again. Only
              criu can: the driver does the work on a thread of the process itself, which
              must run alone, and frameworks such as JAX crash if their other threads run
              while CUDA is checkpointed.
5. resume     hooks' ``after_dump``, in reverse order: the GPU layer checks that every
              process still alive runs on the GPU again, and resumes what a dead criu left.
              If step 3, 4 or 5 failed, the save rolls back here: the partial is removed,
              the kernel continued, and one SnapshotError naming the step is raised.
6. commit     the images digested, the manifest signed, the partial renamed into the store
7. survival   a keep-running save succeeds only if its kernel survived: the same process,
              alive, answering kernel_info. Otherwise the snapshot stays listed, with a
              warning, and the save fails naming the death.

The pause the user feels is steps 3 to 5. From preflight on, the sequence runs shielded
(``finish_despite_cancel``): a cancelled caller asks it to stop at its next safe point and
waits for the rollback, so no kernel is left frozen or its CUDA locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import platform
import shlex
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .._constants import KERNEL_NAME, format_bytes
from .._version import __version__
from . import locks, procfs
from .background import run_in_background
from .compatibility import node_facts
from .criu import describe_exit
from .errors import Interrupted, NotReady, SnapshotError
from .file_access import FileAccess
from .hooks import Progress, ProgressCallback, SaveContext, SaveTarget, SnapshotHook
from .kernel_log import kernel_death_cause
from .locks import HeldLock
from .save_claims import claimed
from .sequences import EngineParts, finish_despite_cancel, keep_log, work_dir
from .store import (
    DUMP_COMPLETE_FILE,
    DumpFollower,
    FollowedFile,
    ManifestProblem,
    Snapshot,
    bounded_history,
    is_portable_file,
    new_snapshot_id,
    portable_problem,
    validate_name,
)
from .user_paths import UserPath

# Free disk must exceed the estimated image by this much; a full disk can hang the machine.
DISK_MARGIN_BYTES = 256 << 20
# How long a kernel's namespace init has to write what ended it, when a kernel that a
# keep-running save left running did not survive.
DEATH_RECORD_SECONDS = 5.0
log = logging.getLogger(__name__)


async def save_kernel(
    engine: EngineParts,
    target: SaveTarget,
    name: str | None,
    stop: bool,
    report: ProgressCallback,
) -> Snapshot:
    """Snapshot the kernel tree of ``target.pid``; keep it running unless ``stop``."""
    started = time.monotonic()
    report(Progress("preflight"))
    if name is not None:
        validate_name(name)
    # The kernel's connection file is read only when the caller did not send its
    # connection, and then as the kernel's user (the engine's ``files``).
    kernel = await asyncio.to_thread(
        procfs.inspect_kernel, target.pid,
        None if target.connection_info else engine.files)
    procfs.require_ready(kernel)
    if (not target.connection_info and kernel.connection_file is not None
            and kernel.connection_info is None):
        raise NotReady(
            "preflight", f"the kernel's connection file {kernel.connection_file} cannot be "
            "read (missing, "
            "not a regular file or not JSON; the node agent reads it as the kernel's user)",
            hint="save the kernel from the server that runs it (it sends the connection), "
            "or put its connection file back")
    async with claimed(engine.store, kernel, target, name) as (chosen, claims):
        interrupt = asyncio.Event()
        steps = _Save(engine, target, kernel, chosen, stop, report, started, claims, interrupt)
        return await finish_despite_cancel(asyncio.ensure_future(steps.run()), interrupt)


@dataclass(frozen=True)
class _KernelFacts:
    """What the manifest records of the tree, read in preflight: with stop, the tree is gone
    once criu is done."""

    # The append-only files the tree has open. They must exist at restore; CRIU does not
    # check their size, so an empty one elsewhere is enough.
    log_files: list[str]
    python: str  # the kernel's interpreter, e.g. ``python3.11 (/path/bin/python3.11)``
    root_started: float | None
    mapped: list[str]  # the files mapped into the tree, digested while it is paused


class _Save:
    """One save, after the claims: ``run`` is the sequence of the module docstring."""

    # Set by the steps, in this order.
    facts: _KernelFacts  # preflight
    estimate: int  # preflight: the bytes the dump will write
    partial: Path  # draft: the partial directory the images go to
    work: Path  # draft: criu's work directory, with its log
    work_lock: HeldLock
    digesting: asyncio.Future[dict[str, Any]]  # the mapped files' digests
    follower: DumpFollower | None  # draft: reads the page images as criu writes them
    pause_started: float  # suspend

    def __init__(
        self,
        engine: EngineParts,
        target: SaveTarget,
        kernel: procfs.KernelProcess,
        name: str,
        stop: bool,
        report: ProgressCallback,
        started: float,
        claims: list[HeldLock],
        interrupt: asyncio.Event,
    ) -> None:
        self.engine = engine
        self.store = engine.store
        self.name = name
        self.report = report
        self.started = started
        self.claims = list(claims)  # criu inherits them, and the partial's owner lock
        self.interrupt = interrupt
        self.ctx = SaveContext(target, kernel, new_snapshot_id(), Path(), stop, report)
        self.ctx.criu.pids = engine.criu.launch.pids
        self.ctx.files = engine.files
        self.manifest: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.follower = None
        # What the follower read of the images, for the commit (empty: it reads them).
        self.followed: dict[str, FollowedFile] = {}
        self.stop_digests = threading.Event()
        # The hooks whose preflight_save passed: each is owed one after_dump, which
        # releases what its preflight took, however the save ends.
        self.prepared: list[SnapshotHook] = []

    async def run(self) -> Snapshot:
        # Held until the rename or the abort: it marks the partial as owned (see recovery).
        with self.store.locks.hold(
            locks.snapshot_key(self.ctx.snapshot_id), f"snapshot {self.ctx.snapshot_id}",
            "preflight", note="save",
        ) as owner:
            self.claims.append(owner)
            try:
                await self.preflight()
                await self.draft()
            except BaseException as exc:  # nothing touched the kernel; the hooks let go
                await self.release_hooks(exc)
                raise
            self.digest_mapped_files()
            error: BaseException | None = None
            try:
                await self.suspend()
                error = await self.dump()  # CUDA is locked and checkpointed inside criu
            except BaseException as exc:  # a hook failed, or criu could not run: roll back
                error = exc
            finally:
                # In a thread: unlinking criu's logs waits for the disk the image was just
                # written to (0.6 s seen on the event loop after a 2 GiB dump).
                await asyncio.to_thread(self.remove_work_dir)
                await self.end_following(error is None)
            resume_error = await self.resume(error)
            if error is not None or resume_error is not None:
                await self.roll_back(error, resume_error)
            snapshot = await self.commit()
        await self.find_pages(snapshot)
        snapshot = await self.record_timings(snapshot)
        if not self.ctx.stop:
            await self.require_survival(snapshot)
        self.report(Progress("done", snapshot.size_bytes, snapshot.size_bytes))
        return snapshot

    async def record_timings(self, snapshot: Snapshot) -> Snapshot:
        """The save's whole timings into its manifest, signed again: the commit is signed
        before its own time is known, and the next saves are timed from these (the shutdown
        budget's estimate). A failure only leaves the manifest with the earlier ones."""
        try:
            return await asyncio.to_thread(
                self.store.record_timings, snapshot.id, dict(self.timings))
        except (OSError, SnapshotError) as exc:
            log.warning("snapshot %s: its timings stay those of before its commit: %s",
                        snapshot.id, exc)
            return snapshot

    # -- 1. preflight ----------------------------------------------------------------------
    async def preflight(self) -> None:
        """Read the facts the manifest records, let the hooks refuse, check the disk."""
        ctx = self.ctx
        ctx.criu_version = await asyncio.to_thread(self.engine.criu.require_version)
        ctx.kernel_started = await asyncio.to_thread(procfs.start_time, ctx.kernel.kernel_pid)
        self.facts = await asyncio.to_thread(_read_facts, ctx.kernel)
        for hook in self.engine.hooks:
            await hook.preflight_save(ctx)
            self.prepared.append(hook)
        if self.interrupt.is_set():
            raise Interrupted("preflight")
        estimate = await asyncio.to_thread(procfs.tree_rss, ctx.root_pid) + ctx.extra_bytes
        free = await asyncio.to_thread(self.store.free_bytes)
        if free < estimate + DISK_MARGIN_BYTES:
            raise SnapshotError(
                "preflight",
                f"not enough free disk for the snapshot: about {format_bytes(estimate)} needed, "
                f"{format_bytes(free)} free in {self.store.root}",
                hint="free some space or delete old snapshots",
            )
        self.estimate = estimate

    # -- 2. draft --------------------------------------------------------------------------
    async def draft(self) -> None:
        """The partial directory with a draft manifest, written before anything touches the
        kernel so that a recovery can tell whose partial it is; and criu's work directory."""
        self.partial = await asyncio.to_thread(self.store.begin, self.ctx.snapshot_id)
        self.ctx.images_dir = self.partial
        self.manifest = self._manifest()
        try:
            await asyncio.to_thread(self.store.write_draft, self.partial, self.manifest)
            self.work, self.work_lock = work_dir("dump")
        except OSError as exc:
            await asyncio.to_thread(self.store.abort, self.partial)
            raise SnapshotError(
                "preflight", f"could not write to {self.store.root}: {exc.strerror or exc}"
            ) from exc
        try:
            await self.write_portable()
        except BaseException:
            await asyncio.to_thread(self.remove_work_dir)
            await asyncio.to_thread(self.store.abort, self.partial)
            raise
        # Started before the kernel is touched: its workers are up before the pause.
        self.follower = await asyncio.to_thread(self.store.follow_dump, self.partial)
        self.timings["preflight"] = time.monotonic() - self.started

    async def write_portable(self) -> None:
        """The kernel's portable copy, into the partial, before anything pauses it: the
        commit digests and signs its files with the images'."""
        writer = self.ctx.target.portable
        if writer is None:
            return
        t = time.monotonic()
        self.report(Progress("portable"))
        try:
            report = await writer(self.partial)
            written = await asyncio.to_thread(os.listdir, self.partial)
            problem = portable_problem(report, written)
            if problem is not None:
                raise SnapshotError("portable", problem)
            self.manifest["portable"] = report
        except Interrupted:
            raise
        except SnapshotError as exc:
            if self.ctx.target.portable_required:
                raise
            # A policy's copy: the save goes on without it, and says so.
            await asyncio.to_thread(_remove_portable_files, self.partial)
            _add_warning(self.manifest, f"no portable copy: {exc.cause}")
        await asyncio.to_thread(self.store.write_draft, self.partial, self.manifest)
        self.timings["portable"] = time.monotonic() - t

    def digest_mapped_files(self) -> None:
        """Digest the mapped files in a thread while the kernel is paused; commit waits."""
        self.digesting = asyncio.ensure_future(run_in_background(
            self.engine.compatibility.record_files, self.facts.mapped, self.stop_digests,
            self.engine.files))

    # -- 3. suspend ------------------------------------------------------------------------
    async def suspend(self) -> None:
        """Hooks' ``before_dump``: they add to the criu run (the GPU layer: the CUDA plugin
        and its broker) and to the manifest."""
        self.pause_started = t = time.monotonic()
        self.report(Progress("suspend"))
        for hook in self.engine.hooks:
            await hook.before_dump(self.ctx)
        self.timings["suspend"] = time.monotonic() - t
        if self.interrupt.is_set():
            raise Interrupted("suspend")
        # Again with what the hooks added (the GPU section): criu may outlive us.
        self.manifest.update(self.ctx.manifest)
        await asyncio.to_thread(self.store.write_draft, self.partial, self.manifest)

    # -- 4. dump ---------------------------------------------------------------------------
    async def dump(self) -> SnapshotError | None:
        """Run ``criu dump``, with the hooks' plugin (CUDA's lock, checkpoint and, keeping
        the kernel running, restore and unlock happen inside it). Returns why it failed."""
        ctx, partial, criu = self.ctx, self.partial, self.engine.criu
        t = time.monotonic()

        def dump_tick() -> None:
            self.report(Progress("dump", _dir_bytes(partial), self.estimate))

        self.report(Progress("dump", 0, self.estimate))
        argv = criu.dump_argv(
            ctx.root_pid, partial, self.work, leave_running=not ctx.stop,
            action_script=_mark_complete_script(self.work, partial), extras=ctx.criu,
        )
        # criu inherits our locks: if we die, it finishes holding them (see recovery).
        run = await criu.run(
            argv, self.work / "dump.log", on_tick=dump_tick,
            pass_fds=tuple(c.fd for c in [*self.claims, self.work_lock]), env=ctx.criu.env,
        )
        self.timings["dump"] = time.monotonic() - t
        ctx.dump_ended = time.time()
        if run.returncode != 0 and await asyncio.to_thread(
            _dump_outlived_criu, partial, ctx.root_pid
        ):
            # criu ended (killed, say) after it had written every image and stopped the
            # kernel: the image is all that is left of the kernel, so it is committed.
            late = f"{describe_exit(run.returncode)} after its dump completed"
            log.warning("snapshot %s: %s; the image is whole", ctx.snapshot_id, late)
            _add_warning(self.manifest, late)
        elif run.returncode != 0:
            kept = await asyncio.to_thread(keep_log, self.store, run.log_path, "dump")
            return criu.failure("dump", run, kept, ctx.criu.file_names)
        elif self.interrupt.is_set() and not ctx.stop:
            return Interrupted("dump")
        return None

    async def end_following(self, dumped: bool) -> None:
        """The follower's ids and digests once criu wrote every image; dropped otherwise."""
        follower, self.follower = self.follower, None
        if follower is None:
            return
        t = time.monotonic()
        if dumped:
            self.followed = await asyncio.to_thread(follower.finish)
            self.timings["follow_end"] = time.monotonic() - t
        else:
            await asyncio.to_thread(follower.cancel)

    def remove_work_dir(self) -> None:
        # criu's log lives off the store's disk: on a full disk it would lose the cause.
        shutil.rmtree(self.work, ignore_errors=True)
        self.work_lock.release()

    # -- 5. resume, or roll back -----------------------------------------------------------
    async def resume(self, error: BaseException | None) -> BaseException | None:
        """Hooks' ``after_dump``, in reverse order, told of ``error``; returns the first
        exception one raised. Every hook runs, whatever the others did."""
        t = time.monotonic()
        self.report(Progress("resume"))
        first = await self.release_hooks(error)
        self.timings["resume"] = time.monotonic() - t
        self.timings["pause"] = time.monotonic() - self.pause_started
        return first

    async def release_hooks(self, error: BaseException | None) -> BaseException | None:
        """Every prepared hook's ``after_dump``, in reverse order, whatever the others did;
        the first exception one raised."""
        first: BaseException | None = None
        for hook in reversed(self.prepared):
            try:
                await hook.after_dump(self.ctx, error)
            except BaseException as exc:
                first = first or exc
        return first

    async def roll_back(
        self, error: BaseException | None, resume_error: BaseException | None
    ) -> NoReturn:
        """Remove the partial, let the kernel run (unless a stopping dump completed: criu
        ended it), and raise one error, the best cause first."""
        self.stop_digests.set()
        with contextlib.suppress(BaseException):
            await self.digesting
        await asyncio.to_thread(self.store.abort, self.partial)
        if not self.ctx.stop or error is not None:
            await asyncio.to_thread(procfs.continue_tree, self.ctx.root_pid)
        failure = self.ctx.failure_cause or error or resume_error
        if isinstance(failure, SnapshotError):
            raise failure
        raise SnapshotError("suspend", f"{type(failure).__name__}: {failure}") from failure

    # -- 6. commit -------------------------------------------------------------------------
    async def commit(self) -> Snapshot:
        """Digest the images, sign the manifest and rename the partial into the store."""
        self.report(Progress("commit"))
        t = time.monotonic()
        await self._add_mapped_files()
        self.manifest["timings"] = dict(self.timings)  # this far; record_timings adds the rest
        try:
            snapshot = await run_in_background(
                self.store.commit,
                self.partial,
                self.manifest,
                lambda done, total: self.report(Progress("commit", done, total)),
                self.followed,
            )
        except Exception as exc:
            full = _disk_full(exc)
            if self.ctx.stop and not await asyncio.to_thread(
                procfs.tree_alive, self.ctx.root_pid
            ):
                # The image is all that is left of the kernel: the next start commits it.
                raise SnapshotError(
                    "commit",
                    f"could not write the snapshot to {self.store.root}: {full or exc}",
                    hint=("free space on that disk; then " if full else "")
                    + "the complete image stays in the store; the next server start "
                    "(or 'jupyter gpu-snapshot recover') commits it",
                ) from exc
            await asyncio.to_thread(self.store.abort, self.partial)
            if isinstance(exc, SnapshotError):
                raise
            cause = full or (exc.strerror if isinstance(exc, OSError)
                             else f"{type(exc).__name__}: {exc}")
            raise SnapshotError(
                "commit", f"could not write the snapshot to {self.store.root}: {cause}",
                hint="free space on that disk (or delete snapshots you no longer need), then "
                "save again; the kernel runs on and the other snapshots are intact"
                if full else None,
            ) from exc
        self.timings["commit"] = time.monotonic() - t
        self.timings["total"] = time.monotonic() - self.started
        snapshot.manifest["timings"] = self.timings
        return snapshot

    async def find_pages(self, snapshot: Snapshot) -> None:
        """Where the snapshot's pages lie, found now for its restores: a second or more
        for an 8B model, taken here after the save is durable rather than when a notebook
        waits for its kernel. A failure costs only that later restore the time."""
        t = time.monotonic()
        try:
            await run_in_background(self.store.find_pages, snapshot)
        except Exception as exc:  # the snapshot is whole: only its restore finds the pages
            log.warning("snapshot %s: where its pages lie is left to its restore: %s",
                        snapshot.id, exc)
        self.timings["find_pages"] = time.monotonic() - t

    async def _add_mapped_files(self) -> None:
        """Put the mapped files' digests into the manifest once their thread is done."""
        t = time.monotonic()
        try:
            section = await self.digesting
        except Exception as exc:  # the check at restore is then skipped, and says so
            log.warning("could not digest the kernel's mapped files: %s", exc)
            _add_warning(
                self.manifest,
                f"the kernel's mapped files could not be digested ({type(exc).__name__}: "
                f"{exc}); a restore cannot check that its environment is the same",
            )
            return
        self.manifest["node"]["mapped_files"] = section
        self.timings["environment"] = float(section["seconds"])
        self.timings["environment_wait"] = time.monotonic() - t

    # -- 7. survival -----------------------------------------------------------------------
    async def require_survival(self, snapshot: Snapshot) -> None:
        """A keep-running save succeeds only if its kernel survived it: the same process
        (pid and start time) alive, answering kernel_info. Otherwise the complete image stays
        listed, with a warning in its manifest, and the save fails naming the death."""
        ctx, answers = self.ctx, self.engine.kernel_answers
        seconds = self.engine.kernel_answer_seconds
        kernel, started = ctx.kernel, ctx.kernel_started
        info = ctx.target.connection_info or kernel.connection_info
        alive = await asyncio.to_thread(_same_process, kernel.kernel_pid, started)
        if alive and (answers is None or not info or await answers(info, seconds)):
            return
        if alive and await asyncio.to_thread(_same_process, kernel.kernel_pid, started):
            what = (f"the kernel (pid {kernel.kernel_pid}) has not answered for "
                    f"{seconds:g} s since its dump")
        else:
            what = await _describe_death(snapshot, ctx.dump_ended, self.engine.files)
        log.warning("snapshot %s: %s", snapshot.id, what)
        try:
            await asyncio.to_thread(self.store.add_warning, snapshot.id, what)
        except (OSError, SnapshotError) as exc:  # the image stays listed all the same
            log.warning("snapshot %s: could not record the warning: %s", snapshot.id, exc)
        raise SnapshotError(
            "resume", what,
            hint=f"its snapshot {snapshot.name} is complete and listed (with this warning); "
            "restore it to get the kernel back",
        )

    # -- the manifest ----------------------------------------------------------------------
    def _manifest(self) -> dict[str, Any]:
        ctx, facts = self.ctx, self.facts
        target = ctx.target
        kernel_name = target.kernel_name or KERNEL_NAME
        return {
            "id": ctx.snapshot_id,
            "name": self.name,
            "created": time.time(),
            "host": socket.gethostname(),
            "reason": target.reason,
            "kernel": {
                "name": kernel_name,
                "spec": target.kernel_spec,
                "kernel_id": target.kernel_id,
                "connection_info": connection_info_json(
                    target.connection_info or ctx.kernel.connection_info),
                "notebook_path": target.notebook_path,
                "pid": ctx.kernel.kernel_pid,
                "root_pid": ctx.kernel.root_pid,
                "log_files": self._kernel_logs(facts.log_files),
                "root_started": facts.root_started,
            },
            "versions": {
                "criu": ctx.criu_version,
                "linux": platform.release(),
                "python": facts.python,
                "jupyter_gpu_snapshot": __version__,
            },
            "node": node_facts(),
            **self._history(),
            **ctx.manifest,
        }

    def _history(self) -> dict[str, Any]:
        """The manifest's "history", from what the kernel said it ran. A history the
        kernel garbled costs the replay, never the save: it is left out, with a warning."""
        history = self.ctx.target.history
        if not history:
            return {}
        try:
            return {"history": bounded_history(history)}
        except ManifestProblem as exc:
            _add_warning(self.ctx.manifest, f"no cells recorded: {exc}")
            return {}

    def _kernel_logs(self, paths: list[str]) -> list[str]:
        """The append-only files a restore may recreate: the kernel's own logs. Other files
        the kernel appends to must exist at restore, as any other open file must."""
        log_dir = self.store.policy.kernel_log_dir
        if log_dir is None:
            return paths
        where = str(log_dir())
        return [p for p in paths if os.path.dirname(p) == where]


def _read_facts(kernel: procfs.KernelProcess) -> _KernelFacts:
    return _KernelFacts(
        log_files=procfs.append_only_files(kernel.root_pid),
        python=_python_of(kernel.kernel_pid),
        root_started=procfs.start_time(kernel.root_pid),
        mapped=procfs.mapped_files(kernel.root_pid),
    )


async def _describe_death(snapshot: Snapshot, dump_ended: float, files: FileAccess) -> str:
    """'the kernel died 0.4 s after its dump: killed by signal 11 (SIGSEGV)', from the
    line its namespace init writes into the kernel's log as it reaps it (read by
    ``files``)."""
    logs = snapshot.manifest["kernel"].get("log_files") or []
    deadline = time.monotonic() + DEATH_RECORD_SECONDS
    cause = None
    while logs and cause is None and time.monotonic() < deadline:
        cause = await asyncio.to_thread(kernel_death_cause, logs[0], 0, files)
        if cause is None:
            await asyncio.sleep(0.05)
    if cause is None:
        return "the kernel died after its dump (what ended it is not in its log)"
    died = await asyncio.to_thread(_mtime, logs[0], files)
    after = f" {max(0.0, died - dump_ended):.1f} s" if died else ""
    return f"the kernel died{after} after its dump: {cause}"


def _disk_full(exc: BaseException) -> str | None:
    """'its disk is full (No space left on device)' when ``exc`` says so, else None."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "is full" if exc.errno == errno.ENOSPC else "is over its quota"
        return f"its disk {what} ({exc.strerror})"
    return None


def _add_warning(manifest: dict[str, Any], warning: str) -> None:
    manifest["warnings"] = [*manifest.get("warnings", []), warning]


def _remove_portable_files(partial: Path) -> None:
    """The files of a portable copy given up, out of the partial: the commit digests every
    file there."""
    for name in os.listdir(partial):
        if is_portable_file(name):
            with contextlib.suppress(FileNotFoundError):
                (partial / name).unlink()


def _dump_outlived_criu(images: Path, root_pid: int) -> bool:
    """Whether a dump whose criu failed had completed: its post-dump marker is written
    (every image file whole) and the kernel is gone, as criu ends it only after that."""
    return (images / DUMP_COMPLETE_FILE).is_file() and not procfs.tree_alive(root_pid)


def _mark_complete_script(work: Path, images: Path) -> Path:
    """criu's action script that marks the images complete, run by criu after the dump."""
    script = work / "mark-complete.sh"
    marker = shlex.quote(str(images / DUMP_COMPLETE_FILE))
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"exec 3>{marker}\n"
    )
    script.chmod(0o700)
    return script


def connection_info_json(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Connection info as JSON: jupyter_client hands out the HMAC key as bytes."""
    if info is None:
        return None
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in info.items()}


def _dir_bytes(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _same_process(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is alive (not a zombie) and still the process that started then."""
    return procfs.tree_alive(pid) and started is not None and procfs.start_time(pid) == started


def _mtime(path: str, files: FileAccess) -> float | None:
    try:
        fd = files.open(path, os.O_RDONLY, UserPath.KERNEL_LOG)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def _python_of(pid: int) -> str:
    """The kernel's interpreter, e.g. ``python3.11 (/path/bin/python3.11)``."""
    exe = procfs.executable(pid)
    if exe is None:
        return sys.version.split()[0]
    return f"{Path(exe).name} ({exe})"
