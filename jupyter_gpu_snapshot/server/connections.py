"""The kernels' websocket connections, as hibernation needs them.

jupyter_server's ``ZMQChannelsWebsocketConnection`` passes each client message straight to
the kernel's ZMQ sockets. This subclass first offers it to ``Hibernation.receive``, which
holds the messages of a hibernating or hibernated kernel (and wakes it) until the kernel
is awake again, then hands them back through ``deliver``. A client that connects to a
hibernated kernel is not made to wait for a kernel that is not there: its kernel_info
comes from the kernel's earlier answer, and its channels re-join the kernel when it wakes
(``rejoin``). The extension installs the class as ``ServerApp.kernel_websocket_connection_class``
unless the operator chose another one, and leaves its ``Hibernation`` in the web
application's settings (``HIBERNATION_SETTING``), which every handler reads, the kernel
websocket handler that makes these connections too.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, cast

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from .jupyter_server_internals import cached_kernel_info, finish_kernel_info, register_session

if TYPE_CHECKING:
    from .hibernation import Hibernation

WS_V1 = "v1.kernel.websocket.jupyter.org"
# The web application's setting that holds the server's ``Hibernation``
# (``GPUSnapshotApp.initialize_settings`` puts it there).
HIBERNATION_SETTING = "jupyter_gpu_snapshot_hibernation"


# How long a client re-joining a woken kernel waits for the server to read it idle.
REJOIN_IDLE_SECONDS = 10.0
REJOIN_POLL_SECONDS = 0.05


class HibernationAwareConnection(ZMQChannelsWebsocketConnection):
    """A kernel websocket whose messages wait while the kernel hibernates."""

    @property
    def hibernation(self) -> Hibernation | None:
        """The server's hibernation; None where the extension did not load (plain
        jupyter_server behaviour)."""
        return cast("Hibernation | None",
                    self.websocket_handler.settings.get(HIBERNATION_SETTING))

    def _hibernating(self) -> bool:
        hibernation = self.hibernation
        return hibernation is not None and hibernation.sleepers.state(self.kernel_id) is not None

    # -- connecting to a kernel that is not there ------------------------------------------
    async def prepare(self) -> None:
        hibernation = self.hibernation
        if hibernation is None or hibernation.sleepers.state(self.kernel_id) is None:
            await super().prepare()  # type: ignore[no-untyped-call]
            if hibernation is not None:
                hibernation.opened(self)
            return
        await register_session(self)
        self.session.key = self.kernel_manager.session.key
        hibernation.connected(self)
        finish_kernel_info(self, self.kernel_info() or {})

    def nudge(self) -> asyncio.Future[None]:
        if not self._hibernating():
            return super().nudge()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def rejoin(self) -> None:
        """Called once the kernel is awake: wait until this client's IOPub subscription
        reaches the woken kernel (jupyter_server's nudge), then read its channels again."""
        if not self.channels:
            return
        # jupyter_server skips its nudge for a kernel it reads as busy, and the message that
        # told the woken kernel its slot leaves it busy for a moment: the held cell's first
        # outputs were then sent before this client's subscription reached the kernel.
        # The server sets the state from the kernel's messages; there is nothing to await.
        for _ in range(int(REJOIN_IDLE_SECONDS / REJOIN_POLL_SECONDS)):
            if self.kernel_manager.execution_state != "busy":
                break
            await asyncio.sleep(REJOIN_POLL_SECONDS)
        await super().nudge()
        # The nudge took the IOPub stream's callback for itself and dropped it.
        for stream in self.channels.values():
            if not stream.closed():
                stream.on_recv_stream(self.handle_outgoing_message)

    def kernel_info(self) -> dict[str, Any] | None:
        """What the kernel answered to the server's kernel_info request before, if any."""
        return cached_kernel_info(self.kernel_manager)

    # -- messages ---------------------------------------------------------------------------
    def handle_incoming_message(self, incoming_msg: Any) -> None:
        hibernation = self.hibernation
        if hibernation is None or not self.channels:
            super().handle_incoming_message(incoming_msg)
            return
        channel, header = self._read_envelope(incoming_msg)
        if not hibernation.receive(self, incoming_msg, channel, header):
            super().handle_incoming_message(incoming_msg)

    def deliver(self, raw: Any) -> None:
        """Send a message that hibernation held to the kernel, as it would have gone."""
        super().handle_incoming_message(raw)

    def _read_envelope(self, incoming_msg: Any) -> tuple[str, dict[str, Any]]:
        """The channel and header of a client message, whichever websocket protocol."""
        try:
            if self.subprotocol == WS_V1:
                channel, msg_list = deserialize_msg_from_ws_v1(  # type: ignore[no-untyped-call]
                    incoming_msg)
                header = self.session.unpack(msg_list[0])
            else:
                msg = (
                    deserialize_binary_message(incoming_msg)  # type: ignore[no-untyped-call]
                    if isinstance(incoming_msg, bytes) else json.loads(incoming_msg)
                )
                channel, header = msg.get("channel"), msg.get("header")
        except Exception:  # the base class logs and drops what it cannot read
            return "shell", {}
        return str(channel or "shell"), dict(header or {})

    def answer(
        self, channel: str, msg_type: str, content: dict[str, Any], parent: dict[str, Any]
    ) -> None:
        """Send the client a message of the server's own, as if from the kernel."""
        msg = self.session.msg(msg_type, content, parent=parent)
        if self.subprotocol == WS_V1:
            packed = serialize_msg_to_ws_v1(  # type: ignore[no-untyped-call]
                msg, channel, self.session.pack)
            self.write_message(packed, binary=True)
        else:
            msg["channel"] = channel
            self.write_message(json.dumps(msg, default=json_default))
