"""The engine every caller uses, built from ``c.GPUSnapshot``: the store, criu and the GPU hook.

The server, the CLI and the benchmarks all call ``make_engine``; the core itself knows
nothing of settings or of the GPU layer.
"""

from __future__ import annotations

from ._constants import PROVISIONER_NAME
from .config import GPUSnapshot
from .core.criu import CriuRunner
from .core.engine import SnapshotEngine, SnapshotHook
from .core.manifest import ManifestPolicy
from .core.store import SnapshotStore, default_kernel_log_dir
from .gpu.hook import CudaCheckpointHook


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
    """The hooks every engine runs: the GPU layer (inert for kernels without CUDA state)."""
    return [
        CudaCheckpointHook(
            lock_timeout=settings.cuda_lock_timeout,
            drop_caches=settings.drop_allocator_caches,
        )
    ]


def make_engine(
    settings: GPUSnapshot | None = None, hooks: list[SnapshotHook] | None = None
) -> SnapshotEngine:
    settings = settings or GPUSnapshot()
    policy = ManifestPolicy(
        kernel_log_dir=default_kernel_log_dir, kernel_allowed=is_snapshot_ready_kernel
    )
    return SnapshotEngine(
        SnapshotStore(settings.store_dir, settings.signing_key_file, policy),
        CriuRunner(settings.criu_path),
        hooks if hooks is not None else default_hooks(settings),
    )
