"""What the REST API does: the engine, applied to the server's kernels and sessions.

Handlers call this, and for session lookups its ``slots`` (``kernel_slots.KernelSlots``);
it raises only the core's errors (``InvalidRequest``, ``NotFound``, ``Busy``,
``NotReady``, ``SnapshotError``), which the handlers map to HTTP statuses in one place.
Here: the snapshots (remote copies merged in), kernel status, the save job and the
restore job. A restored tree becomes a kernel of the server in ``kernel_slots``; uploads
to the remote store are ``uploads``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from ..agent_client.gpu_sleep import AgentGpuSleep
from ..agent_client.remote_engine import AgentEngine
from ..config import GPUSnapshot
from ..core import procfs, retention
from ..core.engine import SnapshotEngine
from ..core.errors import (
    Busy,
    InvalidRequest,
    NotFound,
    NotReady,
    PortsInUse,
    SnapshotError,
)
from ..core.hooks import SaveTarget
from ..core.snapshot import DAMAGED, Snapshot, validate_name
from ..gpu.hook import CudaCheckpointHook
from ..gpu.inventory import GpuInventory, read_inventory
from ..gpu.remap import describe_choice, parse_gpu_choice
from ..gpu.sleep import SleepReport
from ..launch.liveness import kernel_answers
from ..launch.provisioner import root_pid
from ..remotes import BOTH, LOCAL, REMOTE, merge_locations
from .deaths import KernelDeaths
from .jobs import SNAPSHOT_KEY_PREFIX, Job, JobRunner, kernel_key, snapshot_key
from .kernel_credentials import KernelCredentials
from .kernel_slots import KernelSlots
from .remote_sync import RemoteListing, RemoteSync
from .status import TreeFacts, cuda_status, newest_snapshot
from .status import kernel_status as describe_kernel
from .uploads import Uploads

# How long a save waits for a kernel that is still starting to answer.
KERNEL_ANSWER_SECONDS = 30.0
# The reason of a save that hibernates its kernel: the slot outlives the process.
HIBERNATE = "hibernate"


class GpuSleeper(Protocol):
    """What hibernation needs of its gpu tier: ``gpu.sleep.GpuSleep`` where this server runs
    the driver itself, ``agent_client.gpu_sleep.AgentGpuSleep`` where the node agent does.
    Each call blocks."""

    @property
    def read_inventory(self) -> Callable[[], GpuInventory | None]: ...

    def asleep(self, root: int) -> dict[str, Any] | None: ...

    def release(self, root: int, note: dict[str, Any] | None = None) -> SleepReport: ...

    def wake(self, root: int) -> SleepReport: ...


def sleep_report(fields: dict[str, Any]) -> SleepReport:
    """A release's or a wake's report as the node agent sends it (``SleepReport.to_dict``)."""
    return SleepReport(
        pids=[int(pid) for pid in fields["pids"]],
        gpu_memory={str(gpu): int(n) for gpu, n in dict(fields["gpu_memory"]).items()},
        held_threads=int(fields["held_threads"]),
        timings={str(step): float(t) for step, t in dict(fields["timings"]).items()},
    )


class SnapshotService:
    """Snapshots of the server's kernels: queries, save and restore jobs, status."""

    # Set by the app: the kernels that died, answered in their status.
    deaths: KernelDeaths | None = None
    # Set by the app: the snapshots hibernated kernels wake from, which neither retention
    # nor a delete takes.
    wakes_from: Callable[[], set[str]] | None = None
    # Set by the app: a kernel's hibernation as GET hibernation lists it, or None.
    hibernation_of: Callable[[str], dict[str, Any] | None] | None = None

    def __init__(
        self,
        engine: SnapshotEngine,
        settings: GPUSnapshot,
        kernel_manager: Any,
        session_manager: Any = None,
        contents_manager: Any = None,
        kernel_spec_manager: Any = None,
        jobs: JobRunner | None = None,
        log: logging.Logger | None = None,
        remote: RemoteSync | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.kernel_manager = kernel_manager
        self.log = log or logging.getLogger(__name__)
        self.jobs = jobs or JobRunner(log=self.log)
        self.slots = KernelSlots(
            kernel_manager, session_manager, contents_manager, kernel_spec_manager, self.log
        )
        # Which kernel a kernel's own credential speaks for, and what it may reach.
        self.credentials = KernelCredentials(kernel_manager, self.slots)
        # With c.GPUSnapshot.remote_url: saves upload, restores download, listings merge.
        self.remote = remote
        self.uploads = Uploads(engine, remote, self.jobs, self.log) if remote is not None else None
        self.tree_facts = TreeFacts(engine.criu)

    # -- snapshots -------------------------------------------------------------------------
    # The engine reads and removes files: every call of it runs in a worker thread, so the
    # event loop answers other requests meanwhile. Unsigned and damaged snapshots are shown
    # too, with their status and problem.
    async def list_snapshots(
        self, notebook_path: str | None = None, with_remote: bool = False
    ) -> list[dict[str, Any]]:
        """The local snapshots, each with its ``location``; ``with_remote`` (the listing
        clients see) adds the remote-only ones. Disk-room and rate estimates want the local
        ones only. The remote listing is cached briefly (``RemoteSync.listing``)."""
        # Summaries of a large store are work of their own: made in the thread too.
        found = await asyncio.to_thread(
            lambda: [s.summary() for s in self.engine.catalog(notebook_path)])
        if with_remote:
            remote = (await self._remote_listing(notebook_path)).snapshots
        else:  # whatever was listed last, without asking the remote
            local_ids = {s["id"] for s in found}
            last = self.remote.cached().snapshots if self.remote else {}
            remote = {i: s for i, s in last.items() if i in local_ids}
        return merge_locations(found, remote, self.remote.url if self.remote else None)

    async def _remote_listing(
        self, notebook_path: str | None = None, fresh: bool = False, trusted: bool = False
    ) -> RemoteListing:
        if self.remote is None:
            return RemoteListing()
        listing = await self.remote.listing(fresh=fresh)
        wanted = {
            i: s for i, s in listing.snapshots.items()
            if (notebook_path is None or (s.status != DAMAGED and s.notebook_path == notebook_path))
            and (s.trusted or not trusted)
        }
        return RemoteListing(wanted, listing.listed_at, listing.error)

    async def latest_snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        """The newest trusted snapshot of each notebook (or of one), whatever its reason."""
        trusted = await asyncio.to_thread(self.engine.list, notebook_path)
        remote = await self._remote_listing(notebook_path, trusted=True)
        summaries = merge_locations(
            [s.summary() for s in trusted], remote.snapshots,
            self.remote.url if self.remote else None,
        )
        return [dict(s) for s in retention.newest_per_notebook(summaries)]

    async def remote_state(self) -> dict[str, Any] | None:
        """The remote store's URL and the error of its last listing, for listings."""
        if self.remote is None:
            return None
        listing = await self.remote.listing()
        return {"url": self.remote.url, "error": listing.error}

    async def _find(self, ref: str) -> tuple[Snapshot, bool]:
        """The snapshot ``ref`` names (an id, or a trusted one's name) and whether it is
        local; a remote-only one when there is no local one. Raises NotFound."""
        try:
            return await asyncio.to_thread(self.engine.get, ref), True
        except NotFound:
            if self.remote is None:
                raise
        listing = await self._remote_listing(fresh=True)
        for snapshot in listing.snapshots.values():
            if ref == snapshot.id or (snapshot.trusted and ref == snapshot.name):
                return snapshot, False
        raise NotFound(
            "lookup",
            f"no snapshot {ref!r} in {self.engine.location} nor in {self.remote.url}"
            + (f" ({listing.error})" if listing.error else ""),
            hint="'jupyter gpu-snapshot list' shows the snapshots there are",
        )

    async def store_usage(self) -> dict[str, Any]:
        """The store's directory and the free space of its file system, for the sidebar."""
        root = self.engine.store.root
        try:
            usage = await asyncio.to_thread(shutil.disk_usage, root)
        except OSError:
            return {"path": str(root), "free_bytes": None}
        return {"path": str(root), "free_bytes": usage.free}

    async def disk_usage(self) -> dict[str, Any]:
        """The store's bytes on disk and what deleting each snapshot frees; it reads every
        recipe of the store, so in a worker thread."""
        found = await asyncio.to_thread(self.engine.store_usage)
        return found.to_dict()

    async def get_snapshot(self, ref: str) -> dict[str, Any]:
        snapshot, local = await self._find(ref)
        if self.remote is None:
            return {**snapshot.summary(), "location": LOCAL, "remote_url": None}
        remote = not local or snapshot.id in (await self.remote.listing()).snapshots
        where = (BOTH if remote else LOCAL) if local else REMOTE
        return {
            **snapshot.summary(), "location": where,
            "remote_url": self.remote.url if remote else None,
        }

    async def gpu_choice(self, ref: str, gpus: str | None = None) -> dict[str, Any]:
        """Where a restore of ``ref`` would put its GPUs on this node, or why it would be
        refused (``gpu.remap.describe_choice``); nothing is restored or reserved."""
        chosen = parse_gpu_choice(gpus) if gpus is not None else None
        snapshot, _ = await self._find(ref)
        if not snapshot.trusted:
            raise NotReady(
                "preflight", f"snapshot {snapshot.id} is {snapshot.status}: {snapshot.problem}",
                hint="only trusted snapshots are restored",
            )
        hook = self._cuda_hook()
        if hook is None:
            return describe_choice(snapshot.id, None, (), chosen, False)
        return await hook.gpu_choice(snapshot, chosen)

    def _cuda_hook(self) -> CudaCheckpointHook | None:
        return next((h for h in self.engine.hooks if isinstance(h, CudaCheckpointHook)), None)

    def gpu_sleep(self) -> GpuSleeper:
        """What releases a kernel's GPU and keeps its process (hibernation's gpu tier): the
        CUDA hook's, or the node agent's. Called on the event loop: the agent is asked
        nothing until a method is called."""
        hook = self._cuda_hook()
        if hook is not None:
            return hook.gpu_sleep()
        if isinstance(self.engine, AgentEngine):
            return AgentGpuSleep(self.engine.client, sleep_report, read_inventory)
        raise NotReady("hibernate", "this server has no CUDA checkpoint hook",
                       hint="hibernate in the process tier instead")

    def _held_for_wake(self) -> set[str]:
        return self.wakes_from() if self.wakes_from is not None else set()

    def _refuse_while_in_use(self, snapshot_id: str, step: str) -> None:
        """Busy when a job (a restore, an upload) holds the snapshot, or a hibernated
        kernel wakes from it."""
        if snapshot_id in self._held_for_wake():
            raise Busy(
                step, f"snapshot {snapshot_id} holds a hibernated kernel, which wakes from it",
                hint="wake the kernel or shut it down first",
            )
        holder = self.jobs.busy_with(snapshot_key(snapshot_id))
        if holder is not None:
            raise Busy(
                step,
                f"snapshot {snapshot_id} is in use by a {holder.kind} job ({holder.id})",
                hint="wait for it to finish",
            )

    async def rename_snapshot(self, ref: str, new_name: str) -> dict[str, Any]:
        """Called by ``SnapshotHandler.patch``; the renamed snapshot's summary.

        A snapshot with a remote copy is renamed here first, then there; ``remote_rename``
        says how that went (a remote that fails leaves the local rename done). A snapshot
        that exists only remotely is refused: it is renamed on a node that has a copy.
        """
        snapshot, local = await self._find(ref)
        if not local:
            assert self.remote is not None
            raise InvalidRequest(
                "rename",
                f"snapshot {snapshot.id} exists only in {self.remote.url}; a snapshot is "
                "renamed on a node that holds a copy",
                hint=f"download it first ('jupyter gpu-snapshot download {snapshot.id}', or "
                "restore it), then rename it",
            )
        self._refuse_while_in_use(snapshot.id, "rename")
        if self.remote is not None:
            validate_name(new_name)
            for other in (await self._remote_listing(trusted=True)).snapshots.values():
                if other.name == new_name and other.id != snapshot.id:
                    raise InvalidRequest(
                        "rename",
                        f"a snapshot named {new_name!r} exists already in {self.remote.url} "
                        f"({other.id})",
                        hint="pick another name, or delete that snapshot first",
                    )
        renamed = await asyncio.to_thread(self.engine.rename, snapshot.id, new_name)
        summary = renamed.summary()
        if self.remote is not None:
            summary["remote_rename"] = await self.remote.rename(renamed)
        return summary

    async def delete_snapshot(self, ref: str, where: str = BOTH) -> None:
        """Delete a snapshot's local copy, remote copy or both (``where``)."""
        if where not in (LOCAL, REMOTE, BOTH):
            raise InvalidRequest(
                "request", f"where must be local, remote or both, not {where!r}"
            )
        if where == REMOTE and self.remote is None:
            raise InvalidRequest(
                "request", "there is no remote store", hint="set c.GPUSnapshot.remote_url"
            )
        snapshot, local = await self._find(ref)
        if where == LOCAL and not local:
            raise NotFound("delete", f"snapshot {snapshot.id} has no local copy",
                           hint="where=remote deletes the remote one")
        self._refuse_while_in_use(snapshot.id, "delete")
        deleted_remote = False
        if where != LOCAL and self.remote is not None:
            deleted_remote = await self.remote.delete(snapshot.id)
            if where == REMOTE and not deleted_remote:
                raise NotFound("delete", f"snapshot {snapshot.id} is not in {self.remote.url}")
        if where != REMOTE and local:
            await asyncio.to_thread(self.engine.delete, snapshot.id)

    # -- kernels ---------------------------------------------------------------------------
    def kernel(self, kernel_id: str) -> Any:
        """The kernel manager of one of the server's kernels; NotFound if there is none."""
        if kernel_id not in self.kernel_manager:
            raise NotFound(
                "lookup",
                f"no kernel {kernel_id!r} on this server",
                hint="GET /api/kernels lists the running kernels",
            )
        return self.kernel_manager.get_kernel(kernel_id)

    async def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        """Readiness, CUDA state, last snapshot and running job of a kernel."""
        km = self.kernel(kernel_id)
        status = await describe_kernel(
            kernel_id,
            km.kernel_name,
            root_pid(km),
            await self.slots.notebook_path(kernel_id),
            await asyncio.to_thread(self.engine.list),
            self.running_job(kernel_id),
            self.tree_facts,
            self.log,
            self.deaths.get(kernel_id) if self.deaths is not None else None,
        )
        status["hibernation"] = self.hibernation_of(kernel_id) if self.hibernation_of else None
        return status

    def dismiss_death(self, kernel_id: str) -> None:
        """Called by ``DELETE kernels/{id}/death``: the user has read of the death."""
        self.kernel(kernel_id)
        if self.deaths is not None:
            self.deaths.dismiss(kernel_id)

    async def newest_snapshot(
        self, kernel_id: str, notebook: str | None, restored_from: str | None = None
    ) -> Snapshot | None:
        """The newest trusted snapshot of the kernel, its notebook, or its origin; once a
        save of the kernel running now has ended. Called by ``KernelDeaths`` for a kernel
        that died: one that died right after its dump is offered the snapshot of that dump,
        which the save commits after the death (its job then fails, naming the death)."""
        saving = self.running_job(kernel_id)
        if saving is not None and saving.kind == "save":
            await self.jobs.wait(saving)
        trusted = await asyncio.to_thread(self.engine.list)
        return newest_snapshot(trusted, kernel_id, notebook, restored_from)

    async def cuda_state(self, root: int | None) -> dict[str, Any] | None:
        """The CUDA state of the kernel tree at ``root``; None when nobody can tell."""
        _, uses_cuda = await asyncio.to_thread(self.tree_facts.get, root)
        return await cuda_status(root, uses_cuda, self.log)

    async def kernel_size(self, kernel_id: str) -> tuple[int, int]:
        """Host and GPU memory of the kernel's processes, which its save has to move.

        Called by ``shutdown.snapshot_kernels_on_shutdown`` to estimate each save's time.
        """
        root = root_pid(self.kernel(kernel_id))
        host = await asyncio.to_thread(procfs.tree_rss, root) if root else 0
        cuda = await self.cuda_state(root)
        return host, int((cuda or {}).get("memory_bytes") or 0)

    def running_job(self, kernel_id: str) -> Job | None:
        return self.jobs.busy_with(kernel_key(kernel_id))

    # -- save ------------------------------------------------------------------------------
    async def start_save(
        self,
        kernel_id: str,
        name: str | None = None,
        stop: bool = False,
        reason: str = "user",
        asleep: bool = False,
    ) -> Job:
        """Validate the request and start a save job; raises at once for a bad request.
        ``asleep``: the kernel sleeps in hibernation's gpu tier and moves to the process
        tier (``Hibernation``, which lists it in that tier from then on): saved as it
        sleeps, it cannot answer meanwhile."""
        self.kernel(kernel_id)
        sleeping = self.hibernation_of(kernel_id) if self.hibernation_of else None
        if sleeping and sleeping.get("tier") == "gpu" and sleeping.get("state") != "requested":
            # criu cannot seize threads that the holder holds; the wake comes first.
            raise Busy("preflight", f"kernel {kernel_id} sleeps with its GPU released",
                       hint="wake it first: run a cell, or POST kernels/{id}/wake")
        if name is not None:
            validate_name(name)
            if await asyncio.to_thread(self.engine.find_name, name) is not None:
                raise InvalidRequest(
                    "preflight",
                    f"a snapshot named {name!r} exists already",
                    hint="pick another name, or delete the old one first",
                )
        job = Job("save", kernel_id, reason=reason)
        return self.jobs.start(
            job, [kernel_key(kernel_id)],
            lambda j: self._save(j, kernel_id, name, stop, reason, asleep),
        )

    async def _save(
        self, job: Job, kernel_id: str, name: str | None, stop: bool, reason: str,
        asleep: bool = False,
    ) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        root = root_pid(km)
        if root is None:
            raise NotFound("preflight", f"kernel {kernel_id} has no running process")
        spec = getattr(km, "kernel_spec", None)
        target = SaveTarget(
            pid=root,
            kernel_name=km.kernel_name,
            kernel_spec=spec.to_dict() if spec is not None else None,
            connection_info=km.get_connection_info(session=False),
            notebook_path=await self.slots.notebook_path(kernel_id),
            kernel_id=kernel_id,
            reason=reason,
        )
        if not asleep:
            await self._until_answering(km, kernel_id)
        # The credential in the kernel's memory, which the snapshot keeps: a tree restored
        # from it may call with it until it is told its new kernel's own.
        credential = getattr(km.provisioner, "kernel_credential", None)
        if stop:
            # criu ends the tree after a stopping dump; the restarter would then start an
            # empty kernel in this slot. It watches again if the kernel survives.
            km.stop_restarter()
        try:
            snapshot = await self.engine.save(
                target, name=name, stop=stop, progress=self.jobs.progress(job)
            )
        except BaseException:
            if stop:
                km.start_restarter()
            raise
        job.snapshot_id = snapshot.id
        self.credentials.saved(snapshot.id, credential)
        if stop and reason == HIBERNATE:
            # The slot, its session and its clients stay; the kernel wakes from the snapshot.
            await km.provisioner.hibernate()
        elif stop:
            await self.slots.shutdown_quietly(kernel_id)
        if self.uploads is not None:
            # Until its upload completes, the snapshot is owed to the remote store; held by
            # this job first, so a retry pass never uploads it beside this job's upload.
            self.jobs.hand_over(job, [], [snapshot_key(snapshot.id)])
            await self.uploads.owe(snapshot.id)
        obsolete = await self._apply_retention(snapshot)
        result = snapshot.summary()
        # Shutdown saves upload once every kernel is saved (``Uploads.upload_on_shutdown``).
        if self.uploads is not None and reason != "shutdown":
            # The kernel is free for its next save while the snapshot goes up.
            self.jobs.hand_over(job, [kernel_key(kernel_id)], [snapshot_key(snapshot.id)])
            result["upload"] = await self.uploads.after_save(
                snapshot, self.jobs.progress(job), obsolete
            )
        return result

    async def _until_answering(self, km: Any, kernel_id: str) -> None:
        """Wait until the kernel answers on its control channel.

        A kernel dumped while it is still starting (before it has bound its ports) comes
        back as a process that never answers; the server lists a kernel as soon as its
        process runs. The control channel answers even while a cell runs.
        """
        if await kernel_answers(km.get_connection_info(), KERNEL_ANSWER_SECONDS):
            return
        raise NotReady(
            "preflight",
            f"kernel {kernel_id} did not answer within {KERNEL_ANSWER_SECONDS:.0f} s",
            hint="is it still starting? Try again once it is idle",
        )

    async def _apply_retention(self, snapshot: Snapshot) -> list[str]:
        """Delete what ``core.retention`` says the new snapshot makes obsolete; return the
        ids deleted.

        Called by ``_save`` once ``snapshot`` has committed, so nothing older goes first.
        """
        trusted = await asyncio.to_thread(self.engine.list)
        doomed = retention.to_delete(
            [s.summary() for s in trusted],
            snapshot.summary(),
            keep_autosaves=int(self.settings.autosave_keep),
            keep_last=int(self.settings.keep_last),
        )
        deleted: list[str] = []
        held = self._held_for_wake()
        for snapshot_id in doomed:
            if snapshot_id in held:
                continue
            if self.jobs.busy_with(snapshot_key(snapshot_id)) is not None:
                continue
            try:
                await asyncio.to_thread(self.engine.delete, snapshot_id)
                deleted.append(snapshot_id)
                self.log.info(
                    "gpu-snapshot: retention removed snapshot %s (%s kept)", snapshot_id,
                    snapshot.id,
                )
            except (SnapshotError, OSError) as exc:
                self.log.warning(
                    "gpu-snapshot: retention could not remove %s: %s", snapshot_id, exc
                )
        return deleted

    # -- restore ---------------------------------------------------------------------------
    async def start_restore(
        self,
        ref: str,
        path: str | None = None,
        session_id: str | None = None,
        gpus: list[Any] | None = None,
        requested_by: str | None = None,
    ) -> Job:
        """Validate the request and start a restore job into a new kernel slot.

        ``gpus``: the GPUs of this node for the process's devices (see ``gpu.remap``).
        A snapshot that exists only remotely is downloaded by the job first.
        ``requested_by``: the kernel whose own credential asks, which may follow the job.
        """
        chosen = parse_gpu_choice(gpus) if gpus is not None else None
        snapshot, local = await self._find(ref)
        session, path = await self.slots.restore_target(path, session_id)
        new_kernel_id = str(uuid.uuid4())
        keys = [snapshot_key(snapshot.id), kernel_key(new_kernel_id)]
        if session is not None:
            # Its kernel is replaced at the end; no other operation may hold it meanwhile.
            keys.append(kernel_key(session["kernel"]["id"]))
        job = Job("restore", new_kernel_id, snapshot.id, requested_by=requested_by)
        return self.jobs.start(
            job, keys, lambda j: self._restore(j, snapshot, session, path, local, chosen)
        )

    async def _restore(
        self,
        job: Job,
        snapshot: Snapshot,
        session: dict[str, Any] | None,
        path: str | None,
        local: bool = True,
        gpus: list[str] | None = None,
    ) -> dict[str, Any]:
        """Restore with the engine, then put the running tree into the new kernel slot
        (``KernelSlots.put_restored``).

        A remote-only snapshot (``local`` False) is downloaded into the store first.
        """
        kernel_id = job.kernel_id
        assert kernel_id is not None
        ours = await self.slots.our_kernelspecs()
        if not ours:  # refuse before a restore that no kernel slot could take
            self.slots.restore_kernel_name(snapshot, ours)
        if not local:
            assert self.remote is not None
            # Its manifest is authenticated: a node that cannot run it refuses before the
            # download, not after gigabytes of it.
            if snapshot.trusted:
                await self.engine.check_compatibility(snapshot, self.jobs.progress(job), {})
            await self.remote.download(
                snapshot.id, self.jobs.progress(job), self.jobs.claimed(SNAPSHOT_KEY_PREFIX)
            )
            snapshot = await asyncio.to_thread(self.engine.get, snapshot.id)
        # The tree runs as soon as criu has restored it, before the kernel manager adopts
        # it: from then on, the credential in its memory speaks for the new kernel.
        credential = self.credentials.restoring(snapshot.id, kernel_id)
        try:
            try:
                restored = await self.engine.restore(
                    snapshot, self.jobs.progress(job), gpus=gpus)
            except PortsInUse as exc:
                # Name the kernel that holds the ports, so a client offers to shut that one.
                exc.details.update(await self.slots.port_holder(snapshot, kernel_id))
                raise
            session_id = await self.slots.put_restored(
                kernel_id, restored, ours, session, path, credential)
        finally:
            self.credentials.restore_ended(kernel_id)
        return {
            "kernel_id": kernel_id, "session_id": session_id,
            "gpu_remap": restored.notes.get("gpu_remap"),
        }
