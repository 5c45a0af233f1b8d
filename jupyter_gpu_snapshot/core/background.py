"""Long disk and CPU work (checksums of gigabytes) that must not starve the server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def run_in_background(fn: Callable[..., T], *args: object) -> T:
    """``asyncio.to_thread`` for heavy work, in a thread of its own.

    Its own thread, so that minutes of hashing never take a worker of the default
    executor, which every handler's file and psutil calls share. It keeps the loop's
    priority: a thread of lower priority that holds the GIL on a busy machine waits long
    for a core, and the event loop waits for the GIL behind it (0.15 to 0.34 s measured
    beside ``stress-ng --cpu 2`` on 2 cores, with nice 10). A pooled thread starts it:
    starting a thread waits until the new one runs, and the event loop must not wait.
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpu-snapshot-bg")
    try:
        started = await asyncio.to_thread(pool.submit, fn, *args)
        return await asyncio.wrap_future(started)
    finally:
        pool.shutdown(wait=False)
