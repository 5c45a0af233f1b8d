"""Long disk and CPU work (checksums of gigabytes) that must not starve the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Niceness of background threads: the event loop thread (nice 0) wins every contended core.
BACKGROUND_NICE = 10


def _lower_priority() -> None:
    # Linux schedules threads one by one, and threads this one starts inherit its nice.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


async def run_in_background(fn: Callable[..., T], *args: object) -> T:
    """``asyncio.to_thread`` for heavy work, in a thread of its own at a lower priority.

    A fresh thread, because the priority of a pooled thread could not be raised again
    without privileges.
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpu-snapshot-bg", initializer=_lower_priority)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args))
    finally:
        pool.shutdown(wait=False)
