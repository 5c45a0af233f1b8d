"""Ctrl-C during a command that runs an engine sequence: the sequence stops at a safe point
and rolls back; the command then ends with ``Interrupted``."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """Ctrl-C reached a save or restore, which stopped at a safe point and rolled back."""


def run_interruptibly(work: Coroutine[Any, Any, T]) -> T:
    """Run an engine coroutine; the first Ctrl-C asks it to stop safely, later ones wait.

    criu runs in its own session and does not see the Ctrl-C; the engine waits for it,
    then rolls back in order. A raw KeyboardInterrupt would tear the event loop down in
    the middle of that rollback.
    """
    import asyncio
    import signal

    async def supervise() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(work)
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            raise Interrupted() from None
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    return asyncio.run(supervise())
