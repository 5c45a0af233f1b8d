"""Progress of work over many bytes, as callers see it: ``progress(done, total)``."""

from __future__ import annotations

import threading
from collections.abc import Callable

ProgressFn = Callable[[int, int], None]


def byte_counter(progress: ProgressFn | None, total: int) -> Callable[[int], None]:
    """A step function for work of ``total`` bytes: each call adds its bytes and reports
    ``(done, total)`` to ``progress``.

    Called by the store's digests (commit, verify, trust) and by the remote store's upload
    and download, whose workers step it from several threads at once: the count is locked,
    the report is not (a reader may see two reports out of order, never a lost step).
    """
    lock = threading.Lock()
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            now = done
        if progress is not None:
            progress(now, total)

    return advance
