"""The engine this process runs itself (``LocalEngine``), built from ``c.GPUSnapshot``: the
store, criu and the GPU hook; and the choice between it and the node agent's.

The server and the CLI call ``process_engine``: a ``LocalEngine`` where the process may run
criu itself (root), else the node agent's (``agent_client.agent_engine``); both are a
``NodeEngine``. The agent and the benchmarks call ``make_engine``, the agent with an
``EngineLaunch`` for each caller's operation; the core itself knows nothing of settings or
of the GPU layer.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import GPUSnapshot
from ..core.compatibility import NodeCompatibility
from ..core.criu import CriuLaunch, CriuRunner
from ..core.criu_build import CriuFill, describe_fill
from ..core.engine import SnapshotEngine
from ..core.errors import NotReady, SnapshotError
from ..core.file_access import OWN_FILES, FileAccess
from ..core.hooks import SnapshotHook
from ..core.open_files import OpenFilesHook
from ..core.recovery import RecoveryReport, clean_work_dirs, recover_store, work_base
from ..core.sequences import KernelAnswers
from ..core.store import ManifestPolicy, Snapshot, SnapshotStore, default_kernel_log_dir
from ..gpu.broker import PluginInstall
from ..gpu.driver import DriverStatus
from ..gpu.hook import CudaCheckpointHook
from ..gpu.inventory import read_inventory
from ..gpu.remap import describe_choice
from ..gpu.sleep import GpuSleep, SleepReport
from ..gpu.trees import wake_tree
from ..launch.kernelspec import is_snapshot_ready_kernelspec
from ..launch.liveness import kernel_answers
from .engine import NodeEngine

if TYPE_CHECKING:
    from ..core.store import StoreRoom


def default_hooks(settings: GPUSnapshot) -> list[SnapshotHook]:
    """The hooks every engine runs: the open-files check, and the GPU layer (inert for kernels
    without CUDA state)."""
    return [
        OpenFilesHook(ghost_limit=settings.ghost_limit, changed_files=settings.changed_files),
        CudaCheckpointHook(
            lock_timeout=settings.cuda_lock_timeout,
            drop_caches=settings.drop_allocator_caches,
            plugin=PluginInstall(Path(settings.libdir)),
        ),
    ]


def wake_kernel(root_pid: int, driver: Callable[[], DriverStatus] | None = None) -> list[str]:
    """Bring back a kernel tree that a killed save left stopped or with its CUDA suspended
    (``gpu.trees.wake_tree``); recovery's ``wake``. One line per process whose CUDA stays
    suspended; ``driver`` replaces the machine's CUDA driver (the tests' scripted one)."""
    return wake_tree(root_pid, work_base(), driver)


@dataclass(frozen=True)
class EngineLaunch:
    """How an engine reaches the kernels it saves and restores, given when it is made: as
    this process, by default. The node agent builds one for each operation of a caller
    (``agent/realms.engine_launch``): criu's credentials and, in a pod, the container's
    view (``criu``), how a kernel is asked whether it answers (``kernel_answers``), how
    the kernel user's files are opened (``files``: as that user), and hooks that run after
    the engine's own (``hooks``: the caller's checks)."""

    criu: CriuLaunch = field(default_factory=CriuLaunch)
    kernel_answers: KernelAnswers = kernel_answers
    files: FileAccess = OWN_FILES
    hooks: tuple[SnapshotHook, ...] = ()


class LocalEngine(SnapshotEngine):
    """The core's engine, run by this process (root), with what callers ask of a
    ``NodeEngine`` besides the store and the two sequences."""

    @property
    def local_store(self) -> SnapshotStore:
        return self.store

    @property
    def own_dir(self) -> Path:
        return self.store.root

    def store_room(self) -> StoreRoom:
        from ..core.store import StoreRoom

        try:
            free: int | None = self.store.free_bytes()
        except OSError:
            free = None
        return StoreRoom(str(self.store.root), free)

    def with_launch(self, launch: EngineLaunch) -> LocalEngine:
        """An engine of this one's store, index, compatibility cache and hooks that runs
        as ``launch`` says: the node agent's for one operation of one caller. Nothing of
        this engine changes."""
        return LocalEngine(
            self.store, self.criu.with_launch(launch.criu), [*self.hooks, *launch.hooks],
            self.compatibility, kernel_answers=launch.kernel_answers,
            files=launch.files, index=self.index)

    def trust(self, ref: str) -> Snapshot:
        return self.store.trust(self.store.get(ref).id)

    def recover(self) -> RecoveryReport:
        report = recover_store(self.store, wake=wake_kernel)
        # criu's work directories and the images assembled for restores whose process died.
        report.removed += clean_work_dirs()
        return report

    def node_problems(self) -> builtins.list[str]:
        try:
            self.criu.require_version()
        except SnapshotError as exc:
            return [exc.cause]
        return []

    def criu_fill(self) -> CriuFill | None:
        hook = self._cuda_hook()
        if hook is None:
            return None
        try:
            executable = Path(self.criu.executable())
        except SnapshotError as exc:
            return CriuFill(None, None, exc.cause)
        return describe_fill(executable, hook.plugin.plugin_dir)

    def _cuda_hook(self) -> CudaCheckpointHook | None:
        return next((h for h in self.hooks if isinstance(h, CudaCheckpointHook)), None)

    def gpu_sleep(self) -> GpuSleep:
        hook = self._cuda_hook()
        if hook is None:
            raise NotReady("hibernate", "this server has no CUDA checkpoint hook",
                           hint="hibernate in the process tier instead")
        return hook.gpu_sleep()

    async def gpu_choice(self, snapshot: Snapshot, chosen: list[str] | None) -> dict[str, Any]:
        hook = self._cuda_hook()
        if hook is None:
            return describe_choice(snapshot.id, None, (), chosen, False)
        return await hook.gpu_choice(snapshot, chosen)


def make_engine(
    settings: GPUSnapshot | None = None,
    hooks: list[SnapshotHook] | None = None,
    kernel_log_dir: Callable[[], Path] = default_kernel_log_dir,
    launch: EngineLaunch | None = None,
) -> LocalEngine:
    """``kernel_log_dir``: where the kernels' logs live; the node agent names each user's.
    ``launch``: how criu runs and the kernels and their files are reached
    (``EngineLaunch``; by default as this process)."""
    launch = launch or EngineLaunch()
    settings = settings or GPUSnapshot()
    policy = ManifestPolicy(
        kernel_log_dir=kernel_log_dir, kernel_allowed=is_snapshot_ready_kernelspec
    )
    hooks = hooks if hooks is not None else default_hooks(settings)
    # The node's GPUs as the CUDA hook reads them, so the check and the restore agree.
    cuda = next((h for h in hooks if isinstance(h, CudaCheckpointHook)), None)
    return LocalEngine(
        SnapshotStore(settings.store_dir, settings.signing_key_file, policy,
                      chunk_images=settings.chunk_images),
        CriuRunner(settings.criu_path, ghost_limit=settings.ghost_limit, launch=launch.criu,
                   timeout=settings.criu_timeout or None),
        [*hooks, *launch.hooks],
        NodeCompatibility(gpus=cuda.node_gpus if cuda else None),
        kernel_answers=launch.kernel_answers,
        files=launch.files,
    )


def process_engine(settings: GPUSnapshot | None = None) -> NodeEngine:
    """The engine this process uses: its own where it may run criu (root), else the node
    agent's (``GPUSnapshot.through_agent``). The server and the CLI call this."""
    settings = settings or GPUSnapshot()
    if settings.through_agent():
        from ..agent_client.agent_engine import AgentEngine
        from ..agent_client.client import AgentClient
        from ..agent_client.gpu_sleep import AgentGpuSleep

        # The user's own directory keeps what the server writes beside its snapshots
        # (the notebooks' autosave choices); the snapshots are the agent's.
        return AgentEngine(AgentClient(settings.agent_socket), Path(settings.store_dir),
                           lambda client: AgentGpuSleep(client, sleep_report, read_inventory))
    return make_engine(settings)


def sleep_report(fields: dict[str, Any]) -> SleepReport:
    """A release's or a wake's report as the node agent sends it (``SleepReport.to_dict``)."""
    return SleepReport(
        pids=[int(pid) for pid in fields["pids"]],
        gpu_memory={str(gpu): int(n) for gpu, n in dict(fields["gpu_memory"]).items()},
        held_threads=int(fields["held_threads"]),
        timings={str(step): float(t) for step, t in dict(fields["timings"]).items()},
    )
