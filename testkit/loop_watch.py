"""Callbacks that hold the server's event loop, found so that a busy machine cannot fake one.

A callback's wall-clock time grows for three reasons that are not its own:
- other processes take the CPU: its thread then waits in the Linux run queue, and Linux
  counts that wait per thread (the second field of ``/proc/thread-self/schedstat``);
- the hypervisor runs another guest on the virtual CPU: the guest's kernel counts that
  as steal time per CPU (``/proc/stat``), and as neither run time nor run-queue wait;
- the interpreter's cyclic garbage collector runs inside it, for the whole process;
- it starts a thread (a thread pool grows on first use), and ``Thread.start`` waits until
  the new thread has run: on a busy machine, until a CPU is free for it.

Wall time minus those is what the callback itself held the loop for: its own CPU time
plus any time it slept in a blocking call (a file read, a subprocess or psutil wait, a
lock, ``time.sleep``) or waited for the GIL while another thread of ours kept it. Load
does not change it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

ASYNCIO_DIR = os.path.dirname(asyncio.__file__)
# /proc/stat is read at most this often, and once more after a callback that looks long:
# the steal counted in a long callback may then include up to this much from before it.
STEAL_SAMPLE_SECONDS = 0.05


@dataclass(frozen=True)
class HeldLoop:
    """One callback that held the loop: what it was, its own time and its wall time."""

    callback: str
    held_s: float
    wall_s: float
    cpu_s: float  # of that wall time, on a CPU; the rest of held_s slept or waited for the GIL
    run_queue_s: float
    steal_s: float
    gc_s: float
    thread_start_s: float


def _total_steal() -> float:
    """Seconds of steal of the CPU that lost the most; the thread may have run on any."""
    with open("/proc/stat", "rb") as stat:
        lines = [line.split() for line in stat if line[:3] == b"cpu" and line[3:4].isdigit()]
    # Fields after the name: user nice system idle iowait irq softirq steal, in clock ticks.
    return max(int(fields[8]) for fields in lines) / os.sysconf("SC_CLK_TCK")


class _GcClock:
    """Seconds the cyclic garbage collector has run since it was installed."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._started


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
        self._gc = _GcClock()
        self._thread_starts = 0.0
        self._original_start: Any = None
        self._steal = 0.0
        self._steal_read_at = -STEAL_SAMPLE_SECONDS

    def _thread_times(self) -> tuple[float, float]:
        """This thread's seconds on a CPU and in the run queue."""
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9

    def _steal_before(self, now: float) -> float:
        if now - self._steal_read_at >= STEAL_SAMPLE_SECONDS:
            self._steal, self._steal_read_at = _total_steal(), now
        return self._steal

    def __enter__(self) -> LoopWatch:
        assert asyncio.get_running_loop() is self.loop, "enter the watch on the watched loop"
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        self._thread_times()  # fails here, not in a callback, where schedstat is missing
        _total_steal()
        gc.callbacks.append(self._gc)
        loop_thread = threading.get_ident()
        original_start = self._original_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            began = time.perf_counter()
            try:
                original_start(thread)
            finally:
                if threading.get_ident() == loop_thread:
                    self._thread_starts += time.perf_counter() - began

        threading.Thread.start = start  # type: ignore[method-assign,assignment]
        self._watching = True
        original = self._original = asyncio.events.Handle._run
        watch = self

        def run(handle: asyncio.Handle) -> None:
            if getattr(handle, "_loop", None) is not watch.loop:
                return original(handle)  # type: ignore[no-any-return]
            assert threading.get_ident() == loop_thread
            wall_start = time.perf_counter()
            steal_start = watch._steal_before(wall_start)
            cpu_start, wait_start = watch._thread_times()
            gc_start, starts_before = watch._gc.total, watch._thread_starts
            try:
                return original(handle)  # type: ignore[no-any-return]
            finally:
                wall = time.perf_counter() - wall_start
                cpu_end, wait_end = watch._thread_times()
                run_queue, in_gc = wait_end - wait_start, watch._gc.total - gc_start
                starting = watch._thread_starts - starts_before
                held = wall - run_queue - in_gc - starting
                steal = 0.0
                if held >= watch.limit:  # only then is /proc/stat read again
                    watch._steal_read_at = time.perf_counter()
                    watch._steal = _total_steal()
                    steal = watch._steal - steal_start
                    held -= steal
                watch.callbacks += 1
                watch.longest_s = max(watch.longest_s, held)
                if held >= watch.limit:
                    watch.held.append(HeldLoop(
                        describe(handle), round(held, 3), round(wall, 3),
                        round(cpu_end - cpu_start, 3), round(run_queue, 3), round(steal, 3),
                        round(in_gc, 3), round(starting, 3),
                    ))
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
        gc.callbacks.remove(self._gc)
        threading.Thread.start = self._original_start  # type: ignore[method-assign]
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
