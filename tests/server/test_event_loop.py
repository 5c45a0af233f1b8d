"""Nothing a snapshot does blocks the server: no callback of its event loop holds it while a
2 GiB kernel is saved, its snapshots listed and the snapshot deleted, and listing a store of
200 snapshots reads no manifest twice.

Wall-clock latencies would say as much about the machine as about the server, so these
tests count what the loop's own callbacks hold it for (``loop_watch``); the latencies are
measured by ``benchmarks/bench_event_loop.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.loop_watch import LoopWatch

from ..conftest import copy_many_snapshots
from .conftest import Api, KernelConnector

KERNEL_BYTES = 2 << 30
# What one callback may hold the loop for: its own CPU time, its sleeps and its waits for
# the GIL count; the waits for a CPU that load or the hypervisor add, and the garbage
# collector's pauses, do not. The longest seen here took 0.016 s, idle or beside
# `stress-ng --cpu 2`; a synchronous delete of the 2 GiB image held it 0.36 s, zeroing a
# 64 MiB read buffer in a digest thread 0.19 s, and hashing or reading the image would take
# seconds.
BLOCKING_SECONDS = 0.1
POLL_SECONDS = 0.020


class Poller:
    """GETs one URL every POLL_SECONDS until stopped, so its handler runs all along."""

    def __init__(self, api: Api, *parts: str) -> None:
        self.api = api
        self.parts = parts
        self.answers = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            code, body = await self.api.call("GET", *self.parts)
            assert code == 200, (self.parts, code, body)
            self.answers += 1
            await asyncio.sleep(POLL_SECONDS)

    async def stop(self) -> int:
        """How many answers came."""
        self._stop.set()
        assert self._task is not None
        await self._task
        return self.answers


async def test_no_callback_blocks_the_loop_while_2_gib_are_saved_listed_and_deleted(
    api: Api, kernel_socket: KernelConnector, store_dir: Path
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    # Bytes written page by page: all 2 GiB are resident and go into the image.
    await ws.execute(f"blob = b'y' * {KERNEL_BYTES}; print(len(blob))", timeout=120)
    pollers = {
        "kernel status": Poller(api, "gpu-snapshot", "kernels", kernel_id, "status"),
        "/api/status": Poller(api, "api", "status"),
    }
    with LoopWatch(asyncio.get_running_loop(), BLOCKING_SECONDS) as watch:
        for poller in pollers.values():
            poller.start()
        job = await api.succeeded(await api.save(kernel_id))
        listed = await api.snapshots()
        await api.ok("DELETE", "gpu-snapshot", "snapshots", job["snapshot_id"], expect=204)
        answers = {name: await poller.stop() for name, poller in pollers.items()}
    record = {
        "held": [vars(h) for h in watch.held], "longest_own_s": round(watch.longest_s, 4),
        "callbacks": watch.callbacks, "answers": answers,
        "save timings": job["result"]["timings"],
    }
    print(json.dumps(record))
    assert [s["id"] for s in listed] == [job["snapshot_id"]]
    assert listed[0]["size_bytes"] >= KERNEL_BYTES
    left = await asyncio.to_thread(os.listdir, store_dir)
    assert not [name for name in left if job["snapshot_id"] in name], left
    assert watch.held == [], record
    assert all(n > 0 for n in answers.values()), record
    assert (await ws.execute("print(len(blob))")).strip() == str(KERNEL_BYTES)


async def test_listing_200_snapshots_reads_each_manifest_once_and_blocks_nothing(
    api: Api, store_dir: Path, monkeypatch: pytest.MonkeyPatch, many_snapshots: Path
) -> None:
    await asyncio.to_thread(copy_many_snapshots, many_snapshots, store_dir)
    manifests_read: list[str] = []
    load = SnapshotStore._load

    def counted_load(store: SnapshotStore, root_fd: int, name: str) -> object:
        manifests_read.append(name)
        return load(store, root_fd, name)

    monkeypatch.setattr(SnapshotStore, "_load", counted_load)
    with LoopWatch(asyncio.get_running_loop(), BLOCKING_SECONDS) as watch:
        assert len(await api.snapshots()) == 200
        assert len(manifests_read) == len(set(manifests_read)) == 200
        for _ in range(10):
            assert len(await api.snapshots()) == 200
    print(json.dumps({"longest_own_s": round(watch.longest_s, 4)}))
    assert len(manifests_read) == 200, "a listing read manifests it had read before"
    assert watch.held == []
