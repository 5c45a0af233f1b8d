"""Autosave: snapshot the server's kernels on a schedule, so that a node loss costs little.

A kernel is autosaved

- every ``autosave_interval_minutes`` after its last snapshot, but only if it ran something
  since (an idle kernel is not saved again), and, unless ``autosave_during_cell``, only
  between cells;
- as soon as a cell that ran ``autosave_after_cell_minutes`` or longer has ended.

Autosaves are ordinary save jobs with reason ``autosave``: one operation per kernel still
holds (a kernel that is being saved or restored is skipped, and the log says so), and the
store's retention keeps the newest ``autosave_keep`` of each notebook. A notebook may
override the settings (``PUT kernels/{id}/autosave``, ``%gpu_snapshot autosave``); the
overrides are kept in the store, so they outlive a server restart. The same policy holds
the notebook's choice of when its idle kernel hibernates, in either tier
(``%gpu_snapshot hibernate [gpu] after 30m``), over the server's.

What "ran something" means: a cell, i.e. an ``execute_input`` message on the kernel's
IOPub channel. The scheduler subscribes to each kernel's IOPub (one more subscriber beside
jupyter_server's own, reading only message headers) when it first sees the kernel. The
server's ``last_activity`` would be cheaper but moves on any IOPub message (a reconnecting
browser's kernel_info does it), and ``execution_state`` misses short cells between two
looks. Silent executes (our own allocator release, the env update after a restore) publish
no ``execute_input``, so a snapshot's ``created`` time is the line between saved and
unsaved work. New kernels are followed as they start (jupyter_server's kernel_actions
event), and once the feed's subscription has taken effect the kernel is asked how many cells
it ran (a silent request's ``execution_count``), which covers cells run before. Restored
kernels are followed as their restore succeeds; a kernel the scheduler meets otherwise (one
running when the server started) is read from the server's ``last_activity``, generously.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psutil
from jupyter_client.session import Session
from jupyter_core.utils import ensure_async
from traitlets import TraitError

from .._constants import format_bytes
from ..config import GPUSnapshot
from ..core import procfs, retention, safe_fs
from ..core.errors import Busy, InvalidRequest, SnapshotError
from ..launch.provisioner import root_pid
from .jobs import Job
from .kernel_env import shell_client
from .service import SnapshotService

# Kept in the store's root; dot files there are no snapshots (``snapshot.is_snapshot_id``).
OVERRIDES_FILE = ".autosave-policies.json"
OVERRIDES_LIMIT = 1 << 20
# A fresh kernel's own start-up messages are not work anyone would miss.
STARTUP_SETTLE_SECONDS = 10.0
# How soon a new kernel's cells are followed.
DISCOVER_SECONDS = 0.1
# How long the question to a new kernel waits for its feed to go live before it is sent
# anyway (its own messages then make the feed live).
PROBE_NUDGE_SECONDS = 1.0


@dataclass(frozen=True)
class AutosavePolicy:
    """The autosave settings in force for one notebook."""

    enabled: bool
    interval_minutes: float
    after_cell_minutes: float
    during_cell: bool
    # Not autosave, but the same kind of per-notebook choice: when an idle kernel of the
    # notebook hibernates (``hibernation``), in each tier; 0 never. The gpu tier releases
    # its GPU and keeps its process; the process tier saves it and ends its process.
    hibernate_after_minutes: float = 0.0
    release_gpu_after_minutes: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# What a notebook may override, and the JSON types each field accepts.
POLICY_FIELDS: Mapping[str, tuple[type, ...]] = {
    "enabled": (bool,),
    "interval_minutes": (int, float),
    "after_cell_minutes": (int, float),
    "during_cell": (bool,),
    "hibernate_after_minutes": (int, float),
    "release_gpu_after_minutes": (int, float),
}


def check_override(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a policy override (``None`` resets a field to the server's setting)."""
    checked: dict[str, Any] = {}
    for key, value in changes.items():
        kinds = POLICY_FIELDS.get(key)
        if kinds is None:
            raise InvalidRequest(
                "request", f"unknown autosave field {key!r}",
                hint=f"allowed fields: {', '.join(POLICY_FIELDS)}",
            )
        if value is None:
            checked[key] = None
            continue
        number = float(value) if isinstance(value, (int, float)) else 0.0
        # JSON true is an int to Python; a number field must not take it.
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise InvalidRequest("request", f"autosave field {key!r} has the wrong type")
        if key.endswith("_minutes") and not number >= 0:
            raise InvalidRequest("request", f"autosave field {key!r} must be 0 or more")
        if key == "interval_minutes" and number == 0:
            raise InvalidRequest(
                "request", "an autosave interval of 0 minutes would save without pause",
                hint="turn autosave off with enabled=false instead",
            )
        checked[key] = number if key.endswith("_minutes") else value
    return checked


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


