"""Whether a kernel answers: a ``kernel_info_request`` on its control channel.

The control channel is served by its own thread in ipykernel, so a kernel busy with a long
cell answers too. Called by the engine after every keep-running save
(``SnapshotEngine(kernel_answers=...)``, wired by ``local_engine.make_engine``): a save reports
success only for a kernel that survived it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from queue import Empty
from typing import Any, cast

ASK_AGAIN_SECONDS = 2.0


async def reply_to(client: Any, asked: set[str], timeout: float) -> dict[str, Any] | None:
    """The first reply on ``client``'s control channel to one of the ``asked`` requests,
    within ``timeout`` seconds, or None."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply: dict[str, Any] = await client.control_channel.get_msg(timeout=left)
        except (Empty, asyncio.TimeoutError):
            return None
        if reply.get("parent_header", {}).get("msg_id") in asked:
            return reply
    return None


@contextlib.asynccontextmanager
async def control_client(connection_info: dict[str, Any]) -> AsyncIterator[Any]:
    """A started client of the control channel alone of the kernel at ``connection_info``,
    with a zmq context of its own; both closed on leaving."""
    import zmq.asyncio
    from jupyter_client.asynchronous.client import AsyncKernelClient
    from jupyter_client.connect import KernelConnectionInfo

    context = zmq.asyncio.Context()
    client = AsyncKernelClient(context=context)
    try:
        client.load_connection_info(cast("KernelConnectionInfo", connection_info))
        client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        yield client
    finally:
        client.stop_channels()
        context.destroy(linger=0)


async def kernel_answers(connection_info: dict[str, Any], timeout: float) -> bool:
    """True once the kernel at ``connection_info`` replied within ``timeout`` seconds."""
    async with control_client(connection_info) as client:
        asked: set[str] = set()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            # Asked again every few seconds: a kernel that has only just started can leave
            # a request unanswered for good (seen under load: a kernel the server had
            # reported ready left one unanswered for 30 s), and asking costs one message.
            request = client.session.msg("kernel_info_request")
            client.control_channel.send(request)
            asked.add(request["header"]["msg_id"])
            if await reply_to(client, asked, min(left, ASK_AGAIN_SECONDS)) is not None:
                return True
        return False
