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
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from jupyter_core.utils import ensure_async

from .._constants import fallback_report_lines
from ..config import GPUSnapshot
from ..core import procfs
from ..core.errors import (
    Busy,
    InvalidRequest,
    NotFound,
    NotReady,
    PortsInUse,
    SnapshotError,
)
from ..core.estimate import SaveRates, learn_kernel_rates
from ..core.hooks import Progress, SaveTarget
from ..core.store import Snapshot, to_delete, validate_name
from ..launch.liveness import kernel_answers
from ..launch.provisioner import root_pid
from ..node import fallback as fallback_modes
from ..node.engine import GpuSleeper
from ..node.gpus import parse_gpu_choice
from ..node.remotes import BOTH
from ..node.save_requests import kernel_history, portable_writer
from ..node.snapshots import Found, NodeSnapshots
from .deaths import KernelDeaths
from .jobs import SNAPSHOT_KEY_PREFIX, Job, JobRunner, kernel_key, snapshot_key
from .kernel_credentials import KernelCredentials
from .kernel_env import shell_client
from .kernel_slots import KernelSlots
from .remote_sync import RemoteListing, RemoteSync
from .sleepers import Sleepers
from .status import TreeFacts, cuda_status
from .status import kernel_status as describe_kernel
from .uploads import Uploads

T = TypeVar("T")
# How long a save waits for a kernel that is still starting to answer.
KERNEL_ANSWER_SECONDS = 30.0
# The reason of a save that hibernates its kernel: the slot outlives the process.
HIBERNATE = "hibernate"


