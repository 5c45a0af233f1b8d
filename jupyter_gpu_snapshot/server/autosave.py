"""Autosave: snapshot the server's kernels on a schedule, so that a node loss costs little.

A kernel is autosaved

- every ``autosave_interval_minutes`` after its last snapshot, but only if it ran something
  since (an idle kernel is not saved again), and, unless ``autosave_during_cell``, only
  between cells;
- as soon as a cell that ran ``autosave_after_cell_minutes`` or longer has ended.

Autosaves are ordinary save jobs with reason ``autosave``: one operation per kernel still
holds (a kernel that is being saved or restored is skipped, and the log says so), and the
store's retention keeps the newest ``autosave_keep`` of each notebook. A notebook may
override the settings (``notebook_policies``: ``PUT kernels/{id}/autosave``,
``%gpu_snapshot autosave``); an autosave the disk or the host's memory cannot take is
skipped (``autosave_admission``).

What "ran something" means: a cell, as the kernel's IOPub channel tells it
(``execution_feed``). The scheduler follows each kernel's cells from when it first sees the
kernel, so a snapshot's ``created`` time is the line between saved and unsaved work. New
kernels are followed as they start (jupyter_server's kernel_actions event), and once the
feed's subscription has taken effect the kernel is asked how many cells it ran, which
covers cells run before. Restored kernels are followed as their restore succeeds; a kernel
the scheduler meets otherwise (one running when the server started) is read from the
server's ``last_activity``, generously.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..config import GPUSnapshot
from ..core.errors import Busy, SnapshotError
from ..launch.provisioner import root_pid
from .autosave_admission import AutosaveAdmission
from .execution_feed import ExecutionFeed, ran_unseen_cells
from .jobs import Job
from .jupyter_server_internals import last_activity
from .kernel_env import shell_client
from .notebook_policies import AutosavePolicy, NotebookPolicies, policy_key
from .service import SnapshotService

# A fresh kernel's own start-up messages are not work anyone would miss.
STARTUP_SETTLE_SECONDS = 10.0
# How soon a new kernel's cells are followed.
DISCOVER_SECONDS = 0.1


@dataclass
class KernelWatch:
    """What the scheduler knows of one kernel (wall-clock times, seconds since the epoch)."""

    first_seen: float
    # Activity after this time is not in any snapshot yet.
    clean_since: float
    last_snapshot_id: str | None = None
    last_snapshot_at: float | None = None
    feed: ExecutionFeed | None = None
    # Activity from before the feed started, when it may have been a cell.
    blind_work: float | None = None
    # An autosave that was refused or failed is not tried again before this time.
    not_before: float = 0.0
    policy_key: str = ""
    last_autosave: dict[str, Any] | None = None
    last_skip: str | None = None
    noted_jobs: set[str] = field(default_factory=set)
    # Asks a kernel that has just started whether it ran cells the feed did not see.
    probe: asyncio.Task[None] | None = None


class AutosaveScheduler:
    """Started by ``GPUSnapshotApp`` once the server listens; stopped before shutdown saves."""

    def __init__(
        self, service: SnapshotService, settings: GPUSnapshot, log: logging.Logger | None = None
    ) -> None:
        self.service = service
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        # The notebooks' overrides are kept in the user's own directory of snapshots.
        self.policies = NotebookPolicies(service.engine.own_dir, settings, self.log)
        self.admission = AutosaveAdmission(
            settings,
            store_room=lambda: service.store_usage(),
            # Looked up at each call: tests replace the service's methods.
            list_snapshots=lambda: service.list_snapshots(),
            cuda_state=lambda root: service.cuda_state(root),
        )
        self._watch: dict[str, KernelWatch] = {}
        self._task: asyncio.Task[None] | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Called by ``GPUSnapshotApp._start_jupyter_server_extension``."""
        self.policies.load()
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Called by ``GPUSnapshotApp.stop_extension`` before the shutdown saves.

        The kernels' cell feeds stay open: the shutdown asks ``work_at_risk``.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def probes_settled(self, timeout: float) -> None:
        """Until each new kernel has said whether it ran cells before its feed listened, or
        ``timeout`` s: a server stopped right after a kernel started and ran a cell would
        otherwise find no work to save. A kernel still unsure after that counts as work."""
        pending = [w.probe for w in self._watch.values() if w.probe and not w.probe.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def close(self) -> None:
        """Called by ``GPUSnapshotApp.stop_extension`` once the shutdown saves are done."""
        for kernel_id in list(self._watch):
            self._forget(kernel_id)

    async def _run(self) -> None:
        next_tick = 0.0
        while True:
            try:
                if time.monotonic() >= next_tick:
                    await self.tick()
                    next_tick = time.monotonic() + float(self.settings.autosave_check_seconds)
                else:
                    await self._discover()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end autosaving for good
                self.log.exception("gpu-snapshot: the autosave scheduler failed a round")
            await asyncio.sleep(DISCOVER_SECONDS)

    async def _discover(self) -> None:
        """Start following the cells of kernels that appeared since the last look.

        Often, and cheaply (a set difference): a cell run before the feed starts is seen
        only through the server's coarse ``last_activity``.
        """
        for kernel_id in list(self.service.kernel_manager.list_kernel_ids()):
            if kernel_id not in self._watch and kernel_id in self.service.kernel_manager:
                await self._ensure_watch(kernel_id)

    async def _ensure_watch(self, kernel_id: str) -> KernelWatch:
        """The kernel's watch, made at the first look (by whichever caller comes first)."""
        watch = self._watch.get(kernel_id)
        if watch is not None:
            return watch
        km = self.service.kernel_manager.get_kernel(kernel_id)
        watch = await self._first_look(kernel_id, km, time.time())
        if kernel_id in self._watch:  # another caller looked meanwhile
            if watch.feed is not None:
                watch.feed.close()
            return self._watch[kernel_id]
        self._watch[kernel_id] = watch
        return watch

    # -- policies ------------------------------------------------------------------------
    async def set_override(self, kernel_id: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change the policy of the kernel's notebook; called by the REST handler."""
        self.service.kernel(kernel_id)
        key = policy_key(kernel_id, await self.service.slots.notebook_path(kernel_id))
        await self.policies.change(key, changes)
        return await self.describe(kernel_id)

    # -- what the API shows ----------------------------------------------------------------
    async def describe(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's autosave state (openapi.yaml, AutosaveState)."""
        self.service.kernel(kernel_id)
        notebook = await self.service.slots.notebook_path(kernel_id)
        key = policy_key(kernel_id, notebook)
        watch = await self._ensure_watch(kernel_id)
        job = self.service.running_job(kernel_id)
        policy = self.policies.policy(key)
        next_at = None
        if watch is not None and policy.enabled and self.work_at_risk(kernel_id) > 0:
            next_at = self._due(watch, policy)
        return {
            "kernel_id": kernel_id,
            "notebook_path": notebook,
            "policy": policy.to_dict(),
            "override": self.policies.override(key),
            "unsaved_work": self.work_at_risk(kernel_id) > 0,
            "next_autosave": next_at,
            "autosaving": job is not None and job.reason == "autosave",
            "last_autosave": watch.last_autosave if watch else None,
            "last_skip": watch.last_skip if watch else None,
        }

    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of jupyter_server's kernel_actions events (``wiring`` adds it).

        A kernel that has just started is followed from now, before the server has answered
        the request that started it. The feed's subscription still takes effect a little
        later, so a client may run a cell before it: ``_count_unseen_cells`` asks the kernel
        about those. The scheduler's own discovery would come later still (a look that
        waits for worker threads on a busy machine), and would have only the server's
        ``last_activity`` for the time before, which the kernel's start-up moves as well.
        """
        kernel_id = str(data.get("kernel_id") or "")
        started = data.get("action") == "start" and data.get("status") == "success"
        if started and kernel_id and kernel_id not in self._watch:
            watch = self._follow_from_now(kernel_id)
            if watch is not None and watch.feed is not None:
                watch.probe = asyncio.create_task(self._count_unseen_cells(kernel_id, watch))

    async def _count_unseen_cells(self, kernel_id: str, watch: KernelWatch) -> None:
        """Whether a new kernel ran cells before its feed went live; if so, they are work.

        The feed is made as the kernel starts, but its subscription takes effect only some
        time later, and a client may run a cell before that (``ran_unseen_cells``).
        """
        assert watch.feed is not None
        client = shell_client(self.service.kernel_manager.get_kernel(kernel_id))
        try:
            if await ran_unseen_cells(client, watch.feed):
                watch.blind_work = time.time()
        except Exception as exc:  # no answer to read: count the kernel as having worked
            watch.blind_work = time.time()
            self.log.info("gpu-snapshot: could not ask kernel %s what it ran: %s",
                          kernel_id, exc)
        finally:
            client.stop_channels()

    def note_restored(self, kernel_id: str) -> None:
        """Called by the job runner's event sink (``wiring``) as a restore or wake job
        succeeds.

        The kernel is its snapshot at this moment: its cells are followed from now, before
        any client hears of it, so the first cell it runs counts.
        """
        self._forget(kernel_id)
        self._follow_from_now(kernel_id)

    def _follow_from_now(self, kernel_id: str) -> KernelWatch | None:
        """A watch of the kernel, clean now, following its cells from now on."""
        if kernel_id not in self.service.kernel_manager:
            return None
        now = time.time()
        watch = self._watch[kernel_id] = KernelWatch(first_seen=now, clean_since=now)
        try:
            watch.feed = ExecutionFeed(self.service.kernel_manager.get_kernel(kernel_id))
        except Exception as exc:
            self.log.warning("gpu-snapshot: cannot follow the cells of kernel %s: %s",
                             kernel_id, exc)
        return watch

    def work_at_risk(self, kernel_id: str) -> float:
        """Seconds of work since the kernel's newest snapshot; called by the shutdown.

        0 means that the newest snapshot holds all its work; a kernel never looked at
        counts as all work.
        """
        watch = self._watch.get(kernel_id)
        if watch is None or watch.feed is None:
            return float("inf")
        if watch.probe is not None and not watch.probe.done():
            # Whether it ran cells before its feed listened is not known yet.
            return float("inf")
        self._note_jobs(kernel_id, watch)
        if watch.feed.running_since is not None:
            return max(1e-3, time.time() - watch.clean_since)
        last = max(watch.feed.last_work or 0.0, watch.blind_work or 0.0)
        if last <= watch.clean_since:
            return 0.0
        return last - watch.clean_since

    def newest_snapshot(self, kernel_id: str) -> str | None:
        watch = self._watch.get(kernel_id)
        if watch is None:
            return None
        self._note_jobs(kernel_id, watch)
        return watch.last_snapshot_id

    # -- the schedule ----------------------------------------------------------------------
    def _forget(self, kernel_id: str) -> None:
        watch = self._watch.pop(kernel_id, None)
        if watch is not None and watch.probe is not None:
            watch.probe.cancel()
        if watch is not None and watch.feed is not None:
            watch.feed.close()

    async def tick(self) -> None:
        """Look at every kernel once and start the autosaves that are due."""
        kernel_ids = list(self.service.kernel_manager.list_kernel_ids())
        for gone in set(self._watch) - set(kernel_ids):
            self._forget(gone)
        for kernel_id in kernel_ids:
            if kernel_id not in self.service.kernel_manager:
                continue  # shut down meanwhile
            await self._consider(kernel_id, await self.service.slots.notebook_path(kernel_id))

    async def _first_look(self, kernel_id: str, km: Any, now: float) -> KernelWatch:
        """Where a kernel's unsaved work starts, the first time the scheduler sees it.

        The cell feed starts now; for the time before, only the server's ``last_activity``
        tells, and it also moves on requests that are no work (a reconnecting client), so
        it is read generously: a kernel restored by this server counts as unsaved if
        anything happened since the restore; a kernel whose activity came within its
        start-up has run nothing; any other counts as unsaved since its start.
        """
        activity = last_activity(km) or now
        started = now
        root = root_pid(km)
        if root is not None:
            with contextlib.suppress(psutil.Error):
                started = await asyncio.to_thread(lambda: psutil.Process(root).create_time())
        restored = [
            j.finished for j in self.service.jobs.recent(kernel_id)
            if j.kind == "restore" and j.finished is not None
        ]
        if restored:
            clean = max(restored)  # the env update of the adoption came before this
            blind = activity if activity > clean else None
        elif activity - started <= STARTUP_SETTLE_SECONDS:
            clean, blind = now, None
        else:
            clean, blind = started, activity
        watch = KernelWatch(first_seen=now, clean_since=clean, blind_work=blind)
        try:
            watch.feed = ExecutionFeed(km)
        except Exception as exc:  # no IOPub to read: every look counts as unsaved work
            self.log.warning("gpu-snapshot: cannot follow the cells of kernel %s: %s",
                             kernel_id, exc)
        return watch

    def _note_jobs(self, kernel_id: str, watch: KernelWatch) -> None:
        """Learn of saves of this kernel that ended (autosaves and the user's alike)."""
        interval = self.policies.policy(watch.policy_key).interval_minutes * 60
        for job in reversed(self.service.jobs.recent(kernel_id)):
            if job.kind != "save" or job.finished is None or job.id in watch.noted_jobs:
                continue
            watch.noted_jobs.add(job.id)
            result = job.result or {}
            if job.status == "succeeded" and result.get("created"):
                created = float(result["created"])
                if created > (watch.last_snapshot_at or 0):
                    watch.last_snapshot_at, watch.last_snapshot_id = created, job.snapshot_id
                    watch.clean_since = max(watch.clean_since, created)
                if job.reason == "autosave":
                    pause = (result.get("timings") or {}).get("pause")
                    watch.last_autosave = {
                        "snapshot_id": job.snapshot_id, "created": created, "pause": pause,
                        "size_bytes": result.get("size_bytes"),
                    }
                    watch.last_skip = None
            elif job.reason == "autosave":
                message = (job.error or {}).get("message", "unknown error")
                watch.last_skip = message
                watch.not_before = (job.finished or time.time()) + interval
                self.log.warning(
                    "gpu-snapshot: the autosave of kernel %s failed; next try in %.0f s: %s",
                    kernel_id, interval, message,
                )

    async def _consider(self, kernel_id: str, notebook: str | None) -> None:
        now = time.time()
        km = self.service.kernel_manager.get_kernel(kernel_id)
        watch = await self._ensure_watch(kernel_id)
        watch.policy_key = policy_key(kernel_id, notebook)
        policy = self.policies.policy(watch.policy_key)
        interval = policy.interval_minutes * 60
        self._note_jobs(kernel_id, watch)

        feed = watch.feed
        busy = feed is not None and feed.running_since is not None
        long_cell = False
        if feed is not None and feed.long_cells:
            longest, feed.long_cells = max(feed.long_cells), []
            long_cell = 0 < policy.after_cell_minutes * 60 <= longest
        if not policy.enabled:
            return
        if self.service.running_job(kernel_id) is not None:
            return  # a save or restore of it is under way; look again next round
        dirty = self.work_at_risk(kernel_id) > 0
        due = self._due(watch, policy)
        if long_cell and not busy:
            why = f"a cell ran {policy.after_cell_minutes:g} min or longer"
        elif dirty and now >= due and (policy.during_cell or not busy):
            why = f"{policy.interval_minutes:g} min since its last snapshot"
        else:
            return
        watch.not_before = now + interval
        await self._autosave(kernel_id, km, notebook, watch, why)

    @staticmethod
    def _due(watch: KernelWatch, policy: AutosavePolicy) -> float:
        """When the interval autosave is due, should the kernel have unsaved work."""
        since = watch.last_snapshot_at or watch.first_seen
        return max(since + policy.interval_minutes * 60, watch.not_before)

    async def _autosave(
        self, kernel_id: str, km: Any, notebook: str | None, watch: KernelWatch, why: str
    ) -> Job | None:
        where = notebook or "no notebook"
        refusal = await self.admission.refusal(kernel_id, km, notebook)
        if refusal is not None:
            repeated = watch.last_skip == f"skipped: {refusal}"
            watch.last_skip = f"skipped: {refusal}"
            # A kernel of another kernelspec is never autosaved: say so once, quietly.
            if "not snapshot-ready" in refusal:
                if not repeated:
                    self.log.info("gpu-snapshot: not autosaving kernel %s (%s): %s",
                                  kernel_id, where, refusal)
                return None
            self.log.warning(
                "gpu-snapshot: skipped the autosave of kernel %s (%s): %s", kernel_id, where,
                refusal,
            )
            return None
        try:
            job = await self.service.start_save(kernel_id, reason="autosave")
        except Busy as exc:
            self.log.info(
                "gpu-snapshot: skipped the autosave of kernel %s (%s): %s", kernel_id, where,
                exc.cause,
            )
            return None
        except SnapshotError as exc:
            watch.last_skip = f"skipped: {exc.message}"
            self.log.warning(
                "gpu-snapshot: could not autosave kernel %s (%s): %s", kernel_id, where,
                exc.message,
            )
            return None
        self.log.info(
            "gpu-snapshot: autosaving kernel %s (%s): %s (job %s)", kernel_id, where, why, job.id
        )
        return job