class ExecutionFeed:
    """When a kernel's cells started and ended, read from its IOPub channel."""

    def __init__(self, km: Any) -> None:
        self._session = Session(config=km.session.config, key=km.session.key)
        self._running: dict[str, float] = {}
        self.last_work: float | None = None  # the latest start or end of a cell
        self.long_cells: list[float] = []  # durations of cells that ended, until taken
        # When the first message came: from then on no cell passes unseen. A subscription
        # takes effect some time after the connect (later still while the kernel starts
        # and has not bound its socket yet).
        self.live_at: float | None = None
        self.live = asyncio.Event()
        self._stream = km.connect_iopub()
        self._stream.on_recv(self._on_message)

    @property
    def running_since(self) -> float | None:
        return min(self._running.values()) if self._running else None

    def _on_message(self, parts: list[bytes]) -> None:
        """Called by the IOPub stream on the server's event loop, for every message."""
        if self.live_at is None:
            self.live_at = time.time()
            self.live.set()
        with contextlib.suppress(Exception):  # a message we cannot read is not a cell
            _idents, fed = self._session.feed_identities(parts)
            msg = self._session.deserialize(fed, content=False)
            kind = msg["header"]["msg_type"]
            parent = msg.get("parent_header") or {}
            now = time.time()
            if kind == "execute_input":
                self._running[str(parent.get("msg_id"))] = now
                self.last_work = now
            elif kind == "status" and parent.get("msg_type") == "execute_request":
                state = self._session.unpack(msg["content"]).get("execution_state")
                started = self._running.get(str(parent.get("msg_id")))
                if state == "idle" and started is not None:
                    del self._running[str(parent.get("msg_id"))]
                    self.last_work = now
                    self.long_cells.append(now - started)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


def last_activity(km: Any) -> float | None:
    """The server's ``last_activity`` of a kernel; None while it has none.

    jupyter_server sets the trait once the kernel has started; reading it before (a kernel
    listed while it starts) raises TraitError, not AttributeError.
    """
    try:
        stamp: datetime | None = km.last_activity
    except (AttributeError, TraitError):
        return None
    return stamp.timestamp() if stamp is not None else None


