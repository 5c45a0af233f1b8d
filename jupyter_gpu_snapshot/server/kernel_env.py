"""Telling a restored kernel which server and kernel slot it now belongs to."""

from __future__ import annotations

import logging
from typing import Any

from jupyter_client.session import new_id
from jupyter_core.utils import ensure_async

NOTICES_MODULE = "jupyter_gpu_snapshot.kernel.notices"
IDENTITY_MODULE = "jupyter_gpu_snapshot.kernel.identity"
# How long the message telling a restored kernel its new slot waits for a reply; the
# kernel runs it after a running cell even when nobody waits any more.
ENV_REFRESH_SECONDS = 10.0


def shell_client(km: Any) -> Any:
    """A started client of the kernel's shell channel alone, for the server's own silent
    requests; the caller stops its channels.

    Each has a session id of its own. A client takes its socket's routing id from its
    session, and ``km.client()`` would share the kernel manager's: ipykernel's shell socket
    hands a routing id over to its newest connection, so a second client connecting (the
    autosave's probe of a new kernel, while a restored kernel is told its slot) would drop
    the first one's unread request and receive its reply.
    """
    session = km.session.clone()
    session.session = new_id()
    client = km.client(session=session)
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    return client


async def refresh_kernel_env(
    km: Any, env: dict[str, str], log: logging.Logger, notice: str = ""
) -> bool:
    """Update ``os.environ`` inside a running kernel with a silent execute request.

    Called by ``KernelSlots.put_restored`` once the kernel manager has adopted a restored
    kernel: its environment still names the slot and server it was saved from. Silent
    requests leave no history, no output and no execution count. A kernel busy with a cell
    runs it after the cell; we stop waiting for the reply after ``ENV_REFRESH_SECONDS``.
    ``notice`` (e.g. that the kernel now runs on other GPUs) is printed by the kernel at
    the start of its next cell (``kernel.notices``): the first thing its user reads there.
    Returns whether the kernel confirmed; failures are logged, never raised.
    """
    try:
        client = shell_client(km)
    except Exception as exc:
        log.warning("gpu-snapshot: could not tell the restored kernel its new environment: %s", exc)
        return False
    try:
        code = f"__import__('os').environ.update({env!r})"
        # Marks this incarnation as told: a kernel woken in its own slot keeps its id.
        code += (f"\ntry:\n    __import__({IDENTITY_MODULE!r}, fromlist=['_']).slot_told()"
                 "\nexcept ImportError:\n    pass")
        if notice:
            notices = f"__import__({NOTICES_MODULE!r}, fromlist=['_'])"
            code += f"\n{notices}.show_at_next_cell({notice!r})"
        reply = await ensure_async(
            client.execute(
                code, silent=True, store_history=False, reply=True, timeout=ENV_REFRESH_SECONDS
            )
        )
        return bool(reply["content"].get("status") == "ok")
    except TimeoutError:
        log.info("gpu-snapshot: the restored kernel has not yet taken its new environment (busy)")
        return False
    finally:
        client.stop_channels()
