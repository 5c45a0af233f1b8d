"""The GPU layer as the CLI and the server see it: the few names of gpu/ they use.

Nothing above node/ calls the driver: they ask a kernel tree's CUDA state, wake or resume a
tree, read the GPUs' inventory (NVML, readable by any user), and describe or parse a choice
of GPUs for a restore. The engine's CUDA hook and hibernation's gpu tier are reached
through the engine (``engine.NodeEngine``).
"""

from __future__ import annotations

from ..gpu.broker import PluginInstall
from ..gpu.driver import driver_status
from ..gpu.inventory import GpuInventory, read_inventory
from ..gpu.remap import parse_gpu_choice, remap_notice
from ..gpu.sleep import GpuSleep, SleepReport
from ..gpu.trees import Resumed, resume_tree, tree_cuda_state

__all__ = [
    "GpuInventory",
    "GpuSleep",
    "PluginInstall",
    "Resumed",
    "SleepReport",
    "driver_status",
    "parse_gpu_choice",
    "read_inventory",
    "remap_notice",
    "resume_tree",
    "tree_cuda_state",
]
