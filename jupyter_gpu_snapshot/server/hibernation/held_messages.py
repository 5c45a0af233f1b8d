"""What clients send a kernel while it sleeps: held here, answered, then delivered in order.

From the moment a hibernation starts until the kernel is awake again, every message a
client sends over the websocket is held here, per kernel, in arrival order
(``HibernationAwareConnection`` hands them in). A message that needs the kernel (a cell, a
comm message, a completion: anything but a kernel_info request, answered from what the
kernel said before, and the requests a reconnecting client makes by itself) starts the
wake; a message that arrives while the hibernation's save still runs waits for it, and
wakes the kernel right after. Once the kernel is awake, each held client re-joins the
kernel's channels, and the held messages go out once, in order. A wake that fails answers
each held cell with the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from ..._constants import format_bytes
from ..sleepers import (
    GPU_TIER,
    HIBERNATED,
    HIBERNATING,
    PROCESS_TIER,
    HeldClient,
    HeldMessage,
    Sleepers,
    SleepingKernel,
)
from ..wake_notes import WAKE_NOTE

# Requests a client makes by itself when it (re)connects: held until the kernel wakes,
# but they do not wake it. A kernel_info request is answered from the kernel's own
# earlier answer.
PASSIVE_REQUESTS = frozenset({"comm_info_request", "history_request"})


class HeldMessages:
    """The clients of each kernel, and the messages held while it sleeps; made by
    ``Hibernation``, which hands it ``wake`` (start the wake of a hibernated kernel)."""

    def __init__(self, sleepers: Sleepers, wake: Callable[[SleepingKernel], None]) -> None:
        self.sleepers = sleepers
        self._wake = wake
        # Every client connection of each kernel: a restored kernel's output reaches one
        # only once its subscription has re-joined, held message or not.
        self._clients: dict[str, weakref.WeakSet[HeldClient]] = {}

    def opened(self, client: HeldClient) -> None:
        """Called by every websocket connection that opens on a kernel."""
        self._clients.setdefault(client.kernel_id, weakref.WeakSet()).add(client)

    def connected(self, client: HeldClient) -> None:
        """Called by a websocket connection that opens while the kernel hibernates."""
        self.opened(client)
        sleeper = self.sleepers.kernels.get(client.kernel_id)
        if sleeper is not None:
            sleeper.joined.append(client)

    def forget(self, kernel_id: str) -> None:
        self._clients.pop(kernel_id, None)

    def receive(self, client: HeldClient, raw: Any, channel: str, header: dict[str, Any]) -> bool:
        """Called by the websocket connection for each message a client sends; True when
        hibernation took it (held or answered), False when it goes to the kernel as usual."""
        sleeper = self.sleepers.kernels.get(client.kernel_id)
        if sleeper is None:
            return False
        kind = str(header.get("msg_type") or "")
        if kind == "kernel_info_request":
            info = client.kernel_info()
            if info:
                client.answer(channel, "kernel_info_reply", info, header)
                return True
        sleeper.held.append(HeldMessage(client, raw, channel, header))
        if kind in PASSIVE_REQUESTS:
            return True
        if kind == "execute_request":
            # A client whose websocket is closing cannot be told; the wake goes on.
            with contextlib.suppress(Exception):
                self.show_waking(client, header, sleeper)
        if sleeper.state == HIBERNATED:
            self._wake(sleeper)
        elif sleeper.state == HIBERNATING:
            sleeper.wake_when_saved = True
        return True

    def show_waking(self, client: HeldClient, parent: dict[str, Any], sleeper: SleepingKernel,
                    text: str | None = None, update: bool = False) -> None:
        """A line in the held cell's output saying that the kernel wakes, and how far."""
        content = {
            "data": {"text/plain": text or f"Waking the kernel ({waking_moves(sleeper)})…"},
            "metadata": WAKE_NOTE,  # a notebook saved meanwhile leaves it out
            "transient": {"display_id": f"gpu-snapshot-wake-{parent.get('msg_id')}"},
        }
        if not update:
            client.answer("iopub", "status", {"execution_state": "busy"}, parent)
        client.answer("iopub", "update_display_data" if update else "display_data", content,
                      parent)

    def show_progress(self, sleeper: SleepingKernel, text: str) -> None:
        """How far the wake is, in each held cell's line."""
        for held in list(sleeper.held):
            if held.header.get("msg_type") == "execute_request":
                with contextlib.suppress(Exception):
                    self.show_waking(held.client, held.header, sleeper, text, update=True)

    def release(self, sleeper: SleepingKernel) -> None:
        """The kernel did not hibernate and runs on: what its clients sent goes to it."""
        self.sleepers.kernels.pop(sleeper.kernel_id, None)
        held, sleeper.held = sleeper.held, []
        for message in held:
            message.client.deliver(message.raw)

    async def deliver(self, sleeper: SleepingKernel) -> None:
        """The kernel is awake: its clients re-join it, and what they sent goes to it, once
        and in order; the kernel is no longer asleep."""
        kernel_id = sleeper.kernel_id
        every = [*(h.client for h in sleeper.held), *sleeper.joined,
                 *self._clients.get(kernel_id, ())]
        clients = list({id(c): c for c in every}.values())
        # Each client's subscription to the kernel's output must be live again before its
        # held requests go out, or the first outputs would be lost.
        await asyncio.gather(*(c.rejoin() for c in clients), return_exceptions=True)
        # From here on, nothing awaits: messages arriving meanwhile are held until this
        # loop step hands them all out, in order, and later ones go straight to the kernel.
        self.sleepers.kernels.pop(kernel_id, None)
        for held in sleeper.held:
            if held.header.get("msg_type") == "execute_request":
                # The note goes before the cell's own outputs come: a wake leaves nothing in
                # the notebook file (the server's log and events say how long it took).
                with contextlib.suppress(Exception):
                    held.client.answer("iopub", "clear_output", {"wait": False}, held.header)
            held.client.deliver(held.raw)

    def refuse(self, sleeper: SleepingKernel, error: dict[str, Any]) -> None:
        """The kernel could not wake: each held cell is answered with the cause; other held
        requests get no answer (a client gives up on them by itself)."""
        unanswered, sleeper.held = sleeper.held, []
        for message in unanswered:
            _refuse(message, sleeper, error)


