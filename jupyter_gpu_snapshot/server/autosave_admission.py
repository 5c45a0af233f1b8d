"""Whether the disk and the host's memory can take an autosave of a kernel now.

An autosave is refused (and the scheduler says why, and tries again an interval later) when
the kernel is not snapshot-ready, when the store's disk would keep less than
``autosave_min_free_bytes`` free or the autosaves would pass ``autosave_max_bytes``
(``core/store/retention.py``: what the next autosave's retention frees counts), and when
the host has less RAM available than the kernel's GPU memory, which the driver stages there
during the save. What it needs of the store and the service is handed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

from .._constants import format_bytes
from ..config import GPUSnapshot
from ..core import procfs
from ..core.store import (
    DiskRoom,
    autosave_bytes,
    autosave_refusal,
    group_of,
    reclaimed_by_next_autosave,
)
from ..launch.provisioner import root_pid

# Where the store is and the free bytes of its disk (``SnapshotService.store_usage``: the
# node agent's store through the agent).
StoreRoom = Callable[[], Awaitable[dict[str, Any]]]
# The store's snapshots, as the API lists them (``SnapshotService.list_snapshots``).
ListSnapshots = Callable[[], Awaitable[list[dict[str, Any]]]]
# The CUDA state of a kernel tree by its root pid (``SnapshotService.cuda_state``).
CudaState = Callable[[int | None], Awaitable[dict[str, Any] | None]]


class AutosaveAdmission:
    """Made by the autosave scheduler; asked before each autosave."""

    def __init__(
        self,
        settings: GPUSnapshot,
        store_room: StoreRoom,
        list_snapshots: ListSnapshots,
        cuda_state: CudaState,
    ) -> None:
        self.settings = settings
        self.store_room = store_room
        self.list_snapshots = list_snapshots
        self.cuda_state = cuda_state

    async def refusal(self, kernel_id: str, km: Any, notebook: str | None) -> str | None:
        """Why the disk or the host RAM cannot take an autosave now, or None."""
        root = root_pid(km)
        if root is None:
            return "the kernel has no running process"
        try:
            found = await asyncio.to_thread(procfs.inspect_kernel, root)
            host = await asyncio.to_thread(procfs.tree_rss, root)
        except Exception as exc:  # the kernel exited meanwhile
            return f"cannot read the kernel's processes: {exc}"
        if found.problems:
            return "it is not snapshot-ready: " + "; ".join(found.problems)
        cuda = await self.cuda_state(root)
        gpu = int((cuda or {}).get("memory_bytes") or 0)
        summaries = await self.list_snapshots()
        store = await self.store_room()
        if store["free_bytes"] is None:
            return f"the free space of the store ({store['path']}) cannot be read"
        group = group_of(
            {"notebook_path": notebook, "kernel": {"kernel_id": kernel_id}}
        )
        room = DiskRoom(
            free_bytes=int(store["free_bytes"]),
            autosave_bytes=autosave_bytes(summaries),
            reclaimed_bytes=reclaimed_by_next_autosave(
                summaries, group, int(self.settings.autosave_keep)
            ),
            where=str(store["path"]),
        )
        refusal = autosave_refusal(
            host + gpu, room, int(self.settings.autosave_min_free_bytes),
            int(self.settings.autosave_max_bytes),
        )
        if refusal is None and gpu:
            # The driver stages the GPU memory in host RAM during the save.
            available = (await asyncio.to_thread(psutil.virtual_memory)).available
            if available < gpu:
                refusal = (
                    f"the host has {format_bytes(available)} of RAM available, the kernel's "
                    f"GPU memory needs {format_bytes(gpu)} of it"
                )
        return refusal
