"""A kernel the server is starting or adopting is listed without error: jupyter_server lists
it one event-loop step before it marks its activity, and ``/api/kernels`` or ``/api/status``
in between answered 500 (seen when a restarted server adopted kernels under load)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME


def test_a_starting_kernel_is_listed_at_every_step(tmp_path: Path) -> None:
    manager = AsyncMappingKernelManager(root_dir=str(tmp_path), connection_dir=str(tmp_path))

    async def start_while_listing() -> list[dict[str, object]]:
        started = asyncio.ensure_future(manager.start_kernel(kernel_name=KERNEL_NAME))
        listings = []
        try:
            while not started.done():  # one listing per turn of the loop
                listings.append(manager.list_kernels())
                await asyncio.sleep(0)
        finally:
            kernel_id = await started
            await manager.shutdown_kernel(kernel_id, now=True)
        return [k for listing in listings for k in listing if k["id"] == kernel_id]

    seen = asyncio.run(start_while_listing())
    assert seen, "the kernel was never listed while it started"
    assert all(k["last_activity"] for k in seen)
