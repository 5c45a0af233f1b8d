"""The Jupyter server extension of jupyter_gpu_snapshot (REST API under gpu-snapshot/)."""

from .app import GPUSnapshotApp

__all__ = ["GPUSnapshotApp"]
