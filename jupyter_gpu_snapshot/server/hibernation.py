"""Hibernation: an idle kernel gives its GPU back, and wakes on the next message that
needs it, under the same kernel id. It sleeps in one of two tiers:

- ``gpu``, the GPU released and the process kept (``gpu/sleep.py``): its CUDA state moves
  into its own host memory and a holder process keeps its threads stopped. Nothing is
  written; the wake brings the device memory back and lets the threads run, in seconds.
  The holder outlives a restart of the server, which finds such kernels asleep again.
- ``process``, the process saved and ended, described below: host memory is freed too,
  and the wake is a restore.

Hibernating in the process tier is a stopping save with reason ``hibernate`` that keeps the
kernel slot: the provisioner puts a stand-in for the ended tree (``HibernatedProcess``), so
the kernel stays in /api/kernels and /api/sessions, the restarter (stopped for the save)
never sees a death, and the notebook's websocket stays open. Its execution state reads
``hibernated``.

From the moment a hibernation starts until the kernel is awake again, every message a
client sends over the websocket is held here, per kernel, in arrival order
(``HibernationAwareConnection`` hands them in). A message that needs the kernel (a cell, a
comm message, a completion: anything but a kernel_info request, answered from what the
kernel said before, and the requests a reconnecting client makes by itself) starts the
wake; a message that arrives while the hibernation's save still runs waits for it, and
wakes the kernel right after. The wake restores the snapshot into the same slot (onto
whatever GPUs are free, as any restore), each held client re-joins the kernel's channels,
and the held messages go out once, in order. A wake that fails leaves the kernel
hibernated with its snapshot, and answers each held cell with the cause.

Idle kernels are found by a loop every ``autosave_check_seconds``: a snapshot-ready kernel
idle (no cell running, no output) for ``hibernate_after_minutes``, holding at least
``hibernate_min_gpu_bytes`` of GPU memory, and with no client connected when
``hibernate_only_without_clients``. Events go out as
``https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/v1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import psutil

from .._constants import format_bytes
from ..config import GPUSnapshot
from ..core import procfs
from ..core.errors import Busy, InvalidRequest, NotReady, SnapshotError
from ..core.hooks import Progress
from ..launch.provisioner import Adoption, SnapshotReadyProvisioner, root_pid
from ..node.engine import GpuSleeper
from ..node.gpus import GpuInventory, remap_notice
from .hibernation_policy import HibernationPolicy, IdleMinutes, idle_seconds, last_active
from .jobs import Job, kernel_key, snapshot_key
from .jupyter_server_internals import websocket_count
from .service import HIBERNATE, SnapshotService
from .sleepers import (
    GPU_TIER,
    HIBERNATED,
    HIBERNATING,
    PROCESS_TIER,
    TIERS,
    WAKING,
    HeldClient,
    HeldMessage,
    Sleepers,
    SleepingKernel,
)

# Requests a client makes by itself when it (re)connects: held until the kernel wakes,
# but they do not wake it. A kernel_info request is answered from the kernel's own
# earlier answer.
PASSIVE_REQUESTS = frozenset({"comm_info_request", "history_request"})
# Free GPU memory a wake wants beyond what its kernel held there (the driver's own).
WAKE_MARGIN_BYTES = 256 << 20
# How often a waking kernel's held cells are told how far the restore is.
PROGRESS_EVERY_SECONDS = 0.5


class Hibernation:
    """Hibernates and wakes the server's kernels, recording them in ``Sleepers``; made by
    ``wiring.build_server_parts``, started and stopped by ``GPUSnapshotApp``."""

    def __init__(
        self,
        service: SnapshotService,
        sleepers: Sleepers,
        settings: GPUSnapshot,
        log: logging.Logger | None = None,
        emit: Callable[[dict[str, Any]], None] | None = None,
        hibernate_after: IdleMinutes | None = None,
        release_gpu_after: IdleMinutes | None = None,
    ) -> None:
        self.service = service
        # The kernels asleep, and those asked to hibernate once idle (%gpu_snapshot
        # hibernate): this object's to change, the service's to read.
        self.sleepers = sleepers
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self._emit = emit or (lambda _data: None)
        # Minutes of idleness after which a kernel hibernates in each tier: its notebook's
        # choice (``%gpu_snapshot hibernate [gpu] after 30m``), else the server's setting.
        self._hibernate_after = hibernate_after
        self._release_gpu_after = release_gpu_after
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None
        # Every client connection of each kernel: a restored kernel's output reaches one
        # only once its subscription has re-joined, held message or not.
        self._clients: dict[str, weakref.WeakSet[HeldClient]] = {}

    # -- hibernating -----------------------------------------------------------------------
    async def request(self, kernel_id: str, when_idle: bool = False,
                      tier: str = PROCESS_TIER) -> dict[str, Any]:
        """Hibernate the kernel in ``tier`` now, or (``when_idle``) once its running cell
        has ended; called by ``POST kernels/{id}/hibernate``. Raises for a kernel that cannot."""
        if tier not in TIERS:
            raise InvalidRequest("hibernate", f"unknown tier {tier!r}",
                                 hint="gpu (the GPU released, the process kept) or process "
                                 "(the process saved and ended)")
        km = self.service.kernel(kernel_id)
        if not isinstance(getattr(km, "provisioner", None), SnapshotReadyProvisioner):
            raise InvalidRequest(
                "hibernate", f"kernel {kernel_id} is not snapshot-ready",
                hint="only kernels of a snapshot-ready kernelspec (python3-snapshot) hibernate",
            )
        if kernel_id in self.sleepers.kernels:
            sleeper = self.sleepers.kernels[kernel_id]
            if tier == PROCESS_TIER and sleeper.tier == GPU_TIER and sleeper.state == HIBERNATED:
                return (await self._move_to_disk(sleeper, "on request")).to_dict()
            return sleeper.to_dict()
        if getattr(km, "execution_state", None) == "busy" and not when_idle:
            raise Busy(
                "hibernate", f"kernel {kernel_id} is running a cell",
                hint="a kernel with a running cell never hibernates; ask again once it is "
                "idle, or with when_idle",
            )
        if when_idle:
            # The server learns that a cell started a moment after it did (the magic asks
            # from inside its own cell): the next look hibernates the kernel once idle.
            self.sleepers.when_idle[kernel_id] = tier
            return {"kernel_id": kernel_id, "state": "requested", "tier": tier}
        return (await self._hibernate(kernel_id, "on request", tier)).to_dict()

    async def _hibernate(self, kernel_id: str, why: str,
                         tier: str = PROCESS_TIER) -> SleepingKernel:
        km = self.service.kernel(kernel_id)
        root = root_pid(km)
        if root is None:
            raise NotReady("hibernate", f"kernel {kernel_id} has no running process")
        # Clients' messages are held from now on: none starts a cell under the save.
        sleeper = SleepingKernel(kernel_id, HIBERNATING, None, 0, 0, tier=tier, root_pid=root)
        self.sleepers.kernels[kernel_id] = sleeper
        try:
            sleeper.host_bytes = await asyncio.to_thread(procfs.tree_rss, root)
            cuda = await self.service.cuda_state(root)
            sleeper.gpu_bytes = int((cuda or {}).get("memory_bytes") or 0)
            sleeper.notebook_path = await self.service.slots.notebook_path(kernel_id)
            if getattr(km, "execution_state", None) == "busy":
                raise Busy("hibernate", f"kernel {kernel_id} started a cell",
                           hint="a kernel with a running cell never hibernates")
            if tier == GPU_TIER:
                job = self._start_release(sleeper, root)
            else:
                job = await self.service.start_save(kernel_id, stop=True, reason=HIBERNATE)
        except BaseException:
            self._release(sleeper)
            raise
        sleeper.job_id = job.id
        # A request to hibernate once idle is done only now: one refused (a cell started)
        # stays for the next look.
        self.sleepers.when_idle.pop(kernel_id, None)
        self.log.info("gpu-snapshot: hibernating kernel %s (%s) in the %s tier: %s", kernel_id,
                      sleeper.notebook_path or "no notebook", tier, why)
        self._event(sleeper, "hibernating", reason=why)
        self._spawn(self._finish_hibernation(sleeper, job))
        return sleeper

    async def _move_to_disk(self, sleeper: SleepingKernel, why: str) -> SleepingKernel:
        """From the gpu tier to the process tier: the kernel is saved as it sleeps, its GPU
        untouched (``gpu/hook.py``), and ends, its host memory freed. Its clients' messages
        stay held; one that needs the kernel meanwhile wakes it once the save is done."""
        assert sleeper.root_pid is not None
        sleeper.host_bytes = await asyncio.to_thread(procfs.tree_rss, sleeper.root_pid)
        sleeper.state, sleeper.tier, sleeper.moving = HIBERNATING, PROCESS_TIER, True
        try:
            job = await self.service.start_save(sleeper.kernel_id, stop=True, reason=HIBERNATE,
                                                asleep=True)
        except BaseException:
            sleeper.state, sleeper.tier, sleeper.moving = HIBERNATED, GPU_TIER, False
            raise
        sleeper.job_id = job.id
        self.log.info("gpu-snapshot: kernel %s moves from the gpu tier to the process tier "
                      "(%s of host memory): %s", sleeper.kernel_id,
                      format_bytes(sleeper.host_bytes), why)
        self._event(sleeper, "hibernating", reason=why)
        self._spawn(self._finish_hibernation(sleeper, job))
        return sleeper

    def _start_release(self, sleeper: SleepingKernel, root: int) -> Job:
        """The job of the gpu tier: the GPU released, the process kept."""
        gpu_sleep = self.service.gpu_sleep()
        job = Job("hibernate", sleeper.kernel_id, reason=HIBERNATE)

        async def release(_job: Job) -> dict[str, Any]:
            note = {"kernel_id": sleeper.kernel_id}
            report = await asyncio.to_thread(gpu_sleep.release, root, note)
            sleeper.gpu_memory = report.gpu_memory
            sleeper.gpu_bytes = max(sleeper.gpu_bytes, report.gpu_bytes)
            return {"kernel_id": sleeper.kernel_id, "tier": GPU_TIER, **report.to_dict()}

        self.service.jobs.start(job, [kernel_key(sleeper.kernel_id)], release)
        return job

    def _release(self, sleeper: SleepingKernel) -> None:
        """The kernel did not hibernate and runs on: what its clients sent goes to it."""
        self.sleepers.kernels.pop(sleeper.kernel_id, None)
        held, sleeper.held = sleeper.held, []
        for message in held:
            message.client.deliver(message.raw)

    async def _finish_hibernation(self, sleeper: SleepingKernel, job: Job) -> None:
        await self.service.jobs.wait(job)
        kernel_id = sleeper.kernel_id
        if job.status != "succeeded" and sleeper.moving:
            # The save of a sleeping kernel rolled back: it sleeps on in the gpu tier.
            error = job.error or {}
            sleeper.state, sleeper.tier, sleeper.moving = HIBERNATED, GPU_TIER, False
            self.log.warning("gpu-snapshot: kernel %s stays in the gpu tier: %s", kernel_id,
                             error.get("message"))
            self._event(sleeper, "failed", message=str(error.get("message") or ""))
            if sleeper.wake_when_saved:
                sleeper.wake_when_saved = False
                self._start_wake(sleeper)
            return
        sleeper.moving = False
        if job.status != "succeeded":
            # The save rolled back: the kernel runs on.
            error = job.error or {}
            self.log.warning("gpu-snapshot: kernel %s did not hibernate: %s", kernel_id,
                             error.get("message"))
            self._release(sleeper)
            self._event(sleeper, "failed", message=str(error.get("message") or ""))
            return
        sleeper.state, sleeper.since, sleeper.snapshot_id = HIBERNATED, time.time(), job.snapshot_id
        if kernel_id in self.service.kernel_manager:
            self.service.kernel_manager.get_kernel(kernel_id).execution_state = HIBERNATED
        self.log.info(
            "gpu-snapshot: kernel %s hibernated (%s); %s of GPU memory freed", kernel_id,
            job.snapshot_id or "its process kept", format_bytes(sleeper.gpu_bytes),
        )
        self._event(sleeper, "hibernated")
        if sleeper.wake_when_saved:
            self._start_wake(sleeper)

    # -- messages from clients -------------------------------------------------------------
    def opened(self, client: HeldClient) -> None:
        """Called by every websocket connection that opens on a kernel."""
        self._clients.setdefault(client.kernel_id, weakref.WeakSet()).add(client)

    def connected(self, client: HeldClient) -> None:
        """Called by a websocket connection that opens while the kernel hibernates."""
        self.opened(client)
        sleeper = self.sleepers.kernels.get(client.kernel_id)
        if sleeper is not None:
            sleeper.joined.append(client)

    def receive(self, client: HeldClient, raw: Any, channel: str, header: dict[str, Any]) -> bool:
        """Called by the websocket connection for each message a client sends; True when
        hibernation took it (held or answered), False when it goes to the kernel as usual."""
        sleeper = self.sleepers.kernels.get(client.kernel_id)
        if sleeper is None:
            return False
        kind = str(header.get("msg_type") or "")
        if kind == "kernel_info_request":
            info = client.kernel_info()
            if info:
                client.answer(channel, "kernel_info_reply", info, header)
                return True
        sleeper.held.append(HeldMessage(client, raw, channel, header))
        if kind in PASSIVE_REQUESTS:
            return True
        if kind == "execute_request":
            # A client whose websocket is closing cannot be told; the wake goes on.
            with contextlib.suppress(Exception):
                self._show_waking(client, header, sleeper)
        if sleeper.state == HIBERNATED:
            self._start_wake(sleeper)
        elif sleeper.state == HIBERNATING:
            sleeper.wake_when_saved = True
        return True

    def _show_waking(self, client: HeldClient, parent: dict[str, Any], sleeper: SleepingKernel,
                     text: str | None = None, update: bool = False) -> None:
        """A line in the held cell's output saying that the kernel wakes, and how far."""
        content = {
            "data": {"text/plain": text or f"Waking the kernel ({_moving(sleeper)})…"},
            "metadata": {},
            "transient": {"display_id": f"gpu-snapshot-wake-{parent.get('msg_id')}"},
        }
        if not update:
            client.answer("iopub", "status", {"execution_state": "busy"}, parent)
        client.answer("iopub", "update_display_data" if update else "display_data", content,
                      parent)

    # -- waking ----------------------------------------------------------------------------
    async def wake(self, kernel_id: str) -> dict[str, Any]:
        """Called by ``POST kernels/{id}/wake`` (and the CLI); the wake job."""
        self.service.kernel(kernel_id)
        sleeper = self.sleepers.kernels.get(kernel_id)
        if sleeper is None:
            raise InvalidRequest("wake", f"kernel {kernel_id} is not hibernated")
        if sleeper.state == HIBERNATING:
            sleeper.wake_when_saved = True
            return sleeper.to_dict()
        self._start_wake(sleeper)
        return sleeper.to_dict()

    def _start_wake(self, sleeper: SleepingKernel) -> None:
        if sleeper.state != HIBERNATED:
            return
        kernel_id = sleeper.kernel_id
        job = Job("wake", kernel_id, sleeper.snapshot_id, reason=HIBERNATE)
        if sleeper.tier == GPU_TIER:
            self.service.jobs.start(job, [kernel_key(kernel_id)],
                                    lambda j: self._wake_gpu(j, sleeper))
        else:
            assert sleeper.snapshot_id is not None
            self.service.jobs.start(
                job, [kernel_key(kernel_id), snapshot_key(sleeper.snapshot_id)],
                lambda j: self._wake(j, sleeper),
            )
        sleeper.state, sleeper.job_id = WAKING, job.id
        self.log.info("gpu-snapshot: waking kernel %s from %s", kernel_id,
                      sleeper.snapshot_id or "host memory")
        self._event(sleeper, "waking")
        self._spawn(self._finish_wake(sleeper, job))

    async def _wake_gpu(self, job: Job, sleeper: SleepingKernel) -> dict[str, Any]:
        """The wake job of the gpu tier: device memory back, the threads running."""
        assert sleeper.root_pid is not None
        gpu_sleep = self.service.gpu_sleep()
        await self._make_room(sleeper, gpu_sleep)
        self.service.jobs.progress(job)(Progress("waking", 0, sleeper.gpu_bytes))
        report = await asyncio.to_thread(gpu_sleep.wake, sleeper.root_pid)
        self.service.kernel(sleeper.kernel_id).execution_state = "idle"
        return {"kernel_id": sleeper.kernel_id, "tier": GPU_TIER, **report.to_dict()}

    async def _make_room(self, sleeper: SleepingKernel, gpu_sleep: GpuSleeper) -> None:
        """Taking turns: where a GPU lacks the memory this kernel's wake needs there, the
        least recently used idle kernels on that GPU give theirs back (the gpu tier) until
        it fits; where none can, the wake is refused, naming who holds the GPU."""
        trees: dict[str, list[int]] | None = None
        for uuid, need in sleeper.gpu_memory.items():
            inventory = await asyncio.to_thread(gpu_sleep.read_inventory)
            device = inventory.device(uuid) if inventory is not None else None
            if inventory is None or device is None \
                    or device.memory_free >= need + WAKE_MARGIN_BYTES:
                continue
            trees = trees if trees is not None else await self._kernel_trees()
            for other in await self._idle_on(uuid, sleeper.kernel_id, inventory, trees):
                why = f"making room on GPU {device.index} for kernel {sleeper.kernel_id}"
                with contextlib.suppress(SnapshotError):
                    made = await self._hibernate(other, why, GPU_TIER)
                    assert made.job_id is not None
                    await self.service.jobs.wait(self.service.jobs.get(made.job_id))
                inventory = await asyncio.to_thread(gpu_sleep.read_inventory)
                device = inventory.device(uuid) if inventory is not None else None
                if inventory is None or device is None \
                        or device.memory_free >= need + WAKE_MARGIN_BYTES:
                    break
            if inventory is not None and device is not None \
                    and device.memory_free < need + WAKE_MARGIN_BYTES:
                holders = await asyncio.to_thread(self._holders_of, uuid, inventory, trees)
                raise NotReady(
                    "make room",
                    f"GPU {device.index} ({device.name}) has {format_bytes(device.memory_free)}"
                    f" free and this kernel needs {format_bytes(need)} there; no idle kernel "
                    f"can give its memory back. It is held by {holders}",
                    hint="wait for a cell of those kernels to end, or shut one down",
                )

    async def _kernel_trees(self) -> dict[str, list[int]]:
        """The pids of each running kernel's tree, read from /proc in a worker thread."""
        kernel_manager = self.service.kernel_manager
        roots = {k: root_pid(kernel_manager.get_kernel(k))
                 for k in list(kernel_manager.list_kernel_ids())}

        def read() -> dict[str, list[int]]:
            found: dict[str, list[int]] = {}
            for kernel_id, root in roots.items():
                with contextlib.suppress(psutil.Error):
                    if root is not None:
                        found[kernel_id] = [p.pid for p in procfs.tree(root)]
            return found

        return await asyncio.to_thread(read)

    async def _idle_on(self, uuid: str, exclude: str, inventory: GpuInventory,
                       trees: dict[str, list[int]]) -> list[str]:
        """The awake, idle kernels holding memory on the GPU, least recently used first."""
        found: list[tuple[float, str]] = []
        for kernel_id, pids in trees.items():
            if kernel_id == exclude or await self._idle_for(kernel_id) is None:
                continue
            if any(inventory.process_memory.get(pid, {}).get(uuid) for pid in pids):
                last = last_active(self.service.kernel_manager.get_kernel(kernel_id))
                found.append((last, kernel_id))
        return [kernel_id for _, kernel_id in sorted(found)]

    def _holders_of(self, uuid: str, inventory: GpuInventory,
                    trees: dict[str, list[int]]) -> str:
        """Who holds memory on the GPU, in words: kernels by id and notebook state, others
        by pid and command. Reads /proc: called in a worker thread."""
        kernel_manager = self.service.kernel_manager
        kernels = {
            pid: f"kernel {kernel_id} "
                 f"({getattr(kernel_manager.get_kernel(kernel_id), 'execution_state', 'unknown')})"
            for kernel_id, pids in trees.items() if kernel_id in kernel_manager for pid in pids
        }
        named = []
        for pid, memory in sorted(inventory.process_memory.items()):
            if memory.get(uuid):
                who = kernels.get(pid)
                if who is None:
                    with contextlib.suppress(psutil.Error):
                        who = f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:60]})"
                named.append(f"{who or f'pid {pid}'}: {format_bytes(memory[uuid])}")
        return "; ".join(named) or "processes this server cannot see"

    async def _wake(self, job: Job, sleeper: SleepingKernel) -> dict[str, Any]:
        """The wake job: restore the snapshot, and give the tree to the same slot."""
        assert sleeper.snapshot_id is not None
        service = self.service
        km = service.kernel(sleeper.kernel_id)
        snapshot = await asyncio.to_thread(service.engine.get, sleeper.snapshot_id)
        restored = await service.engine.restore(
            snapshot, self._wake_progress(job, sleeper), gpus=None
        )
        try:
            ours = {k: v for k, v in restored.connection_info.items() if k.endswith("_port")}
            slot = {k: v for k, v in km.get_connection_info().items() if k.endswith("_port")}
            if ours != slot:
                raise SnapshotError("adopt", "the restored kernel listens on other ports "
                                    "than its slot")
            await km.provisioner.wake(
                Adoption(restored.pid, restored.connection_info, snapshot.id)
            )
        except BaseException:
            await asyncio.to_thread(procfs.kill_tree, restored.pid)
            raise
        km.execution_state = "idle"
        km.start_restarter()
        remap = restored.notes.get("gpu_remap")
        # A restored kernel asks to be told its slot before %gpu_snapshot works in it, even
        # in the slot it was saved from; the held cells go out after this.
        await service.slots.tell_slot(sleeper.kernel_id, remap_notice(remap))
        return {
            "kernel_id": sleeper.kernel_id, "snapshot_id": snapshot.id, "gpu_remap": remap,
            "timings": restored.timings,
        }

    def _wake_progress(self, job: Job, sleeper: SleepingKernel) -> Callable[[Progress], None]:
        """The job's progress, also shown in the held cells' outputs now and then."""
        report = self.service.jobs.progress(job)
        shown = [0.0]

        def progress(p: Progress) -> None:
            report(p)
            now = time.monotonic()
            if now - shown[0] < PROGRESS_EVERY_SECONDS or not p.total:
                return
            shown[0] = now
            text = (f"Waking the kernel ({_moving(sleeper)}): {p.phase} "
                    f"{format_bytes(p.done)} of {format_bytes(p.total)}…")
            for held in list(sleeper.held):
                if held.header.get("msg_type") == "execute_request":
                    with contextlib.suppress(Exception):
                        self._show_waking(held.client, held.header, sleeper, text, update=True)

        return progress

    async def _finish_wake(self, sleeper: SleepingKernel, job: Job) -> None:
        await self.service.jobs.wait(job)
        kernel_id = sleeper.kernel_id
        if job.status != "succeeded":
            error = job.error or {"message": "the wake failed"}
            sleeper.state, sleeper.error = HIBERNATED, error
            self.log.warning("gpu-snapshot: kernel %s did not wake: %s", kernel_id,
                             error.get("message"))
            self._event(sleeper, "wake_failed", message=str(error.get("message") or ""))
            unanswered, sleeper.held = sleeper.held, []
            for message in unanswered:
                self._refuse(message, sleeper, error)
            return
        seconds = (job.finished or time.time()) - job.started
        every = [*(h.client for h in sleeper.held), *sleeper.joined,
                 *self._clients.get(kernel_id, ())]
        clients = list({id(c): c for c in every}.values())
        # Each client's subscription to the kernel's output must be live again before its
        # held requests go out, or the first outputs would be lost.
        await asyncio.gather(*(c.rejoin() for c in clients), return_exceptions=True)
        # From here on, nothing awaits: messages arriving meanwhile are held until this
        # loop step hands them all out, in order, and later ones go straight to the kernel.
        self.sleepers.kernels.pop(kernel_id, None)
        for held in sleeper.held:
            if held.header.get("msg_type") == "execute_request":
                # The note goes before the cell's own outputs come: a wake leaves nothing in
                # the notebook file (the server's log and events say how long it took).
                with contextlib.suppress(Exception):
                    held.client.answer("iopub", "clear_output", {"wait": False}, held.header)
            held.client.deliver(held.raw)
        self.log.info("gpu-snapshot: kernel %s woke in %.1f s (%s); %d held messages delivered",
                      kernel_id, seconds, _moved(sleeper), len(sleeper.held))
        self._event(sleeper, "woken", seconds=seconds)

    def _refuse(self, held: HeldMessage, sleeper: SleepingKernel, error: dict[str, Any]) -> None:
        """Answer a held cell whose kernel could not wake; other held requests get no
        answer (a client gives up on them by itself)."""
        if held.header.get("msg_type") != "execute_request":
            return
        source = (f"from its hibernation snapshot {sleeper.snapshot_id}"
                  if sleeper.tier == PROCESS_TIER else "from host memory")
        kept = ("The snapshot is kept: run the cell again to retry, or restore it from the "
                "snapshot list." if sleeper.tier == PROCESS_TIER else
                "It sleeps on with nothing lost: run the cell again to retry.")
        text = (
            f"The kernel could not wake {source} "
            f"(step {error.get('step', 'wake')}): {error.get('message')}. "
            + (f"{error['hint']}. " if error.get("hint") else "")
            + kept
        )
        content = {"ename": "KernelWakeError", "evalue": text, "traceback": [text]}
        with contextlib.suppress(Exception):
            held.client.answer("iopub", "error", content, held.header)
            held.client.answer(held.channel, "execute_reply",
                               {"status": "error", "execution_count": None, **content},
                               held.header)
            held.client.answer("iopub", "status", {"execution_state": "idle"}, held.header)

    # -- the server's kernels --------------------------------------------------------------
    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of jupyter_server's kernel_actions events: a hibernated kernel shut
        down or restarted is no longer hibernated; its snapshot stays, like any other."""
        kernel_id = str(data.get("kernel_id") or "")
        if data.get("action") in ("shutdown", "restart") and data.get("status") == "success":
            self.forget(kernel_id)

    def forget(self, kernel_id: str) -> None:
        self.sleepers.when_idle.pop(kernel_id, None)
        self._clients.pop(kernel_id, None)
        sleeper = self.sleepers.kernels.get(kernel_id)
        if sleeper is None or sleeper.state == HIBERNATING:
            return
        del self.sleepers.kernels[kernel_id]
        self._event(sleeper, "forgotten")

    # -- finding idle kernels --------------------------------------------------------------
    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())

    async def wake_before_stop(self) -> dict[str, str]:
        """Wake the kernels asleep in the gpu tier, so that the stopping server's saves can
        keep them (their state lives only in their process, which ends with the server).
        Returns, for each that stays asleep, why; each is logged."""
        stays: dict[str, str] = {}
        for sleeper in [s for s in self.sleepers.kernels.values()
                        if s.tier == GPU_TIER and s.state == HIBERNATED]:
            assert sleeper.root_pid is not None
            try:
                await asyncio.to_thread(self.service.gpu_sleep().wake, sleeper.root_pid)
            except SnapshotError as exc:
                stays[sleeper.kernel_id] = exc.message
                self.log.warning("gpu-snapshot: kernel %s sleeps in the gpu tier and could not "
                                 "wake to be saved; its state ends with the server: %s",
                                 sleeper.kernel_id, exc.message)
                continue
            self.service.kernel(sleeper.kernel_id).execution_state = "idle"
            self._release(sleeper)
            self.log.info("gpu-snapshot: kernel %s woke from the gpu tier to be saved as the "
                          "server stops", sleeper.kernel_id)
        return stays

    async def find_sleepers(self) -> list[str]:
        """Kernels that sleep in the gpu tier under a holder that outlived the server
        before this one: called once their slots are adopted, before clients connect."""
        try:
            gpu_sleep = self.service.gpu_sleep()
        except SnapshotError:
            return []
        found = []
        for kernel_id in list(self.service.kernel_manager.list_kernel_ids()):
            km = self.service.kernel_manager.get_kernel(kernel_id)
            root = root_pid(km)
            if root is None or kernel_id in self.sleepers.kernels:
                continue
            status = await asyncio.to_thread(gpu_sleep.asleep, root)
            if status is None:
                continue
            memory = {str(k): int(v) for k, v in dict(status.get("gpu_memory") or {}).items()}
            sleeper = SleepingKernel(
                kernel_id, HIBERNATED, await self.service.slots.notebook_path(kernel_id),
                sum(memory.values()), 0, tier=GPU_TIER, root_pid=root, gpu_memory=memory,
                since=float(status.get("since") or time.time()),
            )
            self.sleepers.kernels[kernel_id] = sleeper
            km.execution_state = HIBERNATED
            found.append(kernel_id)
            self.log.info("gpu-snapshot: kernel %s sleeps on with its GPU released", kernel_id)
        return found

    async def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end hibernation for good
                self.log.exception("gpu-snapshot: the hibernation check failed a round")
            await asyncio.sleep(float(self.settings.autosave_check_seconds))

    async def tick(self) -> None:
        """Hibernate the kernels that asked to once idle, and those idle long enough."""
        kernel_manager = self.service.kernel_manager
        await self._move_sleepers_to_disk()
        for kernel_id, tier in list(self.sleepers.when_idle.items()):
            if kernel_id not in kernel_manager:
                self.sleepers.when_idle.pop(kernel_id, None)
            elif await self._idle_for(kernel_id) is not None:
                await self._try(kernel_id, "asked to hibernate once idle", tier)
        for kernel_id in list(kernel_manager.list_kernel_ids()):
            idle = await self._idle_for(kernel_id)
            if idle is None:
                continue
            after = await self._after_seconds(kernel_id)
            release_after = await self._release_after_seconds(kernel_id)
            why = f"idle for {idle / 60:.1f} min"
            if 0 < after <= idle and await self._eligible(kernel_id):
                await self._try(kernel_id, why)
            elif 0 < release_after <= idle and await self._holds_gpu(kernel_id):
                await self._try(kernel_id, why, GPU_TIER)

    async def _move_sleepers_to_disk(self) -> None:
        """The second tier for kernels asleep in the first: each one idle for its
        ``hibernate_after_minutes``, and, while the node's available host memory is below
        ``host_memory_low_percent``, the least recently used one (one per round: the next
        round sees the memory it freed)."""
        sleepers = sorted((s for s in self.sleepers.kernels.values()
                           if s.tier == GPU_TIER and s.state == HIBERNATED),
                          key=lambda s: self._last_activity(s.kernel_id))
        if not sleepers:
            return
        for sleeper in sleepers:
            after = await self._after_seconds(sleeper.kernel_id)
            idle = time.time() - self._last_activity(sleeper.kernel_id)
            if 0 < after <= idle:
                await self._try_move(sleeper, f"idle for {idle / 60:.1f} min")
        low = float(self.settings.host_memory_low_percent)
        if low <= 0:
            return
        memory = await asyncio.to_thread(psutil.virtual_memory)
        moving = any(s.moving for s in self.sleepers.kernels.values())
        if memory.available * 100 < low * memory.total and not moving:
            for sleeper in sleepers:
                if sleeper.tier == GPU_TIER and sleeper.state == HIBERNATED:
                    await self._try_move(
                        sleeper, f"host memory is low: {format_bytes(memory.available)} of "
                        f"{format_bytes(memory.total)} available")
                    break

    def _last_activity(self, kernel_id: str) -> float:
        if kernel_id not in self.service.kernel_manager:
            return time.time()  # shut down meanwhile: never idle
        return last_active(self.service.kernel_manager.get_kernel(kernel_id))

    async def _try_move(self, sleeper: SleepingKernel, why: str) -> None:
        try:
            await self._move_to_disk(sleeper, why)
        except SnapshotError as exc:
            self.log.info("gpu-snapshot: kernel %s stays in the gpu tier: %s",
                          sleeper.kernel_id, exc.message)

    async def _after_seconds(self, kernel_id: str) -> float:
        if self._hibernate_after is not None:
            return await self._hibernate_after(kernel_id) * 60
        return HibernationPolicy.from_settings(self.settings).hibernate_after_minutes * 60

    async def _release_after_seconds(self, kernel_id: str) -> float:
        if self._release_gpu_after is not None:
            return await self._release_gpu_after(kernel_id) * 60
        return HibernationPolicy.from_settings(self.settings).release_gpu_after_minutes * 60

    async def _try(self, kernel_id: str, why: str, tier: str = PROCESS_TIER) -> None:
        try:
            await self._hibernate(kernel_id, why, tier)
        except SnapshotError as exc:
            self.log.info("gpu-snapshot: not hibernating kernel %s: %s", kernel_id, exc.message)

    async def _idle_for(self, kernel_id: str) -> float | None:
        """Seconds since the kernel's last output, or None if it is not idle now."""
        if kernel_id in self.sleepers.kernels or kernel_id not in self.service.kernel_manager:
            return None
        km = self.service.kernel_manager.get_kernel(kernel_id)
        if not isinstance(getattr(km, "provisioner", None), SnapshotReadyProvisioner):
            return None
        if getattr(km, "execution_state", None) != "idle" or root_pid(km) is None:
            return None
        if self.service.running_job(kernel_id) is not None:
            return None
        return idle_seconds(km)

    async def _holds_gpu(self, kernel_id: str) -> bool:
        """Whether the kernel's GPU can be released: it holds GPU memory, and this server
        has the driver to release it with (quietly no for a server without)."""
        if self.settings.hibernate_only_without_clients and self._has_clients(kernel_id):
            return False
        try:
            self.service.gpu_sleep()
        except SnapshotError:
            return False
        root = root_pid(self.service.kernel_manager.get_kernel(kernel_id))
        cuda = await self.service.cuda_state(root)
        return int((cuda or {}).get("memory_bytes") or 0) > 0

    def _has_clients(self, kernel_id: str) -> bool:
        return websocket_count(self.service.kernel_manager, kernel_id) > 0

    async def _eligible(self, kernel_id: str) -> bool:
        if self.settings.hibernate_only_without_clients and self._has_clients(kernel_id):
            return False
        least = int(self.settings.hibernate_min_gpu_bytes)
        if least > 0:
            root = root_pid(self.service.kernel_manager.get_kernel(kernel_id))
            cuda = await self.service.cuda_state(root)
            if int((cuda or {}).get("memory_bytes") or 0) < least:
                return False
        return True

    # -- plumbing --------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _event(self, sleeper: SleepingKernel, action: str, **extra: Any) -> None:
        try:
            self._emit({
                "action": action,
                "kernel_id": sleeper.kernel_id,
                "tier": sleeper.tier,
                "notebook_path": sleeper.notebook_path,
                "snapshot_id": sleeper.snapshot_id,
                "gpu_bytes": sleeper.gpu_bytes,
                **extra,
            })
        except Exception:  # a broken event sink must not break hibernation
            self.log.exception("gpu-snapshot: could not emit a hibernation event")


def _moving(sleeper: SleepingKernel) -> str:
    """What a wake moves, in words that fit its tier."""
    if sleeper.tier == GPU_TIER:
        return f"bringing back {format_bytes(sleeper.gpu_bytes)} of GPU memory"
    return f"restoring {format_bytes(sleeper.host_bytes + sleeper.gpu_bytes)}"


def _moved(sleeper: SleepingKernel) -> str:
    if sleeper.tier == GPU_TIER:
        return f"brought back {format_bytes(sleeper.gpu_bytes)} of GPU memory"
    return f"restored {format_bytes(sleeper.host_bytes + sleeper.gpu_bytes)}"
