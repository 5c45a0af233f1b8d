"""``GET kernels/{kernel_id}/status``: can the kernel be saved, and what is its state."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any

from ..core import procfs
from ..core.errors import SnapshotError

if TYPE_CHECKING:
    from .service import SnapshotService


async def kernel_status(service: SnapshotService, kernel_id: str) -> dict[str, Any]:
    """The status object of the API (openapi.yaml, KernelStatus)."""
    km = service.kernel(kernel_id)
    root = service.root_pid(km)
    reasons: list[str] = []
    if root is None:
        reasons.append("the kernel has no running process")
    else:
        try:
            found = await asyncio.to_thread(procfs.inspect_kernel, root)
            reasons.extend(found.problems)
        except SnapshotError as exc:
            reasons.append(exc.cause)
    try:
        await asyncio.to_thread(service.engine.criu.require_version)
    except SnapshotError as exc:
        reasons.append(exc.cause)
    notebook = await service.notebook_path(kernel_id)
    mine = [
        s for s in service.engine.list()
        if (s.manifest.get("kernel") or {}).get("kernel_id") == kernel_id
        or (notebook is not None and s.notebook_path == notebook)
    ]
    job = service.running_job(kernel_id)
    return {
        "kernel_id": kernel_id,
        "ready": not reasons,
        "reasons": reasons,
        "kernel_name": km.kernel_name,
        "notebook_path": notebook,
        "cuda": await cuda_status(service, root),
        "last_snapshot": mine[-1].summary() if mine else None,
        "job": job.to_dict() if job else None,
    }


async def cuda_status(service: SnapshotService, root: int | None) -> dict[str, Any] | None:
    """The kernel's CUDA state; None when nobody can tell.

    An engine hook may offer ``kernel_status(root_pid) -> dict | None`` (sync or async).
    Otherwise: a kernel that has not loaded libcuda has no CUDA state, and for one that
    has, the driver's checkpoint API and NVML are asked.
    """
    if root is None:
        return None
    for hook in service.engine.hooks:
        probe = getattr(hook, "kernel_status", None)
        if probe is None:
            continue
        answer = probe(root)
        if inspect.isawaitable(answer):
            answer = await answer
        if answer is not None:
            return dict(answer)
    if not await asyncio.to_thread(_tree_maps_libcuda, root):
        return {"state": "none", "memory_bytes": 0}
    try:
        return await asyncio.to_thread(_ask_the_driver, root)
    except Exception as exc:  # a status query must not fail on a driver problem
        service.log.info("gpu-snapshot: cannot read the CUDA state of %s: %s", root, exc)
        return None


# The worst state of the kernel's processes is the kernel's.
_SEVERITY = ("none", "running", "locked", "checkpointed", "failed")


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    from ..gpu.driver import load_driver

    return load_driver().driver


def _ask_the_driver(root: int) -> dict[str, Any] | None:
    from ..gpu.inventory import read_inventory

    driver = _driver()
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
    memory = {
        pid: inventory.bytes_of(pid) if inventory is not None else 0 for pid in states
    }
    return {
        "state": max(states.values(), key=_SEVERITY.index),
        "memory_bytes": sum(memory.values()),
        "processes": [
            {"pid": pid, "state": state, "memory_bytes": memory[pid]}
            for pid, state in sorted(states.items())
        ],
    }


def _tree_maps_libcuda(root: int) -> bool:
    """Whether any process of the tree has libcuda mapped (it used the CUDA driver)."""
    try:
        procs = procfs.tree(root)
    except Exception:  # a vanished tree maps nothing
        return False
    for proc in procs:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as f:
            if any("libcuda.so" in line for line in f):
                return True
    return False
