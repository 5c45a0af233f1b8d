"""What the layers above ask of the GPU about a whole kernel tree: its CUDA state, and
bringing it back after a save that was killed.

The only module outside the engine's hook (``hook.py``) and hibernation's gpu tier
(``sleep.py``) that callers above gpu/ use to reach the driver; they call it through
``node/``. Each function blocks: the server runs it in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import procfs
from ..core.errors import SnapshotError
from .checkpoint import CudaCheckpoint
from .driver import DriverStatus, driver_status
from .inventory import read_inventory
from .sleep import GpuSleep, holders_dir

# The worst state of the kernel's processes is the kernel's.
_SEVERITY = ("none", "running", "locked", "checkpointed", "failed")


def tree_cuda_state(root: int) -> dict[str, Any] | None:
    """The CUDA state of the tree at ``root`` as the kernel's status shows it (the worst
    state of its processes, their GPU memory); None when there is no driver to ask."""
    driver = driver_status().driver
    if driver is None:
        return None
    states: dict[int, str] = {}
    for proc in procfs.tree(root):
        state = driver.state(proc.pid)
        if state is not None:
            states[proc.pid] = state.value
    if not states:
        return {"state": "none", "memory_bytes": 0}
    inventory = read_inventory()
    memory = {pid: inventory.bytes_of(pid) if inventory is not None else 0 for pid in states}
    return {
        "state": max(states.values(), key=_SEVERITY.index),
        "memory_bytes": sum(memory.values()),
        "processes": [
            {"pid": pid, "state": state, "memory_bytes": memory[pid]}
            for pid, state in sorted(states.items())
        ],
    }


def wake_tree(
    root_pid: int, holders_base: Path, driver: Callable[[], DriverStatus] | None = None
) -> list[str]:
    """Bring back a kernel tree that a killed save left stopped or with its CUDA suspended;
    one line per process whose CUDA stays suspended.

    ``holders_base``: where the gpu tier's holders say which kernels they hold. ``driver``
    replaces the machine's CUDA driver (the tests' scripted one).
    """
    status = (driver or driver_status)()
    if status.driver is None:
        procfs.continue_tree(root_pid)
        return []
    sleep = GpuSleep(status.driver, holders_dir(holders_base), lock_timeout=10.0)
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


@dataclass
class Resumed:
    """What ``resume_tree`` did: the tree's pids woken, those whose CUDA runs again, the
    problems of the others, and why there was no CUDA to resume (no driver)."""

    pids: list[int]
    cuda_running: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    no_driver: str | None = None


def resume_tree(root_pid: int) -> Resumed:
    """Continue every process of the tree and unlock and restore the CUDA of each that has
    it suspended (``jupyter gpu-snapshot resume``, asked for by the user for one tree)."""
    pids = [p.pid for p in procfs.tree(root_pid)]
    procfs.continue_tree(root_pid)
    status = driver_status()
    if status.driver is None:
        return Resumed(pids, no_driver=status.problem or "no CUDA driver")
    cuda = CudaCheckpoint(status.driver)
    holders = cuda.holders(pids)
    problems = cuda.resume_all(holders)
    return Resumed(pids, [p.pid for p in holders], problems)