class SnapshotService:
    """Snapshots of the server's kernels: queries, save and restore jobs, status."""

    def __init__(
        self,
        node: NodeSnapshots,
        settings: GPUSnapshot,
        *,
        slots: KernelSlots,
        jobs: JobRunner,
        deaths: KernelDeaths,
        sleepers: Sleepers,
        log: logging.Logger | None = None,
        remote: RemoteSync | None = None,
        listing_changed: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        # This node's snapshots, local and remote: each operation on them is the node's.
        self.node = node
        self.engine = node.engine
        self.settings = settings
        # The server's kernels and sessions; the service's kernel manager is theirs.
        self.slots = slots
        self.kernel_manager = slots.kernel_manager
        self.log = log or logging.getLogger(__name__)
        self.jobs = jobs
        # The kernels that died, answered in their status.
        self.deaths = deaths
        # Hibernation's sleeping kernels: a kernel's hibernation, and the snapshots the
        # hibernated kernels wake from, which neither retention nor a delete takes.
        self.sleepers = sleepers
        # Which kernel a kernel's own credential speaks for, and what it may reach.
        self.credentials = KernelCredentials(self.kernel_manager, self.slots)
        # With c.GPUSnapshot.remote_url: saves upload, restores download, listings merge.
        self.remote = remote
        self.uploads = (Uploads(self.engine, remote, self.jobs, self.log)
                        if remote is not None else None)
        self.tree_facts = TreeFacts(self.engine.node_problems)
        # Kernels that did not say which cells they ran: not asked again at each save.
        self._unrecorded_kernels: set[str] = set()
        # Tells clients that the listing changed without a job (the snapshots/v1 event).
        self._listing_changed = listing_changed or (lambda _data: None)

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
        if with_remote:
            remote = (await self._remote_listing()).snapshots
        else:  # whatever was listed last, without asking the remote
            remote = self.remote.cached().snapshots if self.remote else {}
        # Summaries of a large store are work of their own: made in the thread too.
        return await asyncio.to_thread(
            lambda: self.node.summaries(remote, notebook_path, remote_only=with_remote))

    async def _remote_listing(self, fresh: bool = False) -> RemoteListing:
        if self.remote is None:
            return RemoteListing()
        return await self.remote.listing(fresh=fresh)

    async def latest_snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        """The newest trusted snapshot of each notebook (or of one), whatever its reason."""
        remote = (await self._remote_listing()).snapshots
        return await asyncio.to_thread(self.node.summaries, remote, notebook_path, True)

    async def remote_state(self) -> dict[str, Any] | None:
        """The remote store's URL and the error of its last listing, for listings."""
        if self.remote is None:
            return None
        listing = await self.remote.listing()
        return {"url": self.remote.url, "error": listing.error}

    async def _find(self, ref: str) -> Found:
        """The snapshot ``ref`` names (an id, or a trusted one's name): the local one, else
        the remote one, from a fresh listing. Raises NotFound."""
        try:
            return Found(await asyncio.to_thread(self.node.get, ref), True)
        except NotFound as exc:
            if self.remote is None:
                raise
            missing = exc
        listing = await self._remote_listing(fresh=True)
        try:
            return await asyncio.to_thread(self.node.find, ref, listing.snapshots)
        except NotFound as exc:
            if listing.error is None:
                raise
            raise NotFound(exc.step, f"{exc.cause} ({listing.error})", hint=exc.hint) from missing

    async def store_usage(self) -> dict[str, Any]:
        """The store's directory and the free space of its file system, for the sidebar
        (the node agent's store for a server that goes through it)."""
        return (await asyncio.to_thread(self.engine.store_room)).to_dict()

    async def disk_usage(self) -> dict[str, Any]:
        """The store's bytes on disk and what deleting each snapshot frees; it reads every
        recipe of the store, so in a worker thread."""
        found = await asyncio.to_thread(self.engine.store_usage)
        return found.to_dict()

    async def get_snapshot(self, ref: str) -> dict[str, Any]:
        found = await self._find(ref)
        return self.node.located(found, (await self._remote_listing()).snapshots)

    async def gpu_choice(self, ref: str, gpus: str | None = None) -> dict[str, Any]:
        """Where a restore of ``ref`` would put its GPUs on this node, or why it would be
        refused (``gpu.remap.describe_choice``); nothing is restored or reserved."""
        chosen = parse_gpu_choice(gpus) if gpus is not None else None
        snapshot = (await self._find(ref)).snapshot
        if not snapshot.trusted:
            raise NotReady(
                "preflight", f"snapshot {snapshot.id} is {snapshot.status}: {snapshot.problem}",
                hint="only trusted snapshots are restored",
            )
        return await self.engine.gpu_choice(snapshot, chosen)

    def gpu_sleep(self) -> GpuSleeper:
        """What releases a kernel's GPU and keeps its process (hibernation's gpu tier): the
        CUDA hook's, or the node agent's; NotReady without either. Called on the event
        loop: the agent is asked nothing until a method is called."""
        return self.engine.gpu_sleep()

    def _refuse_while_in_use(self, snapshot_id: str, step: str) -> None:
        """Busy when a job (a restore, an upload) holds the snapshot, or a hibernated
        kernel wakes from it."""
        if snapshot_id in self.sleepers.wakes_from():
            raise Busy(
                step, f"snapshot {snapshot_id} holds a hibernated kernel, which wakes from it",
                hint="wake the kernel or shut it down first",
                details={"in_use_by": "hibernation"},
            )
        holder = self.jobs.busy_with(snapshot_key(snapshot_id))
        if holder is not None:
            raise Busy(
                step,
                f"snapshot {snapshot_id} is in use by a {holder.kind} job ({holder.id})",
                hint="wait for it to finish",
                details={"in_use_by": holder.kind, "job_id": holder.id},
            )

    async def rename_snapshot(self, ref: str, new_name: str) -> dict[str, Any]:
        """Called by ``SnapshotHandler.patch``; the renamed snapshot's summary.

        A snapshot with a remote copy is renamed here first, then there; ``remote_rename``
        says how that went (a remote that fails leaves the local rename done). A snapshot
        that exists only remotely is refused: it is renamed on a node that has a copy.
        """
        found = await self._find(ref)
        remote = (await self._remote_listing()).snapshots
        self.node.check_rename(found, new_name, remote)
        self._refuse_while_in_use(found.snapshot.id, "rename")
        try:
            renamed, remote_rename = await asyncio.to_thread(self.node.rename, found, new_name)
        finally:
            if self.remote is not None:
                self.remote.forget()
        summary = renamed.summary()
        if remote_rename is not None:
            summary["remote_rename"] = remote_rename
        self._listing_changed({"action": "renamed", "snapshot_id": renamed.id})
        return summary

    async def delete_snapshot(self, ref: str, where: str = BOTH) -> None:
        """Delete a snapshot's local copy, remote copy or both (``where``)."""
        found = await self._find(ref)
        self.node.check_delete(found, where)
        self._refuse_while_in_use(found.snapshot.id, "delete")
        try:
            await asyncio.to_thread(self.node.delete, found, where)
        finally:
            if self.remote is not None:
                self.remote.forget()
        self._listing_changed({"action": "deleted", "snapshot_id": found.snapshot.id})

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
        """Readiness, CUDA state, last snapshot and running job of a kernel, and whether
        its save at shutdown fits the budget."""
        km = self.kernel(kernel_id)
        root = root_pid(km)
        status = await describe_kernel(
            kernel_id,
            km.kernel_name,
            root,
            await self.slots.notebook_path(kernel_id),
            await asyncio.to_thread(self.node.list),
            self.running_job(kernel_id),
            self.tree_facts,
            self.log,
            self.deaths.get(kernel_id),
            restored_from=getattr(km.provisioner, "adopted_snapshot", None),
        )
        status["hibernation"] = self.sleepers.describe(kernel_id)
        fill = await asyncio.to_thread(self.engine.criu_fill)
        status["criu"] = fill.to_dict() if fill is not None else None
        status["shutdown_save"] = (
            await self._shutdown_save(kernel_id, root, status["cuda"])
            if status["ready"] and self.settings.snapshot_on_shutdown else None
        )
        return status

    async def _shutdown_save(
        self, kernel_id: str, root: int | None, cuda: dict[str, Any] | None
    ) -> dict[str, Any]:
        """How long the kernel's save at shutdown would take now, and whether it fits
        ``shutdown_budget`` (the shutdown saves only what fits)."""
        host = await asyncio.to_thread(procfs.tree_rss, root) if root else 0
        gpu = int((cuda or {}).get("memory_bytes") or 0)
        rates = await self.save_rates(kernel_id)
        seconds = rates.seconds(host, gpu)
        budget = float(self.settings.shutdown_budget)
        return {"seconds": round(seconds, 1), "budget": budget, "fits": seconds <= budget,
                "learned_from": rates.learned_from}

    async def save_rates(self, kernel_id: str | None = None) -> SaveRates:
        """The rates a save of ``kernel_id`` (of any kernel: None) is timed with: the
        configured ``c.GPUSnapshot.save_*``, else learned from this store's past saves,
        the kernel's own (or its notebook's) first. Called by the shutdown and the status."""
        notebook = await self.slots.notebook_path(kernel_id) if kernel_id else None
        learned = learn_kernel_rates(await self.list_snapshots(), kernel_id, notebook)
        s = self.settings
        return SaveRates(
            gpu_rate=s.save_gpu_rate or learned.gpu_rate,
            image_rate=s.save_image_rate or learned.image_rate,
            fixed_seconds=s.save_fixed_seconds or learned.fixed_seconds,
            learned_from=learned.learned_from,
        )

    def dismiss_death(self, kernel_id: str) -> None:
        """Called by ``DELETE kernels/{id}/death``: the user has read of the death."""
        self.kernel(kernel_id)
        self.deaths.dismiss(kernel_id)

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
        portable: bool = False,
    ) -> Job:
        """Validate the request and start a save job; raises at once for a bad request.
        ``asleep``: the kernel sleeps in hibernation's gpu tier and moves to the process
        tier (``Hibernation``, which lists it in that tier from then on): saved as it
        sleeps, it cannot answer meanwhile. ``portable``: the kernel writes a portable
        copy of its namespace into the snapshot first (``node/fallback.py``)."""
        if portable and asleep:
            raise InvalidRequest("preflight", "a sleeping kernel cannot write a portable copy")
        self.kernel(kernel_id)
        sleeping = self.sleepers.describe(kernel_id)
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
            lambda j: self._save(j, kernel_id, name, stop, reason, asleep, portable),
        )

    async def _save(
        self, job: Job, kernel_id: str, name: str | None, stop: bool, reason: str,
        asleep: bool = False, portable: bool = False,
    ) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        root = root_pid(km)
        if root is None:
            raise NotFound("preflight", f"kernel {kernel_id} has no running process")
        spec = getattr(km, "kernel_spec", None)
        info = km.get_connection_info(session=False)
        if not asleep:
            await self._until_answering(km, kernel_id)
        target = SaveTarget(
            pid=root,
            kernel_name=km.kernel_name,
            kernel_spec=spec.to_dict() if spec is not None else None,
            connection_info=info,
            notebook_path=await self.slots.notebook_path(kernel_id),
            kernel_id=kernel_id,
            reason=reason,
            history=None if asleep else await self._cells_of(kernel_id, info),
        )
        if portable:
            target.portable = portable_writer(info)
        elif not asleep and reason in self.settings.portable_on:
            target.portable = portable_writer(info, self.settings.portable_budget_seconds)
            target.portable_required = False
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

    async def _cells_of(self, kernel_id: str, info: dict[str, Any]) -> dict[str, Any] | None:
        """The cells the kernel ran, for the manifest; None from a kernel that does not
        record them (asked once: it would cost every save the wait)."""
        if kernel_id in self._unrecorded_kernels:
            return None
        history = await kernel_history(info)
        if history is None:
            self._unrecorded_kernels.add(kernel_id)
            self.log.info("gpu-snapshot: kernel %s does not say which cells it ran; its "
                          "snapshots cannot be replayed", kernel_id)
        return history

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
        """Delete what the store's retention rules (``core/store/retention.py``) say the new
        snapshot makes obsolete; return the ids deleted.

        Called by ``_save`` once ``snapshot`` has committed, so nothing older goes first.
        """
        trusted = await asyncio.to_thread(self.node.list)
        doomed = to_delete(
            [s.summary() for s in trusted],
            snapshot.summary(),
            keep_autosaves=int(self.settings.autosave_keep),
            keep_last=int(self.settings.keep_last),
        )
        deleted: list[str] = []
        held = self.sleepers.wakes_from()
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
        fallback: str | None = None,
    ) -> Job:
        """Validate the request and start a restore job into a new kernel slot.

        ``gpus``: the GPUs of this node for the process's devices (see ``gpu.remap``).
        A snapshot that exists only remotely is downloaded by the job first.
        ``requested_by``: the kernel whose own credential asks, which may follow the job.
        ``fallback``: no image restore; a fresh kernel gets the work back by one of
        ``node.fallback.MODES``.
        """
        chosen = parse_gpu_choice(gpus) if gpus is not None else None
        found = await self._find(ref)
        snapshot, local = found.snapshot, found.local
        if fallback is not None:
            if gpus is not None:
                raise InvalidRequest("preflight", "gpus choose where an image restores; a "
                                     "fallback starts a fresh kernel")
            fallback_modes.require_offered(snapshot, fallback)
        session, path = await self.slots.restore_target(path, session_id)
        new_kernel_id = str(uuid.uuid4())
        keys = [snapshot_key(snapshot.id), kernel_key(new_kernel_id)]
        if session is not None:
            # Its kernel is replaced at the end; no other operation may hold it meanwhile.
            keys.append(kernel_key(session["kernel"]["id"]))
        job = Job("restore", new_kernel_id, snapshot.id, requested_by=requested_by)
        if fallback is not None:
            mode = fallback
            return self.jobs.start(
                job, keys, lambda j: self._fall_back(j, snapshot, session, path, local, mode))
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
                await self._offering_fallback(snapshot, self.engine.check_compatibility(
                    snapshot, self.jobs.progress(job), {}))
            snapshot = await self.remote.download(
                snapshot, self.jobs.progress(job), self.jobs.claimed(SNAPSHOT_KEY_PREFIX)
            )
        # The tree runs as soon as criu has restored it, before the kernel manager adopts
        # it: from then on, the credential in its memory speaks for the new kernel.
        credential = self.credentials.restoring(snapshot.id, kernel_id)
        try:
            try:
                restored = await self._offering_fallback(snapshot, self.engine.restore(
                    snapshot, self.jobs.progress(job), gpus=gpus))
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

    async def _offering_fallback(self, snapshot: Snapshot, step: Awaitable[T]) -> T:
        """``step`` of a restore, its failure telling the client which fallbacks the
        snapshot offers (``details.fallback``): a refused or failed image is where they
        are offered. A refusal that is about the request or this moment (taken ports, a
        busy snapshot) offers none: trying again can work."""
        try:
            return await step
        except SnapshotError as exc:
            offered = fallback_modes.offer_for(exc, snapshot)
            if offered:
                exc.details["fallback"] = offered
            raise

    async def _fall_back(
        self,
        job: Job,
        snapshot: Snapshot,
        session: dict[str, Any] | None,
        path: str | None,
        local: bool,
        mode: str,
    ) -> dict[str, Any]:
        """A fresh kernel in a new slot, given the work back by ``mode``
        (``node.fallback.bring_back``), then the notebook's session switched to it. If the
        kernel fails meanwhile, it is shut down and the session keeps its kernel; the
        snapshot is untouched either way."""
        kernel_id = job.kernel_id
        assert kernel_id is not None
        ours = await self.slots.our_kernelspecs()
        kernel_name = self.slots.restore_kernel_name(snapshot, ours)
        progress = self.jobs.progress(job)

        def say(text: str) -> None:
            progress(Progress("fallback", message=text))

        if not local and fallback_modes.needs_portable_files(mode):
            assert self.remote is not None
            snapshot = await self.remote.download(
                snapshot, progress, self.jobs.claimed(SNAPSHOT_KEY_PREFIX))
        say("starting a fresh kernel")
        km = await self.slots.start_fresh(kernel_id, kernel_name, path)
        client = shell_client(km)
        alive, stop_following = _alive_until_it_dies(km)
        try:
            fresh = fallback_modes.FreshKernel(client, alive)
            report = await fallback_modes.bring_back(fresh, self.engine, snapshot, mode, say)
            session_id = await self.slots.attach_fresh(kernel_id, session, path)
            # A notebook that asked from a cell sees the report there: the cell that asked
            # ends with its kernel, which the session just left.
            self.slots.tell_new_slot(kernel_id, "\n".join([
                f"This kernel is a fresh one: snapshot {snapshot.name}'s image could not "
                f"come back, its work did ({mode}):", *fallback_report_lines(report)]))
        except BaseException:
            await self.slots.shutdown_quietly(kernel_id)
            raise
        finally:
            stop_following()
            client.stop_channels()
        return {"kernel_id": kernel_id, "session_id": session_id, "fallback": report}


def _alive_until_it_dies(km: Any) -> tuple[Callable[[], Awaitable[bool]], Callable[[], None]]:
    """Whether the fresh kernel of a fallback still lives, and how to stop asking its
    restarter. The server's restarter replaces a kernel that died with a blank one in the
    same manager, for which ``is_alive`` says yes again: a death the restarter reports
    (before it restarts, or when it gives up) ends the fresh kernel for the fallback, whose
    wait for a reply would otherwise never end."""
    died = False

    def on_death() -> None:
        nonlocal died
        died = True

    for event in ("restart", "dead"):
        km.add_restart_callback(on_death, event)

    async def alive() -> bool:
        return not died and bool(await ensure_async(km.is_alive()))

    def stop_following() -> None:
        for event in ("restart", "dead"):
            km.remove_restart_callback(on_death, event)

    return alive, stop_following
