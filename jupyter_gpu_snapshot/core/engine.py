"""Save and restore orchestration.

save:    preflight -> suspend (hooks) -> dump (criu) -> resume (hooks) -> commit (store)
restore: preflight (signature, schema, file list) -> restore (criu --leave-stopped, while
         every digest is checked on all cores) -> continue the tree -> resume (hooks)

Hooks are where the GPU layer locks and checkpoints CUDA before the dump and brings it back
afterwards. Whatever fails, the engine rolls back what it did: hooks that ran are told to
resume, the half-written directory is removed, the kernel is woken, and one SnapshotError
naming the step and the cause is raised. The critical section runs shielded, so a cancelled
caller never leaves a kernel frozen or its CUDA locked.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import platform
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .._constants import KERNEL_NAME, format_bytes
from .._version import __version__
from . import locks, procfs
from .background import run_in_background
from .compatibility import NodeCompatibility, node_facts, refusal
from .criu import CriuExtras, CriuRunner, describe_exit
from .errors import Interrupted, InvalidRequest, NotFound, PortsInUse, SnapshotError
from .index import SnapshotIndex
from .kernel_log import kernel_death_cause
from .locks import HeldLock
from .recovery import WORK_LOCK
from .store import DUMP_COMPLETE_FILE, Snapshot, SnapshotStore, new_snapshot_id, validate_name

# Free disk must exceed the estimated image by this much; a full disk can hang the machine.
DISK_MARGIN_BYTES = 256 << 20
# How long a kernel that a keep-running save left running has to answer kernel_info, and
# how long its namespace init has to write what ended it, when it did not survive.
KERNEL_ANSWER_SECONDS = 30.0
DEATH_RECORD_SECONDS = 5.0
KernelAnswers = Callable[[dict[str, Any], float], Awaitable[bool]]
T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """A progress report: the phase under way and, when known, bytes done of a total."""

    phase: str
    done: int = 0
    total: int = 0
    message: str = ""


ProgressCallback = Callable[[Progress], None]


@dataclass
class SaveTarget:
    """What to save: any pid of the kernel, plus what the caller knows about it."""

    pid: int
    kernel_name: str | None = None
    kernel_spec: dict[str, Any] | None = None
    connection_info: dict[str, Any] | None = None
    notebook_path: str | None = None
    kernel_id: str | None = None
    reason: str = "user"


@dataclass
class SaveContext:
    """Shared by the hooks during one save."""

    target: SaveTarget
    kernel: procfs.KernelProcess
    snapshot_id: str
    images_dir: Path
    stop: bool
    report: ProgressCallback
    # Hooks add their own manifest sections here (the GPU layer adds "gpu").
    manifest: dict[str, Any] = field(default_factory=dict)
    # Bytes that the dump will write beyond host RSS (e.g. GPU memory staged to the host).
    extra_bytes: int = 0
    # What hooks add to the criu dump (the GPU layer: CRIU's CUDA plugin and its broker).
    criu: CriuExtras = field(default_factory=CriuExtras)
    criu_version: str = ""
    # When the kernel process started: with its pid, it names the process that must survive.
    kernel_started: float | None = None
    dump_ended: float = 0.0  # wall clock, to say how long after it a kernel died
    # Set by a hook in ``after_dump`` when it knows why a failed dump failed better than
    # criu's log does (e.g. the CUDA lock that timed out inside criu).
    failure_cause: SnapshotError | None = None

    @property
    def root_pid(self) -> int:
        return self.kernel.root_pid


@dataclass
class RestoreContext:
    """Shared by the hooks during one restore."""

    snapshot: Snapshot
    report: ProgressCallback
    root_pid: int = 0
    # The user's choice of target GPUs (indices or UUIDs, in the order of the process's
    # devices); a hook that honours it sets ``gpus_taken``.
    gpus: builtins.list[str] | None = None
    gpus_taken: bool = False
    # What hooks say about this restore, handed back in ``RestoredKernel.notes``
    # (the GPU layer adds "gpu_remap").
    notes: dict[str, Any] = field(default_factory=dict)
    # What hooks add to the criu restore; with ``leave_stopped`` false, criu itself lets the
    # tasks run at its end (the GPU layer's plugin, once CUDA is back) and gates that on
    # ``images_verified``, which resolves once every digest of the images matched.
    criu: CriuExtras = field(default_factory=CriuExtras)
    images_verified: asyncio.Future[float] | None = None
    criu_version: str = ""


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


class SnapshotHook:
    """Extension points around the dump and the restore. The base class does nothing."""

    name = "hook"

    async def preflight_save(self, ctx: SaveContext) -> None:
        """Called by ``save`` before anything touches the process; raise to refuse."""

    async def before_dump(self, ctx: SaveContext) -> None:
        """Called by ``save`` right before ``criu dump`` (the GPU layer suspends CUDA)."""

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        """Called by ``save`` after the dump, or after a failure once ``before_dump`` returned.

        ``error`` is None on success. The hook must leave a surviving process running
        (``ctx.stop`` false, or any failure); it runs in reverse order of ``before_dump``.
        """

    async def preflight_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` once the signature matched, before criu runs; raise to refuse."""

    async def before_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` right before ``criu restore``, once the images' digests are
        being checked (``ctx.images_verified``)."""

    async def restore_failed(self, ctx: RestoreContext, error: BaseException) -> None:
        """Called by ``restore`` when criu or the digests failed after ``before_restore``."""

    async def after_restore(self, ctx: RestoreContext) -> None:
        """Called by ``restore`` once criu has recreated the tree (``ctx.root_pid``) and it
        runs (or, with ``ctx.criu.leave_stopped``, has just been continued)."""


class SnapshotEngine:
    """Saves kernels into a ``SnapshotStore`` and restores them from it."""

    def __init__(
        self,
        store: SnapshotStore | None = None,
        criu: CriuRunner | None = None,
        hooks: Sequence[SnapshotHook] = (),
        compatibility: NodeCompatibility | None = None,
        kernel_answers: KernelAnswers | None = None,
    ) -> None:
        self.store = store or SnapshotStore()
        # Asks a kernel (by its connection info) for kernel_info: part of the check that a
        # keep-running save's kernel survived. core/ speaks no Jupyter protocol itself.
        self.kernel_answers = kernel_answers
        self.kernel_answer_seconds = KERNEL_ANSWER_SECONDS
        self.criu = criu or CriuRunner()
        self.hooks = list(hooks)
        # Also caches the digests of mapped files across saves and restores.
        self.compatibility = compatibility or NodeCompatibility()
        self.index = SnapshotIndex(self.store)

    # -- queries ---------------------------------------------------------------------------
    # These read the disk: callers on an event loop run them in a thread.
    def list(self, notebook_path: str | None = None) -> list[Snapshot]:
        """Trusted snapshots only: what retention, status and restores may act on."""
        return self.index.list(notebook_path)

    def catalog(self, notebook_path: str | None = None) -> builtins.list[Snapshot]:
        """Every snapshot with its status (ok, unsigned, damaged), for listings people read."""
        return self.index.catalog(notebook_path)

    def get(self, ref: str) -> Snapshot:
        return self.index.get(ref)

    def find_name(self, name: str) -> Snapshot | None:
        return self.index.find_name(name)

    def delete(self, ref: str) -> Snapshot:
        """Remove a snapshot; slow for a big one (it removes gigabytes)."""
        return self.store.delete(self.index.get(ref).id)

    def rename(self, ref: str, new_name: str) -> Snapshot:
        """Give a snapshot another name (its manifest is re-signed)."""
        return self.store.rename(self.index.get(ref).id, new_name)

    def _keep_log(self, log: Path, label: str) -> Path | None:
        """Copy a failed run's criu log into the store's logs/; where that fails (a full
        disk, a planted link), keep a private temporary copy, so the error points at a log."""
        if not log.is_file():
            return None  # criu died before writing anything
        try:
            return self.store.keep_log(log, label)
        except (OSError, SnapshotError):
            fd, spare = tempfile.mkstemp(prefix=f"jupyter-gpu-snapshot-{label}-", suffix=".log")
            os.close(fd)
            shutil.copyfile(log, spare)
            return Path(spare)

    def _work_dir(self, kind: str) -> tuple[Path, HeldLock]:
        """A private temp directory for one criu run, locked while in use (see recovery)."""
        work = Path(tempfile.mkdtemp(prefix=f"jupyter-gpu-snapshot-{kind}-"))
        held = locks.try_lock(work / WORK_LOCK, kind)
        assert held is not None  # nobody else knows the directory yet
        return work, held

    # -- save ------------------------------------------------------------------------------
    async def save(
        self,
        target: SaveTarget,
        name: str | None = None,
        stop: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Snapshot:
        """Snapshot the kernel tree of ``target.pid``; keep it running unless ``stop``."""
        report = _throttled(progress)
        started = time.monotonic()
        report(Progress("preflight"))
        if name is not None:
            validate_name(name)
        kernel = await asyncio.to_thread(procfs.inspect_kernel, target.pid)
        procfs.require_ready(kernel)
        with contextlib.ExitStack() as held:
            # Locks in the store: the CLI and the server never dump one kernel at once,
            # nor commit two snapshots under one name.
            claims = [held.enter_context(self.store.locks.hold(
                locks.kernel_key(kernel.root_pid), f"kernel pid {kernel.kernel_pid}",
                "preflight", note=f"save of kernel pid {kernel.kernel_pid}",
            ))]
            if name is not None:
                claims.append(held.enter_context(self.store.locks.hold(
                    locks.name_key(name), f"the snapshot name {name!r}", "preflight",
                    note=f"save as {name}",
                )))
                if await asyncio.to_thread(self.store.find_name, name) is not None:
                    raise InvalidRequest(
                        "preflight",
                        f"a snapshot named {name!r} exists already",
                        hint="pick another name, or delete the old one first",
                    )
            interrupt = asyncio.Event()
            work = asyncio.ensure_future(
                self._save(target, kernel, name, stop, report, started, claims, interrupt)
            )
            return await _finish_despite_cancel(work, interrupt)

    async def _save(
        self,
        target: SaveTarget,
        kernel: procfs.KernelProcess,
        name: str | None,
        stop: bool,
        report: ProgressCallback,
        started: float,
        claims: builtins.list[HeldLock],
        interrupt: asyncio.Event,
    ) -> Snapshot:
        criu_version = await asyncio.to_thread(self.criu.require_version)
        snapshot_id = new_snapshot_id()
        ctx = SaveContext(target, kernel, snapshot_id, Path(), stop, report,
                          criu_version=criu_version,
                          kernel_started=await asyncio.to_thread(
                              procfs.start_time, kernel.kernel_pid))
        # Read now: with stop=True the tree is gone once criu is done. They must exist at
        # restore; CRIU does not check their size, so an empty one elsewhere is enough.
        log_files = await asyncio.to_thread(procfs.append_only_files, kernel.root_pid)
        python_exe = await asyncio.to_thread(_python_of, kernel.kernel_pid)
        root_started = await asyncio.to_thread(procfs.start_time, kernel.root_pid)
        mapped = await asyncio.to_thread(procfs.mapped_files, kernel.root_pid)
        for hook in self.hooks:
            await hook.preflight_save(ctx)
        if interrupt.is_set():
            raise Interrupted("preflight")
        estimate = await asyncio.to_thread(procfs.tree_rss, kernel.root_pid) + ctx.extra_bytes
        free = await asyncio.to_thread(self.store.free_bytes)
        if free < estimate + DISK_MARGIN_BYTES:
            raise SnapshotError(
                "preflight",
                f"not enough free disk for the snapshot: about {format_bytes(estimate)} needed, "
                f"{format_bytes(free)} free in {self.store.root}",
                hint="free some space or delete old snapshots",
            )
        # Held until the rename or the abort: it marks the partial as owned (see recovery).
        owner = self.store.locks.acquire(
            locks.snapshot_key(snapshot_id), f"snapshot {snapshot_id}", "preflight", note="save"
        )
        try:
            snapshot = await self._save_owned(
                ctx, name, criu_version, log_files, python_exe, root_started, estimate,
                [*claims, owner], interrupt, started, mapped,
            )
        finally:
            owner.release()
        if not stop:
            await self._require_survival(ctx, snapshot)
        report(Progress("done", snapshot.size_bytes, snapshot.size_bytes))
        return snapshot

    async def _save_owned(
        self,
        ctx: SaveContext,
        name: str | None,
        criu_version: str,
        log_files: builtins.list[str],
        python_exe: str,
        root_started: float | None,
        estimate: int,
        claims: builtins.list[HeldLock],
        interrupt: asyncio.Event,
        started: float,
        mapped: builtins.list[str],
    ) -> Snapshot:
        kernel, stop, report = ctx.kernel, ctx.stop, ctx.report
        partial = await asyncio.to_thread(self.store.begin, ctx.snapshot_id)
        ctx.images_dir = partial
        manifest = self._manifest(ctx, name, criu_version, log_files, python_exe)
        manifest["kernel"]["root_started"] = root_started
        try:
            # Before anything touches the kernel: a recovery can tell whose partial this is.
            await asyncio.to_thread(self.store.write_draft, partial, manifest)
            work, work_lock = self._work_dir("dump")
        except OSError as exc:
            await asyncio.to_thread(self.store.abort, partial)
            raise SnapshotError(
                "preflight", f"could not write to {self.store.root}: {exc.strerror or exc}"
            ) from exc
        timings: dict[str, float] = {"preflight": time.monotonic() - started}
        # Digests of the mapped files, in a thread while the kernel is suspended and dumped.
        stop_digests = threading.Event()
        digesting = asyncio.ensure_future(
            run_in_background(self.compatibility.record_files, mapped, stop_digests)
        )
        suspended: builtins.list[SnapshotHook] = []
        pause_started = time.monotonic()
        error: BaseException | None = None
        run = None
        try:
            report(Progress("suspend"))
            t = time.monotonic()
            for hook in self.hooks:
                await hook.before_dump(ctx)
                suspended.append(hook)
            timings["suspend"] = time.monotonic() - t
            if interrupt.is_set():
                raise Interrupted("suspend")
            # Again with what the hooks added (the GPU section): criu may outlive us.
            manifest.update(ctx.manifest)
            await asyncio.to_thread(self.store.write_draft, partial, manifest)

            t = time.monotonic()

            def dump_tick() -> None:
                report(Progress("dump", _dir_bytes(partial), estimate))

            report(Progress("dump", 0, estimate))
            argv = self.criu.dump_argv(
                kernel.root_pid, partial, work, leave_running=not stop,
                action_script=_mark_complete_script(work, partial), extras=ctx.criu,
            )
            # criu inherits our locks: if we die, it finishes holding them (see recovery).
            run = await self.criu.run(
                argv, work / "dump.log", on_tick=dump_tick,
                pass_fds=tuple(c.fd for c in [*claims, work_lock]), env=ctx.criu.env,
            )
            timings["dump"] = time.monotonic() - t
            ctx.dump_ended = time.time()
            if run.returncode != 0 and await asyncio.to_thread(
                _dump_outlived_criu, partial, kernel.root_pid
            ):
                # criu ended (killed, say) after it had written every image and stopped the
                # kernel: the image is all that is left of the kernel, so it is committed.
                late = f"{describe_exit(run.returncode)} after its dump completed"
                log.warning("snapshot %s: %s; the image is whole", ctx.snapshot_id, late)
                manifest["warnings"] = [*manifest.get("warnings", []), late]
            elif run.returncode != 0:
                kept = await asyncio.to_thread(self._keep_log, run.log_path, "dump")
                error = self.criu.failure("dump", run, kept)
            elif interrupt.is_set() and not stop:
                error = Interrupted("dump")
        except BaseException as exc:  # a hook failed: roll back what ran
            error = exc
        finally:
            # criu's log lives off the store's disk: on a full disk it would lose the cause.
            shutil.rmtree(work, ignore_errors=True)
            work_lock.release()
        t = time.monotonic()
        report(Progress("resume"))
        resume_error = await self._resume(ctx, suspended, error)
        timings["resume"] = time.monotonic() - t
        timings["pause"] = time.monotonic() - pause_started
        if error is not None or resume_error is not None:
            stop_digests.set()
            with contextlib.suppress(BaseException):
                await digesting
            await asyncio.to_thread(self.store.abort, partial)
            if not stop or error is not None:
                await asyncio.to_thread(procfs.continue_tree, kernel.root_pid)
            failure = ctx.failure_cause or error or resume_error
            if isinstance(failure, SnapshotError):
                raise failure
            raise SnapshotError("suspend", f"{type(failure).__name__}: {failure}") from failure

        report(Progress("commit"))
        t = time.monotonic()
        await self._add_mapped_files(manifest, digesting, timings)
        manifest["timings"] = timings
        try:
            snapshot = await run_in_background(
                self.store.commit,
                partial,
                manifest,
                lambda done, total: report(Progress("commit", done, total)),
            )
        except Exception as exc:
            if stop and not await asyncio.to_thread(procfs.tree_alive, kernel.root_pid):
                # The image is all that is left of the kernel: the next start commits it.
                raise SnapshotError(
                    "commit",
                    f"could not write the snapshot to {self.store.root}: {exc}",
                    hint="the complete image stays in the store; the next server start "
                    "(or 'jupyter gpu-snapshot recover') commits it",
                ) from exc
            await asyncio.to_thread(self.store.abort, partial)
            if isinstance(exc, SnapshotError):
                raise
            cause = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
            raise SnapshotError(
                "commit", f"could not write the snapshot to {self.store.root}: {cause}"
            ) from exc
        timings["commit"] = time.monotonic() - t
        timings["total"] = time.monotonic() - started
        snapshot.manifest["timings"] = timings
        return snapshot

    async def _require_survival(self, ctx: SaveContext, snapshot: Snapshot) -> None:
        """A keep-running save succeeds only if its kernel survived it: the same process
        (pid and start time) alive, answering kernel_info. Otherwise the complete image stays
        listed, with a warning in its manifest, and the save fails naming the death."""
        kernel, started = ctx.kernel, ctx.kernel_started
        info = ctx.target.connection_info or kernel.connection_info
        alive = await asyncio.to_thread(_same_process, kernel.kernel_pid, started)
        if alive and (self.kernel_answers is None or not info
                      or await self.kernel_answers(info, self.kernel_answer_seconds)):
            return
        if alive and await asyncio.to_thread(_same_process, kernel.kernel_pid, started):
            what = (f"the kernel (pid {kernel.kernel_pid}) has not answered for "
                    f"{self.kernel_answer_seconds:g} s since its dump")
        else:
            what = await self._describe_death(snapshot, ctx.dump_ended)
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

    async def _describe_death(self, snapshot: Snapshot, dump_ended: float) -> str:
        """'the kernel died 0.4 s after its dump: killed by signal 11 (SIGSEGV)', from the
        line its namespace init writes into the kernel's log as it reaps it."""
        logs = snapshot.manifest["kernel"].get("log_files") or []
        deadline = time.monotonic() + DEATH_RECORD_SECONDS
        cause = None
        while logs and cause is None and time.monotonic() < deadline:
            cause = await asyncio.to_thread(kernel_death_cause, logs[0])
            if cause is None:
                await asyncio.sleep(0.05)
        if cause is None:
            return "the kernel died after its dump (what ended it is not in its log)"
        died = await asyncio.to_thread(_mtime, logs[0])
        after = f" {max(0.0, died - dump_ended):.1f} s" if died else ""
        return f"the kernel died{after} after its dump: {cause}"

    async def _add_mapped_files(
        self, manifest: dict[str, Any], digesting: asyncio.Future[dict[str, Any]],
        timings: dict[str, float],
    ) -> None:
        """Put the mapped files' digests into the manifest once their thread is done."""
        t = time.monotonic()
        try:
            section = await digesting
        except Exception as exc:  # the check at restore is then skipped, and says so
            log.warning("could not digest the kernel's mapped files: %s", exc)
            manifest["warnings"] = [
                *manifest.get("warnings", []),
                f"the kernel's mapped files could not be digested ({type(exc).__name__}: "
                f"{exc}); a restore cannot check that its environment is the same",
            ]
            return
        manifest["node"]["mapped_files"] = section
        timings["environment"] = float(section["seconds"])
        timings["environment_wait"] = time.monotonic() - t

    async def _resume(
        self, ctx: SaveContext, suspended: builtins.list[SnapshotHook], error: BaseException | None
    ) -> BaseException | None:
        first: BaseException | None = None
        for hook in reversed(suspended):
            try:
                await hook.after_dump(ctx, error)
            except BaseException as exc:
                first = first or exc
        return first

    def _manifest(
        self,
        ctx: SaveContext,
        name: str | None,
        criu_version: str,
        log_files: builtins.list[str],
        python_exe: str,
    ) -> dict[str, Any]:
        target = ctx.target
        created = time.time()
        kernel_name = target.kernel_name or KERNEL_NAME
        return {
            "id": ctx.snapshot_id,
            "name": name or f"{kernel_name}-{ctx.snapshot_id}",
            "created": created,
            "host": socket.gethostname(),
            "reason": target.reason,
            "kernel": {
                "name": kernel_name,
                "spec": target.kernel_spec,
                "kernel_id": target.kernel_id,
                "connection_info": _jsonable(target.connection_info or ctx.kernel.connection_info),
                "notebook_path": target.notebook_path,
                "pid": ctx.kernel.kernel_pid,
                "root_pid": ctx.kernel.root_pid,
                "log_files": self._kernel_logs(log_files),
            },
            "versions": {
                "criu": criu_version,
                "linux": platform.release(),
                "python": python_exe,
                "jupyter_gpu_snapshot": __version__,
            },
            "node": node_facts(),
            **ctx.manifest,
        }

    def _kernel_logs(self, paths: builtins.list[str]) -> builtins.list[str]:
        """The append-only files a restore may recreate: the kernel's own logs. Other files
        the kernel appends to must exist at restore, as any other open file must."""
        log_dir = self.store.policy.kernel_log_dir
        if log_dir is None:
            return paths
        where = str(log_dir())
        return [p for p in paths if os.path.dirname(p) == where]

    # -- restore ---------------------------------------------------------------------------
    async def restore(
        self,
        ref: str | Snapshot,
        progress: ProgressCallback | None = None,
        gpus: Sequence[str] | None = None,
    ) -> RestoredKernel:
        """Bring a snapshot back as a running process tree in a new PID namespace.

        ``gpus`` chooses the GPUs of this node that the process's devices go onto (index or
        UUID, cuda:0 first); without it, the GPU layer chooses.
        """
        report = _throttled(progress)
        snapshot = ref if isinstance(ref, Snapshot) else await asyncio.to_thread(self.get, ref)
        with self.store.locks.hold(
            locks.snapshot_key(snapshot.id), f"snapshot {snapshot.name} ({snapshot.id})",
            "preflight", note="restore",
        ):
            if not await asyncio.to_thread(snapshot.path.is_dir):
                raise NotFound("preflight", f"snapshot {snapshot.id} was deleted meanwhile")
            # Once criu runs, its kernel must be seen to the end, even by a cancelled caller.
            chosen = None if gpus is None else [str(g) for g in gpus]
            work = asyncio.ensure_future(self._restore(snapshot, report, chosen))
            return await _finish_despite_cancel(work, asyncio.Event())

    async def check_ports(self, snapshot: Snapshot) -> None:
        """Raise PortsInUse when a port the restored kernel would listen on is taken.

        Called by ``restore`` once the manifest is authenticated: taken ports refuse the
        restore anyway, so before criu and the digests run.
        """
        info = snapshot.connection_info
        busy = await asyncio.to_thread(procfs.ports_in_use, info)
        if busy:
            raise PortsInUse(
                "preflight",
                f"{', '.join(busy)} of {info.get('ip', '127.0.0.1')} in use",
                hint="is the original kernel, or another restore of it, still running? "
                "Shut it down first",
                details={"ports": busy},
            )

    async def check_compatibility(
        self,
        snapshot: Snapshot,
        report: ProgressCallback,
        timings: dict[str, float],
        gpu_targets: Sequence[str] | None = None,
    ) -> None:
        """Raise Incompatible when this node cannot run the snapshot (see compatibility).

        Called by ``restore`` once the manifest is authenticated and before criu runs;
        ``gpu_targets`` are the models of the GPUs chosen for the restore, by default this
        node's GPUs.
        """
        t = time.monotonic()
        report(Progress("preflight", message="checking that this node can run the snapshot"))
        findings = await run_in_background(
            self.compatibility.differences, snapshot.manifest, gpu_targets
        )
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
        self, snapshot: Snapshot, report: ProgressCallback, gpus: builtins.list[str] | None
    ) -> RestoredKernel:
        timings: dict[str, float] = {}
        started = time.monotonic()
        report(Progress("preflight"))
        # Read again from disk: nothing of a snapshot is used before its signature matched.
        snapshot = await asyncio.to_thread(self.store.reload, snapshot)
        await self.check_ports(snapshot)
        await self.check_compatibility(snapshot, report, timings)
        info = snapshot.connection_info
        criu_version = await asyncio.to_thread(self.criu.require_version)
        ctx = RestoreContext(snapshot, report, gpus=gpus, criu_version=criu_version)
        for hook in self.hooks:
            await hook.preflight_restore(ctx)
        if gpus is not None and not ctx.gpus_taken:
            raise InvalidRequest(
                "preflight",
                f"gpus was given, but snapshot {snapshot.id} holds no CUDA state to place",
                hint="restore it without gpus",
            )
        with self.store.opened_images(snapshot) as images:
            await asyncio.to_thread(self.store.prepare_log_files, snapshot)
            timings["preflight"] = time.monotonic() - started
            ctx.root_pid = await self._restore_checked(ctx, images, timings)

        # Every digest and the signature matched: only now may code of the image run (a
        # hook's criu plugin has already let it run, gated on the same digests).
        t = time.monotonic()
        if ctx.criu.leave_stopped:
            await asyncio.to_thread(procfs.continue_tree, ctx.root_pid)
        report(Progress("resume"))
        try:
            for hook in self.hooks:
                await hook.after_restore(ctx)
        except BaseException as exc:
            # A half-restored kernel (CUDA not back) must not linger holding the ports.
            await asyncio.to_thread(procfs.kill_tree, ctx.root_pid)
            if isinstance(exc, SnapshotError):
                raise
            raise SnapshotError("resume", f"{type(exc).__name__}: {exc}") from exc
        timings["resume"] = time.monotonic() - t
        timings["total"] = time.monotonic() - started
        report(Progress("done"))
        return RestoredKernel(ctx.root_pid, info, snapshot, timings, ctx.notes)

    async def _restore_checked(
        self,
        ctx: RestoreContext,
        images: builtins.list[tuple[int, int]],
        timings: dict[str, float],
    ) -> int:
        """Run ``criu restore`` while the digests are checked on all cores.

        Returns the root pid of the restored tree once both succeeded: still stopped with
        ``ctx.criu.leave_stopped``, else let run by criu's plugin after the digests matched.
        If either fails, the tree is killed before any of its code ran.
        """
        snapshot, report = ctx.snapshot, ctx.report
        total = snapshot.size_bytes
        report(Progress("restore", 0, total))
        cancel = threading.Event()
        t = time.monotonic()

        def check() -> float:
            self.store.check_digests(
                snapshot, images, lambda d, n: report(Progress("restore", d, n)), cancel
            )
            return time.monotonic() - t

        # At a lower priority than the event loop; criu and the digests share the rest.
        verifying = asyncio.ensure_future(run_in_background(check))
        ctx.images_verified = verifying
        work, work_lock = self._work_dir("restore")
        pidfile = work / "restore.pid"
        root_pid = 0
        hooked: builtins.list[SnapshotHook] = []
        try:
            for hook in self.hooks:
                await hook.before_restore(ctx)
                hooked.append(hook)
            run = await self.criu.run(
                self.criu.restore_argv(snapshot.path, work, pidfile,
                                       leave_stopped=ctx.criu.leave_stopped, extras=ctx.criu),
                work / "restore.log", env=ctx.criu.env,
            )
            timings["restore"] = time.monotonic() - t
            if run.returncode == 0:
                with contextlib.suppress(OSError, ValueError):
                    root_pid = int(pidfile.read_text().strip())
            failure: SnapshotError | None = None
            if run.returncode != 0:
                kept = await asyncio.to_thread(self._keep_log, run.log_path, "restore")
                failure = self.criu.failure("restore", run, kept)
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
            cancel.set()
            if root_pid > 0:
                await asyncio.to_thread(procfs.kill_tree, root_pid)
            if not verifying.done():
                with contextlib.suppress(BaseException):
                    await verifying
            for hook in reversed(hooked):
                with contextlib.suppress(Exception):
                    await hook.restore_failed(ctx, exc)
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
            work_lock.release()
        return root_pid


async def _finish_despite_cancel(work: asyncio.Future[T], interrupt: asyncio.Event) -> T:
    """Await a save or restore; when cancelled (Ctrl-C, a server stopping), ask it to stop
    at its next safe point and wait for its rollback: no kernel is left frozen or locked.

    A stopping save whose dump already completed cannot roll back (the kernel is gone), so
    it commits and its snapshot is returned despite the cancel; so is a finished restore.
    """
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.done():
                break
            cancelled = True
            interrupt.set()
        except BaseException:
            break
    if cancelled:
        task = asyncio.current_task()
        if work.cancelled() or work.exception() is not None:
            raise asyncio.CancelledError()
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()
    return work.result()


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


def _throttled(progress: ProgressCallback | None, interval: float = 0.1) -> ProgressCallback:
    """At most one report per ``interval`` within a phase; phase changes and new messages
    (warnings among them) always pass."""
    if progress is None:
        return lambda _p: None
    last: list[Any] = ["", 0.0, ""]
    sink = progress

    def report(p: Progress) -> None:
        now = time.monotonic()
        news = bool(p.message) and p.message != last[2]
        if (p.phase != last[0] or news or now - last[1] >= interval
                or (p.total and p.done >= p.total)):
            last[0], last[1], last[2] = p.phase, now, p.message
            sink(p)

    return report


def _jsonable(info: dict[str, Any] | None) -> dict[str, Any] | None:
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


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _python_of(pid: int) -> str:
    """The kernel's interpreter, e.g. ``python3.11 (/path/bin/python3.11)``."""
    exe = procfs.executable(pid)
    if exe is None:
        return sys.version.split()[0]
    return f"{Path(exe).name} ({exe})"
