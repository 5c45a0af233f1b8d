"""Every access of the extension to jupyter_server's and jupyter_client's private internals.

Checked against jupyter_server 2.21.1 and jupyter_client 8.10.0. An upgrade of either reads
this module first: each function names what it relies on, and nothing else in server/
touches an underscored attribute or method of their objects.

What is reached here:

- ``ServerApp._signal_stop``: the server's own SIGTERM handler (``stop_signal_handler``).
- ``ZMQChannelsWebsocketConnection._register_session`` and ``._finish_kernel_info``: a
  websocket connection opened on a hibernated kernel, without the kernel
  (``register_session``, ``finish_kernel_info``).
- ``ServerKernelManager._kernel_info_future``: the kernel's answer to the server's
  kernel_info request, cached by the connections (``cached_kernel_info``).
- ``MappingKernelManager._kernel_connections``: how many websockets each kernel has
  (``websocket_count``). The public ``kernel_model(id)["connections"]`` reads the same
  count, but raises for a kernel still starting (its ``last_activity`` is unset).
- ``MultiKernelManager._pending_kernels``: the starts still under way, where a failed
  start stays (``drop_pending_kernel``).

Not underscored, but read knowing how the server sets it:

- ``ServerKernelManager.last_activity``: a trait without a default, set once the kernel's
  start completed (``last_activity``).

Overrides, not accesses: documented extension hooks whose names are underscored, overridden
where they are, in ``app.GPUSnapshotApp``:

- ``ExtensionApp._link_jupyter_server_extension`` (it calls ``super()`` first);
- ``ExtensionApp._start_jupyter_server_extension``;
- ``ExtensionApp._config_file_name_default`` (a traitlets dynamic default).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from types import FrameType
from typing import Any

from jupyter_server.serverapp import ServerApp
from traitlets import TraitError

# A handler for ``signal.signal``.
SignalHandler = Callable[[int, FrameType | None], None]


def stop_signal_handler(serverapp: ServerApp) -> SignalHandler:
    """The handler the server installs for SIGTERM (``ServerApp._signal_stop``).

    It logs the signal and stops the server (``ServerApp.stop``), which stops the
    extensions (their ``stop_extension``) before it shuts the kernels down.
    """
    handler: SignalHandler = serverapp._signal_stop
    return handler


async def register_session(connection: Any) -> None:
    """Register a websocket connection's session, as ``prepare`` does before it waits
    for the kernel (``ZMQChannelsWebsocketConnection._register_session``): an older,
    stale connection of the same session is closed, and this one is the session's."""
    await connection._register_session()


def finish_kernel_info(connection: Any, info: dict[str, Any]) -> None:
    """Take ``info`` as the kernel's kernel_info reply on the connection, as if the
    kernel had answered (``ZMQChannelsWebsocketConnection._finish_kernel_info``): the
    protocol adaptation follows its version, and the connection may go on."""
    connection._finish_kernel_info(info)


def cached_kernel_info(km: Any) -> dict[str, Any] | None:
    """What the kernel answered to the server's kernel_info request before, if it did.

    The connections of a kernel share that request through the kernel manager's
    ``_kernel_info_future``, which holds the reply's content once the kernel answered.
    None while no answer came, and for one that is no kernel_info reply.
    """
    cached = getattr(km, "_kernel_info_future", None)
    if cached is None or not cached.done() or cached.cancelled() or cached.exception():
        return None
    info = cached.result()
    return dict(info) if isinstance(info, dict) and "protocol_version" in info else None


def websocket_count(kernel_manager: Any, kernel_id: str) -> int:
    """How many websocket connections the server holds open to the kernel now
    (``MappingKernelManager._kernel_connections``); 0 for a kernel it does not count."""
    connections = getattr(kernel_manager, "_kernel_connections", {})
    return int(connections.get(kernel_id, 0))


def drop_pending_kernel(kernel_manager: Any, kernel_id: str) -> None:
    """Forget a kernel's start that failed (``MultiKernelManager._pending_kernels``).

    jupyter_client keeps a failed start among its pending kernels, and ``shutdown_all``
    then fails on it (404) when the server stops.
    """
    pending = getattr(kernel_manager, "_pending_kernels", None)
    if isinstance(pending, dict):
        pending.pop(kernel_id, None)


def last_activity(km: Any) -> float | None:
    """The server's ``last_activity`` of a kernel (seconds since the epoch); None while it
    has none.

    jupyter_server sets the trait once the kernel has started, and moves it on every
    message of the kernel's IOPub channel; reading it before (a kernel listed while it
    starts) raises TraitError, not AttributeError.
    """
    try:
        stamp: datetime | None = km.last_activity
    except (AttributeError, TraitError):
        return None
    return stamp.timestamp() if stamp is not None else None
