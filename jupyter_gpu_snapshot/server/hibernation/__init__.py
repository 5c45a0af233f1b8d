"""Hibernation: an idle kernel gives its GPU back, and wakes on the next message that
needs it, under the same kernel id. It sleeps in one of two tiers:

- ``gpu``, the GPU released and the process kept (``gpu_tier``): nothing is written, and
  the wake brings the device memory back in seconds;
- ``process``, the process saved and ended (``process_tier``): host memory is freed too,
  and the wake is a restore into the same slot. Its execution state reads ``hibernated``.

From the start of a hibernation until the kernel is awake again, what its clients send is
held (``held_messages``); a message that needs the kernel wakes it. A wake that fails
leaves the kernel hibernated, with its snapshot, and answers each held cell with the cause.
Idle kernels are found by a loop (``idle_loop``). ``Hibernation`` moves each kernel
through its states (hibernating, hibernated, waking) and records them in ``Sleepers``.
Events go out as ``https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/v1``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..._constants import format_bytes
from ...config import GPUSnapshot
from ...core import procfs
from ...core.errors import Busy, InvalidRequest, NotReady
from ...launch.provisioner import SnapshotReadyProvisioner, root_pid
from ..hibernation_policy import IdleMinutes
from ..jobs import Job, kernel_key, snapshot_key
from ..service import HIBERNATE, SnapshotService
from ..sleepers import (
    GPU_TIER,
    HIBERNATED,
    HIBERNATING,
    PROCESS_TIER,
    TIERS,
    WAKING,
    HeldClient,
    Sleepers,
    SleepingKernel,
)
from .gpu_tier import GpuTier
from .held_messages import HeldMessages
from .idle_loop import IdleLoop
from .process_tier import ProcessTier

__all__ = ["Hibernation"]


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
        self._tasks: set[asyncio.Task[Any]] = set()
        self.held = HeldMessages(sleepers, wake=self._start_wake)
        self.idle = IdleLoop(
            service, sleepers, settings, self.log, hibernate=self._hibernate,
            move_to_disk=self._move_to_disk, hibernate_after=hibernate_after,
            release_gpu_after=release_gpu_after,
        )
        self.gpu_tier = GpuTier(service, sleepers, self.held, self.log,
                                idle_for=self.idle.idle_for, give_back=self._give_back)
        self.process_tier = ProcessTier(service, self.held)

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
                job = self.gpu_tier.start_release(sleeper, root)
            else:
                job = await self.process_tier.start_save(kernel_id)
        except BaseException:
            self.held.release(sleeper)
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

    async def _give_back(self, kernel_id: str, why: str) -> None:
        """Hibernate another kernel in the gpu tier, and wait until its GPU is released:
        a wake needs its memory (``GpuTier``)."""
        made = await self._hibernate(kernel_id, why, GPU_TIER)
        assert made.job_id is not None
        await self.service.jobs.wait(self.service.jobs.get(made.job_id))

    async def _move_to_disk(self, sleeper: SleepingKernel, why: str) -> SleepingKernel:
        """From the gpu tier to the process tier: the kernel is saved as it sleeps, its GPU
        untouched (``gpu/hook.py``), and ends, its host memory freed. Its clients' messages
        stay held; one that needs the kernel meanwhile wakes it once the save is done."""
        assert sleeper.root_pid is not None
        sleeper.host_bytes = await asyncio.to_thread(procfs.tree_rss, sleeper.root_pid)
        sleeper.state, sleeper.tier, sleeper.moving = HIBERNATING, PROCESS_TIER, True
        try:
            job = await self.process_tier.start_save(sleeper.kernel_id, asleep=True)
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
            self.held.release(sleeper)
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

    # -- messages from clients (``held_messages``) ------------------------------------------
    def opened(self, client: HeldClient) -> None:
        """Called by every websocket connection that opens on a kernel."""
        self.held.opened(client)

    def connected(self, client: HeldClient) -> None:
        """Called by a websocket connection that opens while the kernel hibernates."""
        self.held.connected(client)

    def receive(self, client: HeldClient, raw: Any, channel: str, header: dict[str, Any]) -> bool:
        """Called by the websocket connection for each message a client sends; True when
        hibernation took it (held or answered), False when it goes to the kernel as usual."""
        return self.held.receive(client, raw, channel, header)

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
                                    lambda j: self.gpu_tier.wake(j, sleeper))
        else:
            assert sleeper.snapshot_id is not None
            self.service.jobs.start(
                job, [kernel_key(kernel_id), snapshot_key(sleeper.snapshot_id)],
                lambda j: self.process_tier.wake(j, sleeper),
            )
        sleeper.state, sleeper.job_id = WAKING, job.id
        self.log.info("gpu-snapshot: waking kernel %s from %s", kernel_id,
                      sleeper.snapshot_id or "host memory")
        self._event(sleeper, "waking")
        self._spawn(self._finish_wake(sleeper, job))

    async def _finish_wake(self, sleeper: SleepingKernel, job: Job) -> None:
        await self.service.jobs.wait(job)
        kernel_id = sleeper.kernel_id
        if job.status != "succeeded":
            error = job.error or {"message": "the wake failed"}
            sleeper.state, sleeper.error = HIBERNATED, error
            self.log.warning("gpu-snapshot: kernel %s did not wake: %s", kernel_id,
                             error.get("message"))
            self._event(sleeper, "wake_failed", message=str(error.get("message") or ""))
            self.held.refuse(sleeper, error)
            return
        seconds = (job.finished or time.time()) - job.started
        await self.held.deliver(sleeper)
        self.log.info("gpu-snapshot: kernel %s woke in %.1f s (%s); %d held messages delivered",
                      kernel_id, seconds, _moved(sleeper), len(sleeper.held))
        self._event(sleeper, "woken", seconds=seconds)

    # -- the server's kernels --------------------------------------------------------------
    async def on_kernel_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of jupyter_server's kernel_actions events: a hibernated kernel shut
        down or restarted is no longer hibernated; its snapshot stays, like any other."""
        kernel_id = str(data.get("kernel_id") or "")
        if data.get("action") in ("shutdown", "restart") and data.get("status") == "success":
            self.forget(kernel_id)

    def forget(self, kernel_id: str) -> None:
        self.sleepers.when_idle.pop(kernel_id, None)
        self.held.forget(kernel_id)
        sleeper = self.sleepers.kernels.get(kernel_id)
        if sleeper is None or sleeper.state == HIBERNATING:
            return
        del self.sleepers.kernels[kernel_id]
        self._event(sleeper, "forgotten")

    # -- the server's lifetime ---------------------------------------------------------------
    def start(self) -> None:
        """Start the loop that finds idle kernels (``idle_loop``)."""
        self.idle.start()

    async def stop(self) -> None:
        await self.idle.stop()

    async def tick(self) -> None:
        """Hibernate the kernels that asked to once idle, and those idle long enough."""
        await self.idle.tick()

    async def wake_before_stop(self) -> dict[str, str]:
        """Wake the kernels asleep in the gpu tier, so that the stopping server's saves can
        keep them; for each that stays asleep, why (``GpuTier.wake_before_stop``)."""
        return await self.gpu_tier.wake_before_stop()

    async def find_sleepers(self) -> list[str]:
        """Kernels that sleep in the gpu tier under a holder that outlived the server
        before this one: called once their slots are adopted, before clients connect."""
        return await self.gpu_tier.find_sleepers()

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


def _moved(sleeper: SleepingKernel) -> str:
    if sleeper.tier == GPU_TIER:
        return f"brought back {format_bytes(sleeper.gpu_bytes)} of GPU memory"
    return f"restored {format_bytes(sleeper.host_bytes + sleeper.gpu_bytes)}"
