"""The engine every caller uses, built from ``c.GPUSnapshot``: the store, criu and the GPU hook.

The server, the CLI and the benchmarks all call ``make_engine``; the core itself knows
nothing of settings or of the GPU layer.
"""

from __future__ import annotations

import logging

from ._constants import PROVISIONER_NAME
from .config import GPUSnapshot
from .core import procfs
from .core.compatibility import NodeCompatibility, NodeGpus
from .core.criu import CriuRunner
from .core.engine import SnapshotEngine, SnapshotHook
from .core.manifest import ManifestPolicy
from .core.open_files import OpenFilesHook
from .core.store import SnapshotStore, default_kernel_log_dir
from .gpu.hook import CudaCheckpointHook
from .gpu.inventory import read_inventory


def is_snapshot_ready_kernel(name: str) -> bool:
    """Whether ``name`` is an installed kernelspec that launches through our provisioner."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    provisioner = (spec.metadata or {}).get("kernel_provisioner") or {}
    return bool(provisioner.get("provisioner_name") == PROVISIONER_NAME)


def default_hooks(settings: GPUSnapshot) -> list[SnapshotHook]:
    """The hooks every engine runs: the open-files check, and the GPU layer (inert for kernels
    without CUDA state)."""
    return [
        OpenFilesHook(ghost_limit=settings.ghost_limit, changed_files=settings.changed_files),
        CudaCheckpointHook(
            lock_timeout=settings.cuda_lock_timeout,
            drop_caches=settings.drop_allocator_caches,
        ),
    ]


def node_gpus() -> NodeGpus | None:
    """This node's GPUs for the compatibility check, from the GPU layer's inventory.

    Called by ``NodeCompatibility`` at restore, only for snapshots that hold CUDA state.
    """
    inventory = read_inventory()
    if inventory is None or not inventory.devices:
        return None
    devices = sorted(inventory.devices, key=lambda d: d.index)
    return NodeGpus(inventory.driver_version, tuple(d.name for d in devices))


def make_engine(
    settings: GPUSnapshot | None = None, hooks: list[SnapshotHook] | None = None
) -> SnapshotEngine:
    settings = settings or GPUSnapshot()
    policy = ManifestPolicy(
        kernel_log_dir=default_kernel_log_dir, kernel_allowed=is_snapshot_ready_kernel
    )
    return SnapshotEngine(
        SnapshotStore(settings.store_dir, settings.signing_key_file, policy),
        CriuRunner(settings.criu_path, ghost_limit=settings.ghost_limit),
        hooks if hooks is not None else default_hooks(settings),
        NodeCompatibility(gpus=node_gpus),
    )


def wake_kernel(root_pid: int) -> list[str]:
    """Bring back a kernel tree that a killed save left stopped or with its CUDA suspended.

    Called by recovery (server start, ``jupyter gpu-snapshot recover``) and by
    ``jupyter gpu-snapshot resume``; returns one line per process whose CUDA stays suspended.
    """
    from .gpu.checkpoint import CudaCheckpoint
    from .gpu.driver import driver_status

    procfs.continue_tree(root_pid)
    status = driver_status()
    if status.driver is None:
        return []
    cuda = CudaCheckpoint(status.driver)
    try:
        holders = cuda.holders([p.pid for p in procfs.tree(root_pid)])
    except Exception as exc:  # a tree that ended meanwhile has nothing to resume
        logging.getLogger(__name__).info("no CUDA state to resume in %s: %s", root_pid, exc)
        return []
    return cuda.resume_all(holders)
