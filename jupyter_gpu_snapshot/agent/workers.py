"""The node agent's worker threads: a bounded share for each realm, and the agent's own.

Every blocking step of the agent runs in a worker thread: its own ``asyncio.to_thread``
calls and the engine's. A step that hangs on something a user controls (a file system that
never answers) holds its thread for good; were the threads one pool, a user could take
them all, and every other user's requests would wait behind theirs. So:

- each realm has a pool of its own of at most ``REALM_THREADS`` threads; the agent's own
  steps (who is calling, making a realm, recovering the stores at start) have another. The
  loop's default executor (``Router``) hands each step to the pool of the realm whose
  request runs it (``serve_realm``, a context variable that tasks and ``to_thread`` carry);
- a step waits for a thread of its pool at most ``WAIT_SECONDS``: past that it fails with
  a message saying that the user's earlier operations hold every thread of theirs, rather
  than wait behind them for good;
- the threads are daemon threads, never waited for: a step that hangs never holds the
  agent's stop (``server``).

The steps that touch what a user controls have deadlines of their own besides: opening
their files as them (``files.opener``), criu (``c.GPUSnapshot.criu_timeout``), asking
their kernel whether it answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.errors import Busy

T = TypeVar("T")

# Threads of one realm at once: a user's operations under way (``--max-operations``) each
# run one step at a time, their queries beside them.
REALM_THREADS = 4
# The agent's own steps, for every caller before their realm is known.
AGENT_THREADS = 8
# Seconds a step waits for a thread of its pool before it fails.
WAIT_SECONDS = 30.0


@dataclass
class _Step:
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Pool(Executor):
    """At most ``threads`` daemon threads, started as steps come; a step waits for one at
    most ``wait_seconds`` (``WAIT_SECONDS``), then fails with Busy naming ``owner``."""

    def __init__(self, owner: str, threads: int, wait_seconds: float = WAIT_SECONDS) -> None:
        self.owner = owner
        self.threads = threads
        self.wait_seconds = wait_seconds
        self._queue: collections.deque[_Step] = collections.deque()
        self._ready = threading.Condition()
        self._started = 0
        self._idle = 0
        self._busy_since: dict[int, float] = {}  # thread ident -> when its step started

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        step = _Step(Future(), fn, args, kwargs)
        with self._ready:
            self._queue.append(step)
            if not self._idle and self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name=f"agent-{self.owner}", daemon=True
                                 ).start()
            self._ready.notify()
        self._expire_later(step)
        return step.future

    def _expire_later(self, step: _Step) -> None:
        """Fail ``step`` if no thread has taken it within ``wait_seconds``: timed on the
        event loop that asked for it (the agent's steps are all asked from there)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(self.wait_seconds, self._expire, step)

    def _expire(self, step: _Step) -> None:
        with self._ready:
            try:
                self._queue.remove(step)
            except ValueError:
                return  # taken by a thread meanwhile
            held = len(self._busy_since)
            longest = max((time.monotonic() - t for t in self._busy_since.values()),
                          default=0.0)
        if step.future.set_running_or_notify_cancel():
            step.future.set_exception(Busy(
                "agent", f"no worker of the node agent was free for {self.owner} within "
                f"{self.wait_seconds:.0f} s: {held} of {self.threads} are still busy with "
                f"earlier work (the longest for {longest:.0f} s)",
                hint="is a file system of your kernel's files hung (NFS, FUSE)? Your "
                "operations go on once those steps end"))

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._ready:
                self._idle += 1
                while not self._queue:
                    self._ready.wait()
                self._idle -= 1
                step = self._queue.popleft()
                self._busy_since[me] = time.monotonic()
            try:
                if step.future.set_running_or_notify_cancel():
                    try:
                        result = step.fn(*step.args, **step.kwargs)
                    except BaseException as exc:
                        step.future.set_exception(exc)
                    else:
                        step.future.set_result(result)
            finally:
                with self._ready:
                    del self._busy_since[me]

    def busy(self) -> int:
        """Threads running a step now."""
        with self._ready:
            return len(self._busy_since)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing is waited for (the threads are daemons); steps not started are
        cancelled."""
        with self._ready:
            waiting, self._queue = list(self._queue), collections.deque()
        for step in waiting:
            step.future.cancel()


_realm_pool: contextvars.ContextVar[Pool | None] = contextvars.ContextVar(
    "agent_realm_pool", default=None)


@contextlib.contextmanager
def serve_realm(pool: Pool) -> Iterator[None]:
    """Run the steps of the current task (and of the tasks and threads it starts) in
    ``pool``, a realm's."""
    token = _realm_pool.set(pool)
    try:
        yield
    finally:
        _realm_pool.reset(token)


class Router(ThreadPoolExecutor):
    """The event loop's default executor in the agent: each step goes to the pool of the
    realm it is run for (``serve_realm``), else to the agent's own. A ThreadPoolExecutor by
    type only, as asyncio wants of a default executor: it starts no thread of its own."""

    def __init__(self, own: Pool | None = None) -> None:
        super().__init__(max_workers=1, thread_name_prefix="agent-unused")
        self.own = own or Pool("the agent itself", AGENT_THREADS)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        pool = _realm_pool.get() or self.own
        return pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.own.shutdown(wait=False)


__all__ = ["AGENT_THREADS", "REALM_THREADS", "WAIT_SECONDS", "Pool", "Router",
           "serve_realm"]
