"""What a save holds in the store from its preflight to its commit: the kernel, so that the
CLI and the server never dump one kernel at once, and the name the snapshot commits under,
so that no two snapshots share one.

A save asked for by name holds that name, once no snapshot has it. A save nobody named is
named from its notebook and the local time (``default_name``: ``demo-14.32``), then
``demo-14.32-2``, ``-3``... while one is taken by a snapshot or held by another save.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from .._constants import KERNEL_NAME
from . import locks, procfs
from .errors import Busy, InvalidRequest
from .hooks import SaveTarget
from .locks import HeldLock
from .store import SnapshotStore, default_name

# How many numbered default names one minute may give a notebook's saves.
DEFAULT_NAME_TRIES = 99


@contextlib.asynccontextmanager
async def claimed(
    store: SnapshotStore, kernel: procfs.KernelProcess, target: SaveTarget, name: str | None
) -> AsyncIterator[tuple[str, list[HeldLock]]]:
    """The name the save commits under, and the locks it holds until then (it may add its
    own): the kernel's, then the name's."""
    with contextlib.ExitStack() as held:
        claims = [held.enter_context(store.locks.hold(
            locks.kernel_key(kernel.root_pid), f"kernel pid {kernel.kernel_pid}",
            "preflight", note=f"save of kernel pid {kernel.kernel_pid}",
        ))]
        if name is not None:
            claims.append(held.enter_context(store.locks.hold(
                locks.name_key(name), f"the snapshot name {name!r}", "preflight",
                note=f"save as {name}",
            )))
            await _require_name_free(store, name)
            chosen = name
        else:
            chosen, lock = await asyncio.to_thread(_claim_default_name, store, target)
            claims.append(held.enter_context(lock))
        yield chosen, claims


def _claim_default_name(store: SnapshotStore, target: SaveTarget) -> tuple[str, HeldLock]:
    """A free default name and its lock, held like a chosen name's until the commit; a name
    another save holds is passed over, not waited for. Blocks."""
    base = default_name(target.notebook_path, target.kernel_name or KERNEL_NAME, time.time())
    for candidate in [base, *(f"{base}-{n}" for n in range(2, DEFAULT_NAME_TRIES + 1))]:
        if store.find_name(candidate) is not None:
            continue
        lock = store.locks.try_acquire(locks.name_key(candidate), f"save as {candidate}")
        if lock is not None:
            return candidate, lock
    raise Busy("preflight", f"every default name from {base!r} to {base}-"
               f"{DEFAULT_NAME_TRIES} is taken", hint="give the snapshot a name")


async def _require_name_free(store: SnapshotStore, name: str) -> None:
    if await asyncio.to_thread(store.find_name, name) is not None:
        raise InvalidRequest(
            "preflight",
            f"a snapshot named {name!r} exists already",
            hint="pick another name, or delete the old one first",
        )
