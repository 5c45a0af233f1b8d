"""The engine hook that takes a kernel's CUDA state into its snapshot and brings it back.

save:    preflight (refusals, release allocator caches, size the GPU bytes)
         -> start a broker and load CRIU's CUDA plugin into criu dump (before_dump), which
            locks each CUDA process while it runs, checkpoints it once criu has seized every
            thread, and (keep-running saves, failures) restores and unlocks it before criu
            lets the threads run again (see ``broker``)
         -> check every surviving process's CUDA state is running again (after_dump)
restore: preflight (same driver; target GPUs chosen, see ``remap``)
         -> the plugin in criu restore restores (onto the chosen GPUs) and unlocks each
            process before its threads run, once the images' digests matched (before_restore)
         -> check the restored processes run on the GPU (after_restore)

Snapshots saved before the plugin (no ``gpu.protocol`` in the manifest) hold processes that
were checkpointed before criu ran; they are restored in-process after criu, as then.

A kernel asleep in hibernation's gpu tier (``gpu/sleep.py``) is saved as it sleeps, its GPU
untouched: its holder stops the tree and lets go (``GpuSleep.hand_over``) right before criu
seizes it, and the plugin is told to leave its CUDA state as it is, checkpointed
(``gpu.dumped_state``: ``checkpointed``). A dump that fails gives the tree back to a holder
(``GpuSleep.hold_stopped``): it sleeps on. Such a snapshot is restored stopped, held, then
woken as from the gpu tier, onto the GPUs chosen: no thread of it runs on checkpointed CUDA.

A tree without CUDA state passes through untouched. The driver calls run in worker threads
and are awaited without being cancellable: a cancelled save waits for the call in flight,
then rolls back.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .._constants import DEFAULT_LIBDIR, format_bytes
from ..core import procfs
from ..core.compatibility import NodeGpus
from ..core.criu import CriuExtras
from ..core.errors import NotReady, SnapshotError
from ..core.hooks import Progress, RestoreContext, SaveContext, SnapshotHook
from ..core.recovery import work_base
from ..core.store import Snapshot
from .allocator_caches import CacheRelease, release_in_kernel
from .broker import CheckpointBroker, PluginInstall, uninterruptible
from .checkpoint import LOCK_TIMED_OUT, CudaCheckpoint, CudaProcess, error_hint
from .driver import (
    CheckpointDriver,
    CudaError,
    DriverCallError,
    DriverStatus,
    ProcessState,
    driver_status,
)
from .holder import STATUS_FIELDS
from .inventory import GpuInventory, host_memory_available, read_inventory
from .remap import GpuPlan, describe_choice, plan_targets, saved_gpus, visible_uuids
from .sleep import GpuSleep, holders_dir

CacheReleaser = Callable[[SaveContext], Awaitable[CacheRelease]]
# The manifest's ``gpu.protocol`` of snapshots whose CUDA state CRIU's plugin took.
PLUGIN_PROTOCOL = "criu-cuda-plugin"
# The manifest's ``gpu.dumped_state`` of snapshots of kernels that slept in the gpu tier.
DUMPED_CHECKPOINTED = "checkpointed"
# criu's --timeout (seconds to seize the tree) must outlast the CUDA lock made inside it.
SEIZE_MARGIN_SECONDS = 10

_GIB = 1 << 30
# Host RAM kept free beyond the staged GPU bytes; a full host hung the GPU machine once.
HOST_MARGIN_BYTES = 1 << 30
HOST_MARGIN_FRACTION = 0.05
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


GPU_DEVICE_PREFIX = "/dev/nvidia"


def gpu_device_users(pids: list[int]) -> list[int]:
    """Pids that have an NVIDIA device file open (to spot GPU use without a driver API)."""
    return procfs.pids_with_open(pids, GPU_DEVICE_PREFIX)


@dataclass
class _Save:
    procs: list[CudaProcess]
    status: DriverStatus
    inventory: GpuInventory | None
    moved: dict[int, dict[str, int]]
    release: CacheRelease | None
    visible: dict[int, list[str]] = field(default_factory=dict)
    broker: CheckpointBroker | None = None
    section: dict[str, Any] = field(default_factory=dict)
    # The holder's status when the kernel sleeps in the gpu tier: saved as it sleeps.
    asleep: dict[str, Any] | None = None

    @property
    def moved_bytes(self) -> int:
        return sum(sum(per_gpu.values()) for per_gpu in self.moved.values())


class CudaCheckpointHook(SnapshotHook):
    """Suspends CUDA around the dump and resumes it after; see the module docstring.

    ``driver``, ``inventory`` and ``memory_available`` are injectable so that the sequencing
    can be tested without a GPU; ``release_caches`` replaces the built-in release over the
    kernel's connection file (a server may prefer its own kernel client). ``plugin`` is where
    CRIU's CUDA plugin and the cuda-checkpoint stand-in are installed; ``criu_env`` adds to
    criu's environment (the tests force the plugin on where no GPU is).
    """

    name = "cuda"

    def __init__(
        self,
        lock_timeout: float = 10.0,
        drop_caches: bool = True,
        *,
        driver: Callable[[], DriverStatus] = driver_status,
        inventory: Callable[[], GpuInventory | None] = read_inventory,
        release_caches: CacheReleaser | None = None,
        memory_available: Callable[[], int] = host_memory_available,
        plugin: PluginInstall | None = None,
        criu_env: dict[str, str] | None = None,
    ) -> None:
        self.lock_timeout = lock_timeout
        self.plugin = plugin or PluginInstall(Path(DEFAULT_LIBDIR))
        self.criu_env = dict(criu_env or {})
        self.drop_caches = drop_caches
        self._load_driver = driver
        self._read_inventory = inventory
        self._release = release_caches or _release_over_connection_file
        self._memory_available = memory_available
        self._status: DriverStatus | None = None
        self._saves: dict[str, _Save] = {}
        self._plans: dict[str, GpuPlan] = {}
        self._restores: dict[str, CheckpointBroker] = {}

    def node_gpus(self) -> NodeGpus | None:
        """This node's GPUs by index, from the inventory the hook plans restores with.

        Called by ``core.compatibility.NodeCompatibility`` at restore, for snapshots that
        hold CUDA state.
        """
        inventory = self._read_inventory()
        if inventory is None or not inventory.devices:
            return None
        devices = sorted(inventory.devices, key=lambda d: d.index)
        return NodeGpus(inventory.driver_version, tuple(d.name for d in devices))

    def driver_status(self) -> DriverStatus:
        if self._status is None:
            self._status = self._load_driver()
        return self._status

    def gpu_sleep(self) -> GpuSleep:
        """Releases kernels' GPUs in place (hibernation's gpu tier), with this driver."""
        status = self.driver_status()
        if status.driver is None:
            raise NotReady("hibernate", f"no GPU to release: {status.problem}",
                           hint="hibernate in the process tier instead")
        return GpuSleep(status.driver, holders_dir(work_base()), self.lock_timeout,
                        self._read_inventory, self._memory_available)

    # -- save ------------------------------------------------------------------------------
    async def preflight_save(self, ctx: SaveContext) -> None:
        """Called by ``SnapshotEngine.save`` before anything is locked; raises to refuse."""
        pids = [p.pid for p in procfs.tree(ctx.root_pid)]
        status = await asyncio.to_thread(self.driver_status)
        if status.driver is None:
            users = gpu_device_users(pids)
            if users:
                raise NotReady(
                    "preflight",
                    f"pid {', '.join(map(str, users))} of the kernel uses the GPU, but "
                    f"{status.problem}",
                    hint="install NVIDIA driver 570 or newer to snapshot GPU kernels",
                )
            return
        cuda = CudaCheckpoint(status.driver)
        procs = await asyncio.to_thread(cuda.holders, pids)
        if not procs:
            return
        if all(p.state == ProcessState.CHECKPOINTED for p in procs):
            asleep = await asyncio.to_thread(self.gpu_sleep().asleep, ctx.root_pid)
            if asleep is not None:
                await self._preflight_asleep(ctx, procs, status, asleep)
                return
        for proc in procs:
            _require_running(proc)
        self._require_plugin(ctx.criu_version)
        inventory = await asyncio.to_thread(self._read_inventory)
        _refuse_unsupported(inventory, procs)
        release: CacheRelease | None = None
        if self.drop_caches and ctx.kernel.kernel_pid in {p.pid for p in procs}:
            ctx.report(Progress("preflight", message="releasing unused GPU allocator caches"))
            release = await self._release_safely(ctx)
            if release.released:
                inventory = await asyncio.to_thread(self._read_inventory)
        elif not self.drop_caches:
            release = CacheRelease(False, "turned off (c.GPUSnapshot.drop_allocator_caches)")
        moved = {p.pid: dict(inventory.process_memory.get(p.pid, {})) if inventory else {}
                 for p in procs}
        save = _Save(procs, status, inventory, moved, release, _visible(procs, inventory))
        need = int(save.moved_bytes * (1 + HOST_MARGIN_FRACTION)) + HOST_MARGIN_BYTES
        available = self._memory_available()
        if available < need:
            raise NotReady(
                "preflight",
                f"not enough free host memory to stage the kernel's GPU memory: "
                f"{format_bytes(save.moved_bytes)} to move plus a margin, "
                f"{format_bytes(available)} available",
                hint="free host memory, or free GPU memory in the kernel (del tensors, "
                "torch.cuda.empty_cache()) and retry",
            )
        # The staged GPU bytes become process memory that criu writes to the image.
        ctx.extra_bytes += save.moved_bytes
        self._saves[ctx.snapshot_id] = save

    async def _preflight_asleep(self, ctx: SaveContext, procs: list[CudaProcess],
                                status: DriverStatus, asleep: dict[str, Any]) -> None:
        """A kernel asleep in the gpu tier: its GPU memory is in its host memory already, and
        only a save that ends it (the move to the process tier) may take it as it sleeps."""
        if not ctx.stop:
            raise NotReady("preflight", "the kernel sleeps with its GPU released: a save that "
                           "keeps it running needs it awake",
                           hint="wake it first (run a cell), or hibernate it in the process tier")
        self._require_plugin(ctx.criu_version)
        inventory = await asyncio.to_thread(self._read_inventory)
        by_pid = dict(asleep.get("gpu_memory_by_pid") or {})
        moved = {p.pid: {str(k): int(v) for k, v in dict(by_pid.get(str(p.pid)) or {}).items()}
                 for p in procs}
        self._saves[ctx.snapshot_id] = _Save(procs, status, inventory, moved, None,
                                             _visible(procs, inventory), asleep=asleep)

    async def _release_safely(self, ctx: SaveContext) -> CacheRelease:
        try:
            return await self._release(ctx)
        except Exception as exc:  # releasing is an optimisation, never a reason to fail
            return CacheRelease(False, f"could not release caches: {type(exc).__name__}: {exc}")

    def _require_plugin(self, criu_version: str) -> None:
        problem = self.plugin.problem(criu_version)
        if problem is not None:
            raise NotReady(
                "preflight",
                f"the kernel holds CUDA state, but {problem}: criu must run the driver's "
                "checkpoint at the right moments, or frameworks such as JAX crash",
                hint="run scripts/install-criu.sh (make criu) to build the plugin for this "
                "criu, or set c.GPUSnapshot.libdir to where it is installed",
            )

    def _criu_extras(self, ctx_criu: CriuExtras, broker: CheckpointBroker) -> None:
        ctx_criu.libdir = str(self.plugin.plugin_dir)
        ctx_criu.env.update({**self.plugin.criu_env(broker.socket_path), **self.criu_env})
        ctx_criu.timeout = max(ctx_criu.timeout or 0,
                               math.ceil(self.lock_timeout) + SEIZE_MARGIN_SECONDS)

    async def before_dump(self, ctx: SaveContext) -> None:
        """Called by ``SnapshotEngine.save`` right before ``criu dump``: start the broker that
        answers criu's CUDA plugin, and load the plugin into the dump."""
        save = self._saves.get(ctx.snapshot_id)
        if save is None:
            return
        assert save.status.driver is not None
        tree = {p.pid for p in procfs.tree(ctx.root_pid)}
        broker = CheckpointBroker(save.status.driver, self.lock_timeout, tree.__contains__,
                                  hands_off=save.asleep is not None, pids=ctx.criu.pids)
        await broker.start()
        save.broker = broker
        self._criu_extras(ctx.criu, broker)
        total = save.moved_bytes
        live = save.release.live_bytes if save.release and save.release.released else None
        save.section = self._section(save, live)
        ctx.manifest["gpu"] = save.section
        if save.asleep is not None:
            save.section["dumped_state"] = DUMPED_CHECKPOINTED
            ctx.report(Progress("suspend", 0, total, message=f"writing the sleeping kernel: "
                                f"its {format_bytes(total)} of GPU memory is in host memory"))
            await asyncio.to_thread(self.gpu_sleep().hand_over, ctx.root_pid)
            return
        ctx.report(Progress("suspend", 0, total, message=_moving_message(total, live)))

    async def after_dump(self, ctx: SaveContext, error: BaseException | None) -> None:
        """Called by ``SnapshotEngine.save`` after the dump: see that every process still alive
        runs on the GPU again (the plugin resumed it inside criu; a criu that died could not)."""
        save = self._saves.pop(ctx.snapshot_id, None)
        if save is None or save.broker is None:
            return
        broker = save.broker
        await broker.close()
        for proc in save.procs:
            proc.timings = broker.timings.get(proc.pid, {})
        save.section["timings"] = _timings(save.procs)
        driver = save.status.driver
        assert driver is not None
        if save.asleep is not None:
            await self._sleep_on(ctx, save.asleep)
            return
        problems = await self._resume_left_behind(ctx, save, driver)
        failed = broker.errors[0] if error is not None and broker.errors else None
        if failed is not None:  # a CUDA step made criu fail: say which, in our words
            ctx.failure_cause = self._explain(failed, problems)
        elif problems:
            raise CudaError("resume", "; ".join(problems))

    async def _sleep_on(self, ctx: SaveContext, note: dict[str, Any]) -> None:
        """After the dump of a sleeping kernel: one that criu did not end (a failed dump)
        is held again and continued, asleep in the gpu tier as before. One that cannot be
        held is ended: it must not run on checkpointed CUDA."""
        if not await asyncio.to_thread(procfs.tree_alive, ctx.root_pid):
            return
        sleep = self.gpu_sleep()
        if await asyncio.to_thread(sleep.asleep, ctx.root_pid) is not None:
            return  # the hand-over never happened: its holder holds it still
        keep = {k: v for k, v in note.items() if k not in STATUS_FIELDS}
        try:
            await asyncio.to_thread(sleep.hold_stopped, ctx.root_pid, keep)
        except SnapshotError as exc:
            await asyncio.to_thread(procfs.kill_tree, ctx.root_pid)
            raise CudaError("resume", f"the sleeping kernel could not be held again after "
                            f"its dump, so it was ended: {exc.message}") from exc

    async def _resume_left_behind(self, ctx: SaveContext, save: _Save,
                                  driver: CheckpointDriver) -> list[str]:
        """Resume, from here, the processes whose CUDA state criu's plugin did not bring back
        (a criu that was killed, a restore the driver kept refusing); one line per failure."""
        alive = [p for p in save.procs if psutil.pid_exists(p.pid)]
        left = [p for p in alive if await uninterruptible(driver.state, p.pid)
                not in (ProcessState.RUNNING, None)]
        if not left:  # all running again, or a stopping dump ended the tree
            return []
        procfs.continue_tree(ctx.root_pid)
        ctx.report(Progress("resume", 0, save.moved_bytes, message="bringing GPU memory back"))
        return await uninterruptible(CudaCheckpoint(driver).resume_all, left)

    def _explain(self, exc: DriverCallError, problems: list[str]) -> CudaError:
        step = exc.call.removeprefix("cuCheckpointProcess").lower()
        if step == "lock" and exc.code in LOCK_TIMED_OUT:
            cause = (f"CUDA lock of pid {exc.pid} timed out after {self.lock_timeout:g} s: the "
                     f"GPU stayed busy ({exc})")
        else:
            cause = f"CUDA {step} of pid {exc.pid} failed: {exc}"
        if problems:
            cause += "; rolling back also failed: " + "; ".join(problems)
        else:
            cause += "; the kernel was left running on the GPU"
        return CudaError("suspend", cause, hint=error_hint(exc) or None)

    def _section(self, save: _Save, live: int | None) -> dict[str, Any]:
        info = save.status.info or save.status.driver.info  # type: ignore[union-attr]
        inventory = save.inventory
        release = save.release
        return {
            "protocol": PLUGIN_PROTOCOL,
            "driver_version": info.version or (inventory.driver_version if inventory else ""),
            "cuda_driver_version": info.cuda_version,
            "backend": info.backend,
            "devices": [d.to_dict() for d in inventory.devices] if inventory else [],
            # The GPUs the kernel could see, in its device order (cuda:0 first).
            "visible": save.visible.get(save.procs[0].pid, []) if save.procs else [],
            "processes": [
                {"pid": p.pid, "ns_pid": procfs.ns_pid(p.pid),
                 "gpu_bytes": sum(save.moved[p.pid].values()), "devices": save.moved[p.pid],
                 "visible": save.visible.get(p.pid, [])}
                for p in save.procs
            ],
            "moved_bytes": save.moved_bytes,
            "live_bytes": live,
            "allocator_caches": release.to_dict() if release else None,
            "lock_timeout": self.lock_timeout,
            "timings": _timings(save.procs),
        }

    # -- restore ---------------------------------------------------------------------------
    async def preflight_restore(self, ctx: RestoreContext) -> None:
        """Called by ``SnapshotEngine.restore`` before criu runs; raises to refuse."""
        gpu = ctx.snapshot.manifest.get("gpu")
        if not gpu or not gpu.get("processes"):
            return
        sid = ctx.snapshot.id
        ctx.gpus_taken = True
        status = await asyncio.to_thread(self.driver_status)
        if status.driver is None:
            raise NotReady("preflight", f"snapshot {sid} holds CUDA state, but {status.problem}")
        info = status.driver.info
        saved_driver = gpu.get("driver_version", "")
        if saved_driver and info.version and saved_driver != info.version:
            raise NotReady(
                "preflight",
                f"snapshot {sid} was taken with NVIDIA driver {saved_driver}; this machine has "
                f"{info.version}. The driver's user-space part is inside the snapshot and "
                "must match the kernel module exactly",
                hint=f"restore it on a machine with driver {saved_driver}",
            )
        if gpu.get("protocol") == PLUGIN_PROTOCOL:
            self._require_plugin(ctx.criu_version)
        inventory = await asyncio.to_thread(self._read_inventory)
        if inventory is None:
            raise NotReady("preflight", f"snapshot {sid} holds CUDA state, but no GPU can be "
                           "read here (NVML and nvidia-smi both failed)")
        _require_gpu_count(sid, gpu, inventory)
        plan = plan_targets(sid, saved_gpus(gpu), inventory.devices, ctx.gpus,
                            remap_supported=info.gpu_remap)
        need = ctx.snapshot.size_bytes + HOST_MARGIN_BYTES
        available = self._memory_available()
        if available < need:
            raise NotReady(
                "preflight",
                f"not enough free host memory to restore snapshot {sid}: "
                f"{format_bytes(ctx.snapshot.size_bytes)} of images plus a margin, "
                f"{format_bytes(available)} available",
            )
        self._plans[sid] = plan

    async def gpu_choice(self, snapshot: Snapshot, chosen: list[str] | None) -> dict[str, Any]:
        """Where a restore of ``snapshot`` would put its GPUs now (``describe_choice``), read
        with the same driver and inventory as a restore. Called by ``SnapshotService``."""
        status = await asyncio.to_thread(self.driver_status)
        inventory = await asyncio.to_thread(self._read_inventory)
        remap = bool(status.driver is not None and status.driver.info.gpu_remap)
        return describe_choice(snapshot.id, snapshot.manifest.get("gpu"),
                               inventory.devices if inventory else (), chosen, remap)

    async def before_restore(self, ctx: RestoreContext) -> None:
        """Called by ``SnapshotEngine.restore`` right before criu: the plugin restores and
        unlocks each CUDA process inside criu, before its threads run, once the images'
        digests matched (the broker's gate); criu then lets the tree run."""
        gpu = ctx.snapshot.manifest.get("gpu")
        if not gpu or not gpu.get("processes") or gpu.get("protocol") != PLUGIN_PROTOCOL:
            return
        plan = self._plans.get(ctx.snapshot.id) or GpuPlan(())
        visible = {int(p["ns_pid"]): p.get("visible") or None for p in gpu["processes"]}
        driver = self.driver_status().driver
        assert driver is not None  # preflight_restore refused otherwise

        def pairs(host_pid: int) -> list[tuple[str, str]]:
            return list(plan.pairs(visible.get(procfs.ns_pid(host_pid))))

        def kill(host_pid: int, _error: BaseException) -> None:
            procfs.kill_tree(procfs.namespace_init(host_pid) or host_pid)

        if gpu.get("dumped_state") == DUMPED_CHECKPOINTED:
            # Dumped stopped, as it slept: criu restores it stopped (its plugin is told
            # there is nothing for it to do), and the tree is held before it continues.
            broker = CheckpointBroker(driver, self.lock_timeout, _restored_by_us,
                                      hands_off=True, pids=ctx.criu.pids)
            ctx.resume_tree = self.gpu_sleep().hold_stopped
        else:
            broker = CheckpointBroker(driver, self.lock_timeout, _restored_by_us,
                                      gate=ctx.images_verified, on_gate_failed=kill,
                                      gpu_pairs=pairs, pids=ctx.criu.pids)
            ctx.criu.leave_stopped = False
        await broker.start()
        self._restores[ctx.snapshot.id] = broker
        self._criu_extras(ctx.criu, broker)
        total = sum(int(p.get("gpu_bytes", 0)) for p in gpu["processes"])
        ctx.report(Progress("restore", 0, total, message=_resume_message(plan)))

    async def restore_failed(self, ctx: RestoreContext, error: BaseException) -> None:
        """Called by ``SnapshotEngine.restore`` when criu or the digests failed."""
        self._plans.pop(ctx.snapshot.id, None)
        broker = self._restores.pop(ctx.snapshot.id, None)
        if broker is not None:
            await broker.close()

    async def after_restore(self, ctx: RestoreContext) -> None:
        """Called by ``SnapshotEngine.restore`` once criu has recreated the tree."""
        gpu = ctx.snapshot.manifest.get("gpu")
        if not gpu or not gpu.get("processes"):
            return
        plan = self._plans.pop(ctx.snapshot.id, None) or GpuPlan(())  # (): the same GPUs
        broker = self._restores.pop(ctx.snapshot.id, None)
        driver = self.driver_status().driver
        assert driver is not None  # preflight_restore refused otherwise
        by_ns_pid = {procfs.ns_pid(p.pid): p.pid for p in procfs.tree(ctx.root_pid)}
        hosts = []
        for saved in gpu["processes"]:
            host = by_ns_pid.get(int(saved["ns_pid"]))
            if host is None:
                raise CudaError("resume", f"process {saved['ns_pid']} of the snapshot, which "
                                "held CUDA state, is missing from the restored tree")
            hosts.append((host, saved))
        if broker is not None:
            await broker.close()
            if gpu.get("dumped_state") == DUMPED_CHECKPOINTED:
                await self._wake_held(ctx, plan, hosts)
            await self._check_resumed(driver, broker, [h for h, _ in hosts])
        else:
            await self._resume_after_criu(ctx, driver, plan, hosts)
        ctx.notes["gpu_remap"] = plan.to_dict()

    async def _wake_held(self, ctx: RestoreContext, plan: GpuPlan,
                         hosts: list[tuple[int, dict[str, Any]]]) -> None:
        """A snapshot of a sleeping kernel, restored and held (``resume_tree``): woken as
        from the gpu tier, each process onto the GPUs chosen for it."""
        pairs = {host: tuple(plan.pairs(saved.get("visible") or None)) for host, saved in hosts}
        total = sum(int(saved.get("gpu_bytes", 0)) for _, saved in hosts)
        ctx.report(Progress("resume", 0, total, message=_resume_message(plan)))
        await uninterruptible(self.gpu_sleep().wake, ctx.root_pid,
                              lambda pid: pairs.get(pid, ()))
        ctx.report(Progress("resume", total, total))

    async def _check_resumed(self, driver: CheckpointDriver, broker: CheckpointBroker,
                             hosts: list[int]) -> None:
        """The plugin brought each process back inside criu: check the driver agrees."""
        for host in hosts:
            state = await uninterruptible(driver.state, host)
            if state != ProcessState.RUNNING:
                said = "; ".join(f"{e}" for e in broker.errors) or "no CUDA call failed"
                raise CudaError(
                    "resume",
                    f"restored pid {host} should run on the GPU once criu is done, but the "
                    f"driver reports {state.value if state else 'no CUDA state'} ({said})",
                    hint=error_hint(broker.errors[0]) if broker.errors else None,
                )

    async def _resume_after_criu(self, ctx: RestoreContext, driver: CheckpointDriver,
                                 plan: GpuPlan, hosts: list[tuple[int, dict[str, Any]]]) -> None:
        """Snapshots saved before the plugin: restore and unlock from here, as they were."""
        procs = []
        for host, saved in hosts:
            state = await asyncio.to_thread(driver.state, host)
            if state != ProcessState.CHECKPOINTED:
                raise CudaError(
                    "resume",
                    f"restored pid {host} should hold checkpointed CUDA state, but the driver "
                    f"reports {state.value if state else 'none'}",
                )
            procs.append((CudaProcess(host, state), plan.pairs(saved.get("visible") or None)))
        gpu = ctx.snapshot.manifest["gpu"]
        total = sum(int(p.get("gpu_bytes", 0)) for p in gpu["processes"])
        ctx.report(Progress("resume", 0, total, message=_resume_message(plan)))
        cuda = CudaCheckpoint(driver)
        problems = []
        for proc, pairs in reversed(procs):
            problems += await uninterruptible(cuda.resume_all, [proc], pairs)
        if problems:
            raise CudaError("resume", "; ".join(problems))
        ctx.report(Progress("resume", total, total))


