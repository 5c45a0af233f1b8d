"""The timeline's control requests, answered even while a cell runs (the control channel has
a thread of its own):

- ``gpu_snapshot_timeline_request`` (``{}``) → ``gpu_snapshot_timeline_reply``: the points,
  the counts that can be rewound to, the memory used and its limit (``Timeline.content``).
- ``gpu_snapshot_rewind_request`` (``{"before": N}``) → ``gpu_snapshot_rewind_reply``:
  ``{"status": "ok", "report": {...}}`` or an error whose ``ename`` is ``KernelBusy``,
  ``RewindOutOfRange`` or ``RewindFailed``.

Both are answered from a task, their work done in a thread, so that the control channel
stays free for interrupts and shutdowns. The rewind holds user code still the way a
portable copy does (``portable_request.hold_still``): no cell may start while the
namespace is written, and a cell running already makes it refuse at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..._constants import REWIND_REPLY, TIMELINE_REPLY
from .. import portable_request
from ..control_channel import send_reply
from .limits import TIMELINE_OFF
from .timeline import BUSY, KernelBusy, RewindFailed, RewindOutOfRange, Timeline

KNOWN_ERRORS = (KernelBusy, RewindOutOfRange, RewindFailed)


def rewind_held(timeline: Timeline, before: int) -> dict[str, Any]:
    """Rewind from a thread other than the shell's, user code held still meanwhile."""
    try:
        with portable_request.hold_still(timeout=0):
            return timeline.rewind(before)
    except portable_request.CellStillRunning:  # only entering can raise it
        raise KernelBusy(BUSY) from None


class TimelineRequests:
    """Answers one timeline's control requests."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._tasks: set[asyncio.Task[None]] = set()

    def timeline_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._answer(stream, ident, parent, TIMELINE_REPLY, self.timeline.content)

    def rewind_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        request = parent.get("content") or {}
        before = request.get("before")

        def rewind() -> dict[str, Any]:
            if isinstance(before, bool) or not isinstance(before, int):
                raise RewindOutOfRange(f"'before' must be a cell's execution count (an "
                                       f"integer), not {before!r}")
            return {"status": "ok", "report": rewind_held(self.timeline, before)}

        self._answer(stream, ident, parent, REWIND_REPLY, rewind)

    def _answer(self, stream: Any, ident: Any, parent: dict[str, Any], reply_type: str,
                work: Callable[[], dict[str, Any]]) -> None:
        async def answer() -> None:
            try:
                content = await portable_request.in_thread(work)
            except KNOWN_ERRORS as exc:
                content = error_reply(exc)
            except Exception as exc:
                content = error_reply(RewindFailed(f"{type(exc).__name__}: {exc}"))
            send_reply(self.timeline.shell, stream, reply_type, content, parent, ident)

        task = asyncio.get_running_loop().create_task(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# The timeline of a kernel that keeps none: nothing to rewind to, and "on" false.
OFF_TIMELINE: dict[str, Any] = {"status": "ok", "on": False, "running": False, "points": [],
                                "rewindable": [], "bytes": 0, "limit_bytes": 0, "dropped": 0}


def answer_off(shell: Any, reply_type: str) -> Callable[[Any, Any, dict[str, Any]], None]:
    """The handler of a kernel that keeps no timeline: its timeline says it is off, and a
    rewind is refused with how to turn it on, rather than leaving the asker to wait for a
    reply that never comes."""
    content = OFF_TIMELINE if reply_type == TIMELINE_REPLY else {
        "status": "error", "ename": "TimelineOff", "traceback": [], "evalue": TIMELINE_OFF}

    def handle(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        send_reply(shell, stream, reply_type, content, parent, ident)

    return handle


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
            "traceback": []}
