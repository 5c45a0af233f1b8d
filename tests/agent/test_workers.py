"""The node agent's worker threads (``agent/workers.py``): one realm's hung steps hold only
that realm's share, its next step fails at the deadline instead of waiting behind them, and
nothing waits for a hung thread at the end.

Steps "hang" here on events the test holds, and are let go at its end: no user, no agent,
no lock needed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from jupyter_gpu_snapshot.agent import workers
from jupyter_gpu_snapshot.core.errors import Busy

from ..conftest import run

SHARE = 2
WAIT = 1.0  # the deadline under test: the step below fails once it passed


def test_one_realms_hung_steps_hold_only_its_own_share() -> None:
    held = threading.Event()
    started = threading.Semaphore(0)

    def hang() -> str:
        started.release()
        held.wait()
        return "let go"

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        router = workers.Router(workers.Pool("the agent", 2, WAIT))
        loop.set_default_executor(router)
        alices = workers.Pool("alice", SHARE, WAIT)
        bobs = workers.Pool("bob", SHARE, WAIT)
        with workers.serve_realm(alices):
            hung = [asyncio.ensure_future(asyncio.to_thread(hang)) for _ in range(SHARE)]
        for _ in range(SHARE):
            await asyncio.to_thread(started.acquire)  # each hung step runs (agent's pool)
        assert alices.busy() == SHARE
        # Bob's steps and the agent's own run all the same.
        with workers.serve_realm(bobs):
            assert await asyncio.to_thread(lambda: "bob's") == "bob's"
        assert await asyncio.to_thread(lambda: "the agent's") == "the agent's"
        # Alice's next step fails at the deadline, naming the cause, not behind hers.
        with workers.serve_realm(alices), pytest.raises(Busy) as waited:
            await asyncio.to_thread(lambda: "never")
        assert f"{SHARE} of {SHARE} are still busy" in waited.value.cause
        assert "alice" in waited.value.cause
        # Her hung steps' awaiters give up at once when cancelled; the threads go on.
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
        assert alices.busy() == SHARE
        router.shutdown(wait=True)  # returns: nothing waits for a hung thread

    try:
        run(scenario())
    finally:
        held.set()
