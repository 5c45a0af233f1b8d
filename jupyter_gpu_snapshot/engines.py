"""The engine every caller uses, built from ``c.GPUSnapshot``: the store, criu and the GPU hook.

The server and the CLI call ``process_engine``: ``make_engine``'s engine where the process
may run criu itself (root), else the node agent's (``agent_client.remote_engine``). The
agent and the benchmarks call ``make_engine``; the core itself knows nothing of settings or
of the GPU layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ._constants import PROVISIONER_NAME
from .agent_client.client import AgentClient
from .agent_client.remote_engine import AgentEngine
from .config import GPUSnapshot
from .core import procfs
from .core.compatibility import NodeCompatibility
from .core.criu import CriuRunner
from .core.engine import SnapshotEngine
from .core.errors import SnapshotError
from .core.hooks import SnapshotHook
from .core.manifest import ManifestPolicy
from .core.open_files import OpenFilesHook
from .core.recovery import work_base
from .core.store import SnapshotStore, default_kernel_log_dir
from .gpu.broker import PluginInstall
from .gpu.driver import DriverStatus
from .gpu.hook import CudaCheckpointHook
from .launch.liveness import kernel_answers


def is_snapshot_ready_kernel(name: str) -> bool:
    """Whether ``name`` is an installed kernelspec that launches through our provisioner."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    provisioner = (spec.metadata or {}).get("kernel_provisioner") or {}
    return bool(provisioner.get("provisioner_name") == PROVISIONER_NAME)


def default_hooks(settings: GPUSnapshot, follow_links: bool = True) -> list[SnapshotHook]:
    """The hooks every engine runs: the open-files check, and the GPU layer (inert for kernels
    without CUDA state)."""
    return [
        OpenFilesHook(ghost_limit=settings.ghost_limit, changed_files=settings.changed_files,
                      follow_links=follow_links),
        CudaCheckpointHook(
            lock_timeout=settings.cuda_lock_timeout,
            drop_caches=settings.drop_allocator_caches,
            plugin=PluginInstall(Path(settings.libdir)),
        ),
    ]


def make_engine(
    settings: GPUSnapshot | None = None,
    hooks: list[SnapshotHook] | None = None,
    kernel_log_dir: Callable[[], Path] = default_kernel_log_dir,
    follow_links: bool = True,
) -> SnapshotEngine:
    """``kernel_log_dir``: where the kernels' logs live; the node agent names each user's.
    ``follow_links`` false: the kernels' files are another user's, and the checks of them
    follow no link (the node agent's)."""
    settings = settings or GPUSnapshot()
    policy = ManifestPolicy(
        kernel_log_dir=kernel_log_dir, kernel_allowed=is_snapshot_ready_kernel
    )
    hooks = hooks if hooks is not None else default_hooks(settings, follow_links)
    # The node's GPUs as the CUDA hook reads them, so the check and the restore agree.
    cuda = next((h for h in hooks if isinstance(h, CudaCheckpointHook)), None)
    return SnapshotEngine(
        SnapshotStore(settings.store_dir, settings.signing_key_file, policy,
                      chunk_images=settings.chunk_images),
        CriuRunner(settings.criu_path, ghost_limit=settings.ghost_limit),
        hooks,
        NodeCompatibility(gpus=cuda.node_gpus if cuda else None, follow_links=follow_links),
        kernel_answers=kernel_answers,
    )


def process_engine(settings: GPUSnapshot | None = None) -> SnapshotEngine:
    """The engine this process uses: its own where it may run criu (root), else the node
    agent's (``GPUSnapshot.through_agent``). The server and the CLI call this."""
    settings = settings or GPUSnapshot()
    if settings.through_agent():
        # The user's own directory keeps what the server writes beside its snapshots
        # (the notebooks' autosave choices); the snapshots are the agent's.
        own = SnapshotStore(settings.store_dir, settings.signing_key_file)
        return AgentEngine(AgentClient(settings.agent_socket), own)
    return make_engine(settings)


def wake_kernel(root_pid: int, driver: Callable[[], DriverStatus] | None = None) -> list[str]:
    """Bring back a kernel tree that a killed save left stopped or with its CUDA suspended.

    Called by recovery (server start, ``jupyter gpu-snapshot recover``) and by
    ``jupyter gpu-snapshot resume``; returns one line per process whose CUDA stays suspended.
    ``driver`` replaces the machine's CUDA driver (the tests' scripted one).
    """
    from .gpu.checkpoint import CudaCheckpoint
    from .gpu.driver import driver_status
    from .gpu.sleep import GpuSleep, holders_dir

    status = (driver or driver_status)()
    if status.driver is None:
        procfs.continue_tree(root_pid)
        return []
    sleep = GpuSleep(status.driver, holders_dir(work_base()), lock_timeout=10.0)
    if sleep.asleep(root_pid) is not None:
        return []  # it sleeps in the gpu tier, held: the server finds it asleep
    pids = [p.pid for p in procfs.tree(root_pid)]
    if procfs.tree_stopped(root_pid) and any(status.driver.restore_thread_id(p) for p in pids):
        # A sleeping kernel whose dump died after its holder let go (only a hand-over stops
        # a CUDA tree): held again before it continues, so that none of its threads runs
        # on checkpointed CUDA, then woken. (Its state is not asked while it is stopped:
        # the driver would wait for its stopped restore thread.)
        try:
            sleep.hold_stopped(root_pid)
            sleep.wake(root_pid)
        except SnapshotError as exc:
            return [exc.message]
        return []
    procfs.continue_tree(root_pid)
    cuda = CudaCheckpoint(status.driver)
    try:
        holders = cuda.holders(pids)
    except Exception as exc:  # a tree that ended meanwhile has nothing to resume
        logging.getLogger(__name__).info("no CUDA state to resume in %s: %s", root_pid, exc)
        return []
    return cuda.resume_all(holders)
