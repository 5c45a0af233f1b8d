"""Callbacks that hold the server's event loop, found so that a busy machine cannot fake one.

A callback's wall-clock time grows when other processes take the CPU: its thread then
waits in the Linux run queue, and Linux counts that wait per thread (the second field of
``/proc/thread-self/schedstat``). Wall time minus that wait is what the callback itself
held the loop for: its own CPU time plus any time it slept in a blocking call (a file
read, a subprocess or psutil wait, a lock, ``time.sleep``). Load does not change it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


@dataclass(frozen=True)
class HeldLoop:
    """One callback that held the loop: what it was, its own time and its wall time."""

    callback: str
    held_s: float
    wall_s: float


class LoopWatch:
    """Within ``with``, keeps every callback of ``loop`` that held it ``limit`` seconds or
    more (``held``), and the longest own time of any callback (``longest_s``).

    Entered from a coroutine on ``loop``: the watch reads that thread's scheduler counters.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: float) -> None:
        self.loop = loop
        self.limit = limit
        self.held: list[HeldLoop] = []
        self.callbacks = 0
        self.longest_s = 0.0
        self._fd = -1
        self._watching = False
        self._original: Any = None

    def _run_queue_wait(self) -> float:
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[1]) / 1e9

    def __enter__(self) -> LoopWatch:
        assert asyncio.get_running_loop() is self.loop, "enter the watch on the watched loop"
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        self._run_queue_wait()  # fails here, not in a callback, where schedstat is missing
        self._watching = True
        loop_thread = threading.get_ident()
        original = self._original = asyncio.events.Handle._run
        watch = self

        def run(handle: asyncio.Handle) -> None:
            if getattr(handle, "_loop", None) is not watch.loop:
                return original(handle)  # type: ignore[no-any-return]
            assert threading.get_ident() == loop_thread
            wall_start, wait_start = time.perf_counter(), watch._run_queue_wait()
            try:
                return original(handle)  # type: ignore[no-any-return]
            finally:
                wall = time.perf_counter() - wall_start
                held = wall - (watch._run_queue_wait() - wait_start)
                watch.callbacks += 1
                watch.longest_s = max(watch.longest_s, held)
                if held >= watch.limit:
                    watch.held.append(HeldLoop(describe(handle), round(held, 3), round(wall, 3)))
                if not watch._watching:  # the callback that left the ``with`` block
                    os.close(watch._fd)

        asyncio.events.Handle._run = run  # type: ignore[method-assign]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        # The callback running this still measures itself, and then closes the file.
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign]
        self._watching = False


def describe(handle: asyncio.Handle) -> str:
    """The handle, and for a task's step the coroutine and where it stopped next."""
    owner = getattr(getattr(handle, "_callback", None), "__self__", None)
    if not isinstance(owner, asyncio.Task):
        return repr(handle)
    coro: Any = owner.get_coro()
    name, stops = getattr(coro, "__qualname__", repr(coro)), []
    # Where each coroutine of the task waits now: the code that held the loop came before.
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frame = coro.cr_frame
        if os.path.dirname(frame.f_code.co_filename) != ASYNCIO_DIR:
            stops.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None)
    return f"task {name!r}" + (f" (now awaiting at {stops[-1]})" if stops else "")