def _restored_by_us(pid: int) -> bool:
    """A process that our criu restore is bringing back: a descendant of this process (criu
    is our child) in a PID namespace of its own."""
    try:
        ours = {p.pid for p in psutil.Process(pid).parents()}
    except psutil.Error:
        return False
    return os.getpid() in ours and procfs.pid_namespace(pid) != procfs.pid_namespace(os.getpid())


async def _release_over_connection_file(ctx: SaveContext) -> CacheRelease:
    info = ctx.target.connection_info or ctx.kernel.connection_info
    if not info:
        return CacheRelease(False, "the kernel's connection file is unknown; caches kept")
    return await release_in_kernel(info)


def _visible(procs: list[CudaProcess], inventory: GpuInventory | None) -> dict[int, list[str]]:
    """The GPUs each process can see, in its device order (cuda:0 first)."""
    devices = inventory.devices if inventory else ()
    return {p.pid: visible_uuids(procfs.environment_variable(p.pid, CUDA_VISIBLE_DEVICES),
                                 devices) for p in procs}


def _require_running(proc: CudaProcess) -> None:
    if proc.state == ProcessState.RUNNING:
        return
    if proc.state == ProcessState.FAILED:
        raise CudaError(
            "preflight",
            f"the driver reports the CUDA state of pid {proc.pid} as failed: its GPU state "
            "is lost, so there is nothing to snapshot",
            hint="restart the kernel",
        )
    raise CudaError(
        "preflight",
        f"the CUDA state of pid {proc.pid} is {proc.state.value}, not running: another "
        "checkpoint of it is under way or was left unfinished",
        hint="wait for the other checkpoint to finish (or run cuda-checkpoint to resume it)",
    )


