"""Whether a kernel answers: one ``kernel_info_request`` on its control channel.

The control channel is served by its own thread in ipykernel, so a kernel busy with a long
cell answers too. Called by the engine after every keep-running save
(``SnapshotEngine(kernel_answers=...)``, wired by ``engines.make_engine``): a save reports
success only for a kernel that survived it.
"""

from __future__ import annotations

import asyncio
import time
from queue import Empty
from typing import Any, cast


async def kernel_answers(connection_info: dict[str, Any], timeout: float) -> bool:
    """True once the kernel at ``connection_info`` replied within ``timeout`` seconds."""
    import zmq.asyncio
    from jupyter_client.asynchronous.client import AsyncKernelClient
    from jupyter_client.connect import KernelConnectionInfo

    context = zmq.asyncio.Context()
    client = AsyncKernelClient(context=context)
    try:
        client.load_connection_info(cast("KernelConnectionInfo", connection_info))
        client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        request = client.session.msg("kernel_info_request")
        client.control_channel.send(request)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await client.control_channel.get_msg(timeout=left)
            except (Empty, asyncio.TimeoutError):
                return False
            if reply.get("parent_header", {}).get("msg_id") == request["header"]["msg_id"]:
                return True
        return False
    finally:
        client.stop_channels()
        context.destroy(linger=0)