class AutosaveScheduler:
    """Started by ``GPUSnapshotApp`` once the server listens; stopped before shutdown saves."""

    def __init__(
        self, service: SnapshotService, settings: GPUSnapshot, log: logging.Logger | None = None
    ) -> None:
        self.service = service
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self.store = service.engine.store
        self.overrides_path = self.store.root / OVERRIDES_FILE
        self.overrides: dict[str, dict[str, Any]] = {}
        self._watch: dict[str, KernelWatch] = {}
        self._task: asyncio.Task[None] | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Called by ``GPUSnapshotApp._start_jupyter_server_extension``."""
        self.overrides = self._load_overrides()
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

    # -- policies --------------------------------------------------------------------------
    def _defaults(self) -> AutosavePolicy:
        s = self.settings
        return AutosavePolicy(
            bool(s.autosave), float(s.autosave_interval_minutes),
            float(s.autosave_after_cell_minutes), bool(s.autosave_during_cell),
            hibernate_after_minutes=float(s.hibernate_after_minutes),
            release_gpu_after_minutes=float(s.release_gpu_after_minutes),
        )

    def policy(self, key: str) -> AutosavePolicy:
        values = {**self._defaults().to_dict(), **self.overrides.get(key, {})}
        return AutosavePolicy(**values)

    @staticmethod
    def policy_key(kernel_id: str, notebook_path: str | None) -> str:
        return notebook_path or f"kernel:{kernel_id}"

    async def set_override(self, kernel_id: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change the autosave policy of the kernel's notebook; called by the REST handler."""
        self.service.kernel(kernel_id)
        checked = check_override(changes)
        key = self.policy_key(kernel_id, await self.service.slots.notebook_path(kernel_id))
        mine = {**self.overrides.get(key, {}), **checked}
        mine = {k: v for k, v in mine.items() if v is not None}
        if mine:
            self.overrides[key] = mine
        else:
            self.overrides.pop(key, None)
        await asyncio.to_thread(self._save_overrides, dict(self.overrides))
        self.log.info("gpu-snapshot: autosave policy of %s is now %s", key, self.policy(key))
        return await self.describe(kernel_id)

    def _load_overrides(self) -> dict[str, dict[str, Any]]:
        """The notebooks' overrides kept in the store; a link or non-file there is ignored."""
        try:
            with safe_fs.opened_dir(os.path.realpath(self.store.root)) as root_fd:
                data = json.loads(safe_fs.read_small(OVERRIDES_FILE, root_fd, OVERRIDES_LIMIT))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.log.warning("gpu-snapshot: ignoring %s: %s", self.overrides_path, exc)
            return {}
        loaded: dict[str, dict[str, Any]] = {}
        for key, values in (data.items() if isinstance(data, dict) else []):
            with contextlib.suppress(InvalidRequest, AttributeError):
                loaded[str(key)] = {
                    k: v for k, v in check_override(values).items() if v is not None
                }
        return loaded

    def _save_overrides(self, overrides: dict[str, dict[str, Any]]) -> None:
        # Written beside the snapshots through the store's directory fd: never through a link.
        self.store.ensure()
        spare = f"{OVERRIDES_FILE}.new"
        with safe_fs.opened_dir(os.path.realpath(self.store.root)) as root_fd:
            safe_fs.remove_at(spare, root_fd)
            data = json.dumps(overrides, indent=2, sort_keys=True).encode()
            safe_fs.write_new(spare, root_fd, data)
            os.replace(spare, OVERRIDES_FILE, src_dir_fd=root_fd, dst_dir_fd=root_fd)

    # -- what the API shows ----------------------------------------------------------------
    async def describe(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's autosave state (openapi.yaml, AutosaveState)."""
        self.service.kernel(kernel_id)
        notebook = await self.service.slots.notebook_path(kernel_id)
        key = self.policy_key(kernel_id, notebook)
        watch = await self._ensure_watch(kernel_id)
        job = self.service.running_job(kernel_id)
        policy = self.policy(key)
        next_at = None
        if watch is not None and policy.enabled and self.work_at_risk(kernel_id) > 0:
            next_at = self._due(watch, policy)
        return {
            "kernel_id": kernel_id,
            "notebook_path": notebook,
            "policy": policy.to_dict(),
            "override": dict(self.overrides.get(key, {})),
            "unsaved_work": self.work_at_risk(kernel_id) > 0,
            "next_autosave": next_at,
            "autosaving": job is not None and job.reason == "autosave",
            "last_autosave": watch.last_autosave if watch else None,
            "last_skip": watch.last_skip if watch else None,
        }

    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of jupyter_server's kernel_actions events (the app adds it).

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
        time later, and a client may run a cell before that. Once the feed is live, one
        silent execute request (no history, no output, no count) asks the kernel how many
        cells it has run: its reply's ``execution_count``. A cell run after the request
        was sent is seen by the feed; one run before is in that count.
        """
        assert watch.feed is not None
        feed = watch.feed
        client = shell_client(self.service.kernel_manager.get_kernel(kernel_id))
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(feed.live.wait(), PROBE_NUDGE_SECONDS)
                sent = time.time()
                # No time limit: a kernel busy with a cell answers after it, and a request
                # given up on would still run there.
                reply = await ensure_async(
                    client.execute("", silent=True, store_history=False, reply=True)
                )
                if feed.live_at is not None and feed.live_at <= sent:
                    break
                # The probe's own status messages make the feed live; ask again then.
            if int(reply["content"].get("execution_count") or 0) > 0:
                watch.blind_work = time.time()
        except Exception as exc:  # no answer to read: count the kernel as having worked
            watch.blind_work = time.time()
            self.log.info("gpu-snapshot: could not ask kernel %s what it ran: %s",
                          kernel_id, exc)
        finally:
            client.stop_channels()

    def note_restored(self, kernel_id: str) -> None:
        """Called by ``GPUSnapshotApp._emit_job`` as a restore job succeeds.

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
        interval = self.policy(watch.policy_key).interval_minutes * 60
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
        watch.policy_key = self.policy_key(kernel_id, notebook)
        policy = self.policy(watch.policy_key)
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
        refusal = await self._refusal(kernel_id, km, notebook)
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

    async def _refusal(self, kernel_id: str, km: Any, notebook: str | None) -> str | None:
        """Why the disk or the host RAM cannot take an autosave now, or None."""
        root = root_pid(km)
        if root is None:
            return "the kernel has no running process"
        try:
            found = await asyncio.to_thread(procfs.inspect_kernel, root)
            host = await asyncio.to_thread(procfs.tree_rss, root)
        except Exception as exc:  # the kernel exited meanwhile
            return f"cannot read the kernel's processes: {exc}"
        if found.problems:
            return "it is not snapshot-ready: " + "; ".join(found.problems)
        cuda = await self.service.cuda_state(root)
        gpu = int((cuda or {}).get("memory_bytes") or 0)
        store = self.service.engine.store
        summaries = await self.service.list_snapshots()
        group = retention.group_of(
            {"notebook_path": notebook, "kernel": {"kernel_id": kernel_id}}
        )
        room = retention.DiskRoom(
            free_bytes=await asyncio.to_thread(store.free_bytes),
            autosave_bytes=retention.autosave_bytes(summaries),
            reclaimed_bytes=retention.reclaimed_by_next_autosave(
                summaries, group, int(self.settings.autosave_keep)
            ),
        )
        refusal = retention.autosave_refusal(
            host + gpu, room, int(self.settings.autosave_min_free_bytes),
            int(self.settings.autosave_max_bytes),
        )
        if refusal is None and gpu:
            # The driver stages the GPU memory in host RAM during the save.
            available = (await asyncio.to_thread(psutil.virtual_memory)).available
            if available < gpu:
                refusal = (
                    f"the host has {format_bytes(available)} of RAM available, the kernel's "
                    f"GPU memory needs {format_bytes(gpu)} of it"
                )
        return refusal
