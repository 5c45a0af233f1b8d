"""The engine every caller uses, built from ``c.GPUSnapshot``: the store, criu and the GPU hook.

The server, the CLI and the benchmarks all call ``make_engine``; the core itself knows
nothing of settings or of the GPU layer.
"""

from __future__ import annotations

from .config import GPUSnapshot
from .core.criu import CriuRunner
from .core.engine import SnapshotEngine, SnapshotHook
from .core.store import SnapshotStore
from .gpu.hook import CudaCheckpointHook


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
    return SnapshotEngine(
        SnapshotStore(settings.store_dir),
        CriuRunner(settings.criu_path),
        hooks if hooks is not None else default_hooks(settings),
    )