def _refuse_unsupported(inventory: GpuInventory | None, procs: list[CudaProcess]) -> None:
    if inventory is None:
        return
    if inventory.mps_active:
        raise NotReady("preflight", "an MPS daemon runs on this machine; the driver's "
                       "checkpoint API does not support MPS clients",
                       hint="stop nvidia-cuda-mps-control, or use a machine without MPS")
    for proc in procs:
        for uuid in inventory.process_memory.get(proc.pid, {}):
            device = inventory.device(uuid)
            if device is not None and device.mig_enabled:
                raise NotReady("preflight", f"pid {proc.pid} uses GPU {device.index} "
                               f"({device.name}) in MIG mode, which the driver's checkpoint "
                               "API does not support")


def _require_gpu_count(sid: str, gpu: dict[str, Any], inventory: GpuInventory) -> None:
    """A process that saw every GPU of its node expects as many here: the driver wants a pair
    for every GPU the process can see, and it would see all of this node's."""
    before = gpu.get("devices", [])
    saw = set(gpu.get("visible") or [d["uuid"] for d in before])
    if saw == {str(d["uuid"]) for d in before} and len(before) != len(inventory.devices):
        raise NotReady("preflight", f"snapshot {sid} was taken on a machine with "
                       f"{len(before)} GPU(s); this one has {len(inventory.devices)}",
                       hint=f"restore it on a node with {len(before)} GPU(s) of its model")


def _resume_message(plan: GpuPlan) -> str:
    moves = [p for p in plan.placements if p.moved]
    if not moves:
        return "bringing GPU memory back"
    return "bringing GPU memory back onto other GPUs: " + ", ".join(
        f"cuda:{p.saved.position} onto GPU {p.target.index}" for p in moves)


def _timings(procs: list[CudaProcess]) -> dict[str, float]:
    out: dict[str, float] = {}
    for proc in procs:
        for step, seconds in proc.timings.items():
            out[step] = round(out.get(step, 0.0) + seconds, 4)
    return out


def _moving_message(total: int, live: int | None) -> str:
    text = f"moving {format_bytes(total)} of GPU memory to host memory"
    return text + (f" ({format_bytes(live)} of it live tensors)" if live is not None else "")
