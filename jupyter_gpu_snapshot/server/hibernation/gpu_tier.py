"""Hibernation's gpu tier: the GPU released and the process kept (``gpu/sleep.py``, or the
node agent's, through ``SnapshotService.gpu_sleep``).

The kernel's CUDA state moves into its own host memory and a holder process keeps its
threads stopped. Nothing is written; the wake brings the device memory back and lets the
threads run, in seconds. The holder outlives a restart of the server, which finds such
kernels asleep again (``find_sleepers``). Kernels take turns on a GPU: a wake that lacks
the memory it needs there first has the least recently used idle kernels on that GPU
release theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

from ..._constants import format_bytes
from ...core import procfs
from ...core.errors import NotReady, SnapshotError
from ...core.hooks import Progress
from ...launch.provisioner import root_pid
from ...node.engine import GpuSleeper
from ...node.gpus import GpuInventory
from ..hibernation_policy import last_active
from ..jobs import Job, kernel_key
from ..service import HIBERNATE, SnapshotService
from ..sleepers import GPU_TIER, HIBERNATED, Sleepers, SleepingKernel
from .held_messages import HeldMessages

# Free GPU memory a wake wants beyond what its kernel held there (the driver's own).
WAKE_MARGIN_BYTES = 256 << 20


class GpuTier:
    """Releases and wakes kernels' GPUs; made by ``Hibernation``, which hands it
    ``idle_for`` (seconds an awake kernel has been idle, or None) and ``give_back``
    (hibernate another kernel in this tier, for a wake that needs its GPU memory)."""

    def __init__(
        self,
        service: SnapshotService,
        sleepers: Sleepers,
        held: HeldMessages,
        log: logging.Logger,
        idle_for: Callable[[str], Awaitable[float | None]],
        give_back: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self.service = service
        self.sleepers = sleepers
        self.held = held
        self.log = log
        self._idle_for = idle_for
        self._give_back = give_back

    def start_release(self, sleeper: SleepingKernel, root: int) -> Job:
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

    async def wake(self, job: Job, sleeper: SleepingKernel) -> dict[str, Any]:
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
                    await self._give_back(other, why)
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
            self.held.release(sleeper)
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
