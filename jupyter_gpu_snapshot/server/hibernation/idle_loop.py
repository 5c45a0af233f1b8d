"""Hibernation's loop: every ``autosave_check_seconds``, the kernels idle long enough go to
sleep.

A snapshot-ready kernel idle (no cell running, no output) for ``hibernate_after_minutes``,
holding at least ``hibernate_min_gpu_bytes`` of GPU memory, and with no client connected
when ``hibernate_only_without_clients``, hibernates in the process tier; one idle for
``release_gpu_after_minutes`` that holds GPU memory, in the gpu tier. A kernel asleep in
the gpu tier moves to the process tier once idle for ``hibernate_after_minutes``, or, the
least recently used first, while the node's host memory runs low. A kernel asked to
hibernate once idle (``%gpu_snapshot hibernate``) does at the first look that finds it so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import psutil

from ..._constants import format_bytes
from ...config import GPUSnapshot
from ...core.errors import SnapshotError
from ...launch.provisioner import SnapshotReadyProvisioner, root_pid
from ..hibernation_policy import HibernationPolicy, IdleMinutes, idle_seconds, last_active
from ..jupyter_server_internals import websocket_count
from ..service import SnapshotService
from ..sleepers import GPU_TIER, HIBERNATED, PROCESS_TIER, Sleepers, SleepingKernel


class IdleLoop:
    """Finds the kernels to hibernate; made by ``Hibernation``, which hands it ``hibernate``
    (a kernel, why, the tier) and ``move_to_disk`` (a kernel asleep in the gpu tier, why),
    and started and stopped with the server."""

    def __init__(
        self,
        service: SnapshotService,
        sleepers: Sleepers,
        settings: GPUSnapshot,
        log: logging.Logger,
        hibernate: Callable[[str, str, str], Awaitable[SleepingKernel]],
        move_to_disk: Callable[[SleepingKernel, str], Awaitable[SleepingKernel]],
        hibernate_after: IdleMinutes | None = None,
        release_gpu_after: IdleMinutes | None = None,
    ) -> None:
        self.service = service
        self.sleepers = sleepers
        self.settings = settings
        self.log = log
        self._hibernate = hibernate
        self._move_to_disk = move_to_disk
        # Minutes of idleness after which a kernel hibernates in each tier: its notebook's
        # choice (``%gpu_snapshot hibernate [gpu] after 30m``), else the server's setting.
        self._hibernate_after = hibernate_after
        self._release_gpu_after = release_gpu_after
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())

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
            elif await self.idle_for(kernel_id) is not None:
                await self._try(kernel_id, "asked to hibernate once idle", tier)
        for kernel_id in list(kernel_manager.list_kernel_ids()):
            idle = await self.idle_for(kernel_id)
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

    async def idle_for(self, kernel_id: str) -> float | None:
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