def _refuse(held: HeldMessage, sleeper: SleepingKernel, error: dict[str, Any]) -> None:
    if held.header.get("msg_type") != "execute_request":
        return
    source = (f"from its hibernation snapshot {sleeper.snapshot_id}"
              if sleeper.tier == PROCESS_TIER else "from host memory")
    kept = ("The snapshot is kept: run the cell again to retry, or restore it from the "
            "snapshot list." if sleeper.tier == PROCESS_TIER else
            "It sleeps on with nothing lost: run the cell again to retry.")
    text = (
        f"The kernel could not wake {source} "
        f"(step {error.get('step', 'wake')}): {error.get('message')}. "
        + (f"{error['hint']}. " if error.get("hint") else "")
        + kept
    )
    content = {"ename": "KernelWakeError", "evalue": text, "traceback": [text]}
    with contextlib.suppress(Exception):
        held.client.answer("iopub", "error", content, held.header)
        held.client.answer(held.channel, "execute_reply",
                           {"status": "error", "execution_count": None, **content},
                           held.header)
        held.client.answer("iopub", "status", {"execution_state": "idle"}, held.header)


def waking_moves(sleeper: SleepingKernel) -> str:
    """What a wake moves, in words that fit its tier."""
    if sleeper.tier == GPU_TIER:
        return f"bringing back {format_bytes(sleeper.gpu_bytes)} of GPU memory"
    return f"restoring {format_bytes(sleeper.host_bytes + sleeper.gpu_bytes)}"
