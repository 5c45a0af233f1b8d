"""The portable copy asked of this kernel on its control channel, written while no user code
runs.

``gpu_snapshot_portable_request`` (content ``{"directory": str, "wait_seconds"?: number}``)
writes a portable copy (``portable``) into that existing directory and is answered, once
written, by ``gpu_snapshot_portable_reply``: ``{"status": "ok", "portable": REPORT}``
(``portable.write_portable``'s report) or ``{"status": "error", "ename", "evalue"}``.
``install(shell)`` sets it up, once, at start (``cell_record.install`` calls it).

Holding still
-------------
A copy must not mix objects from two moments, so it is written while no user code runs:

- If a cell is running when the request comes, the copy waits until it ends (at most
  ``wait_seconds`` when given; then the reply is an error, ``ename`` ``CellStillRunning``).
- While the copy is written, the next cell waits for it before it starts (it says so on
  its stderr if that takes more than a second). Interrupting that waiting cell abandons
  the copy (its reply is an error, ``PortableCopyAbandoned``) and the cell runs.
- The exception is a cell that only waits on something outside: ``%gpu_snapshot save``
  waits for the server, which may ask for a copy meanwhile. Such code runs under
  ``parked()``; while a cell is parked a copy may be written, and leaving ``parked()``
  waits until that copy is finished, so the cell's next statement sees the same objects.

The copy is written in a thread of its own; the control channel stays free meanwhile
(interrupts and shutdowns are answered), and the reply comes when the copy is done. What
runs outside cells is not held: widget callbacks (comm messages) and the user's own
threads could still change objects while a copy is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._constants import PORTABLE_REPLY, PORTABLE_REQUEST
from .control_channel import error_content, send_reply
from .portable import PortableCopyAbandoned, write_portable

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

_NOTICE_AFTER_SECONDS = 1.0

T = TypeVar("T")


class CellStillRunning(Exception):
    """The cell that was running when a copy was asked for did not end in time."""


class _Gate:
    """Who may run: user code (cells) or a copy being written, never both.

    Cells are counted in ``pre_execute``/``post_execute`` (nested executions included); a
    copy waits for none to run, or for the running one to be parked; a cell about to start
    waits while a copy is written or waits its turn.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._parked = 0
        self._writing = False
        self._waiting_writers = 0
        self.abandoned = False

    def cell_starts(self) -> None:
        with self._cond:
            # A cell inside a running one never waits on a copy that waits for its outer
            # cell to end; only a cell starting from idle gives way to a waiting copy.
            self._wait_in_cell(lambda: not self._writing
                               and (self._running > 0 or self._waiting_writers == 0))
            self._running += 1

    def cell_ends(self) -> None:
        with self._cond:
            # An empty cell ends without having started: never count below zero.
            self._running = max(0, self._running - 1)
            self._cond.notify_all()

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        with self._cond:
            self._parked += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._parked -= 1
                self._wait_in_cell(lambda: not self._writing)

    def _wait_in_cell(self, ready: Callable[[], bool]) -> None:
        """Wait (holding the condition) in the shell's thread; an interrupt abandons the
        copy rather than letting user code run beside it."""
        told = False
        while not ready():
            try:
                self._cond.wait(_NOTICE_AFTER_SECONDS)
            except KeyboardInterrupt:
                self.abandoned = True
                continue
            if not told and not ready():
                told = True
                print("Waiting for a portable copy of this kernel's variables to be "
                      "written...", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def still(self, timeout: float | None = None) -> Iterator[None]:
        """Hold user code still for the block: wait until no cell runs (or it is parked)."""
        with self._cond:
            self._waiting_writers += 1
            try:
                ready = self._cond.wait_for(
                    lambda: not self._writing and (self._running == 0 or self._parked > 0),
                    timeout)
            finally:
                self._waiting_writers -= 1
                self._cond.notify_all()
            if not ready:
                raise CellStillRunning(
                    f"the running cell did not end within {timeout:g} s")
            self._writing = True
            self.abandoned = False
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


_GATE = _Gate()


def parked() -> contextlib.AbstractContextManager[None]:
    """A block of a running cell that only waits on something outside the kernel (the
    server), during which a portable copy may be written.

    Code inside must not touch the user's objects. Leaving the block waits until a copy
    that started meanwhile is finished. ``%gpu_snapshot save`` wraps its wait for the
    server in it::

        with portable_request.parked():
            job = client.wait(job, progress.update)
    """
    return _GATE.parked()


def hold_still(timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
    """Wait until no user code runs (or it is parked), and keep cells from starting for the
    block. For a thread other than the shell's; ``CellStillRunning`` after ``timeout``."""
    return _GATE.still(timeout)


def write_held(directory: Path, timeout: float | None = None) -> dict[str, Any]:
    """Write a portable copy of this kernel's namespace into ``directory``, holding user
    code still while it is written (``CellStillRunning`` if a cell runs past ``timeout``).

    From the shell's own thread (a magic inside a cell) the calling cell parks itself
    first: it is the code that would otherwise be waited for.
    """
    shell = _installed.shell if _installed is not None else _current_shell()
    if not directory.is_dir():  # said at once, not after waiting for a cell
        raise NotADirectoryError(f"no directory {directory}")
    in_shell = threading.current_thread() is threading.main_thread()
    with _GATE.parked() if in_shell else contextlib.nullcontext(), _GATE.still(timeout):
        return write_portable(shell.user_ns, directory, hidden=shell.user_ns_hidden,
                              should_stop=lambda: _GATE.abandoned)


def _current_shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("no IPython shell runs here")
    return shell


class PortableRequests:
    """Answers the portable request of one shell's kernel."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self._tasks: set[asyncio.Task[None]] = set()

    def handle(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """The control channel's handler (its thread)."""
        # Answered from a task: the control channel handles one message at a time and
        # must stay free for interrupts and shutdowns while the copy is written.
        task = asyncio.get_running_loop().create_task(self._portable(stream, ident, parent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _portable(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        request = parent.get("content") or {}
        try:
            directory = Path(str(request["directory"]))
            wait = request.get("wait_seconds")
            timeout = None if wait is None else float(wait)
            report = await in_thread(lambda: write_held(directory, timeout))
            content: dict[str, Any] = {"status": "ok", "portable": report}
        except PortableCopyAbandoned:
            content = {"status": "error", "ename": "PortableCopyAbandoned",
                       "evalue": "the kernel was interrupted while the copy was written"}
        except Exception as exc:
            content = error_content(exc)
        send_reply(self.shell, stream, PORTABLE_REPLY, content, parent, ident)


async def in_thread(work: Callable[[], T]) -> T:
    """``work()`` in a daemon thread: a copy still waiting for a cell must never keep the
    kernel's process from exiting (the default executor's threads would)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:
            error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: the kernel is ending
                loop.call_soon_threadsafe(settle, lambda: future.set_exception(error))
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, lambda: future.set_result(result))

    threading.Thread(target=run, name="portable-copy", daemon=True).start()
    return await future


_installed: PortableRequests | None = None


def install(shell: InteractiveShell) -> None:
    """Hold cells still while a copy is written, and answer the portable request on this
    shell's control channel; again: nothing more. Called by ``cell_record.install``."""
    global _installed
    if _installed is not None and _installed.shell is shell:
        return
    requests = PortableRequests(shell)
    # Cells are counted in pre_execute/post_execute, nested executions included.
    shell.events.register("pre_execute", _GATE.cell_starts)
    shell.events.register("post_execute", _GATE.cell_ends)
    handlers = getattr(getattr(shell, "kernel", None), "control_handlers", None)
    if isinstance(handlers, dict):
        handlers[PORTABLE_REQUEST] = requests.handle
    _installed = requests
