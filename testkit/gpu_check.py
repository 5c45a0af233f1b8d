"""Whether this machine can run the GPU tests, and if not, why (shown in the skip reason).

GPU tests are skipped only where no NVIDIA driver exists; on a machine with one, anything
missing is a failure.
"""

from __future__ import annotations

import ctypes
from pathlib import Path


def no_gpu_reason() -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded)"
    if not Path("/dev/nvidiactl").exists():
        return "the NVIDIA driver library is here but no GPU device (/dev/nvidiactl)"
    return None


def fewer_gpus_reason(count: int) -> str | None:
    """Why a test that needs ``count`` GPUs cannot run here, or None when it can."""
    reason = no_gpu_reason()
    if reason is not None:
        return reason
    from jupyter_gpu_snapshot.gpu.inventory import read_inventory

    inventory = read_inventory()
    found = len(inventory.devices) if inventory else 0
    if found < count:
        return f"needs {count} GPUs of one model; this machine has {found}"
    return None
