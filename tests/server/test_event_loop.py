"""Nothing a snapshot does blocks the server: requests keep being answered while a 2 GiB
kernel is saved, its snapshots listed and the snapshot deleted, and a store of 200
snapshots lists quickly."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from jupyter_gpu_snapshot.core.store import SnapshotStore, new_snapshot_id

from ..manifests import kernel_section
from .conftest import Api, KernelConnector

POLL_SECONDS = 0.020
P99_LIMIT = 0.050
# One slow answer in hundreds is the 2-core machine's scheduler (0.18 s seen with the loop
# free); any blocking step on 2 GiB (hashing, copying, reading the image) takes seconds.
MAX_LIMIT = 0.500
KERNEL_BYTES = 2 << 30


def figures(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    at = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)  # noqa: E731
    return {"n": len(ordered), "p50": at(0.50), "p99": at(0.99), "max": round(ordered[-1], 4)}


class Poller:
    """GETs one URL every POLL_SECONDS until stopped; keeps every answer's latency.

    Answers before ``busy()`` is called are the idle baseline, kept apart.
    """

    def __init__(self, api: Api, *parts: str) -> None:
        self.api = api
        self.parts = parts
        self.idle: list[float] = []
        self.latencies: list[float] = self.idle
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def busy(self) -> None:
        self.latencies = []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        next_tick = time.perf_counter()
        while not self._stop.is_set():
            started = time.perf_counter()
            code, body = await self.api.call("GET", *self.parts)
            self.latencies.append(time.perf_counter() - started)
            assert code == 200, (self.parts, code, body)
            next_tick = max(next_tick + POLL_SECONDS, time.perf_counter())
            await asyncio.sleep(next_tick - time.perf_counter())

    async def stop(self) -> dict[str, float]:
        """The figures of the answers since ``busy()``."""
        self._stop.set()
        assert self._task is not None
        await self._task
        return figures(self.latencies)


async def test_status_answers_quickly_while_2_gib_are_saved_listed_and_deleted(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    # Bytes written page by page: all 2 GiB are resident and go into the image.
    await ws.execute(f"blob = b'y' * {KERNEL_BYTES}; print(len(blob))", timeout=120)
    pollers = {
        "kernel status": Poller(api, "gpu-snapshot", "kernels", kernel_id, "status"),
        "/api/status": Poller(api, "api", "status"),
    }
    for poller in pollers.values():
        poller.start()
    await asyncio.sleep(2.0)
    for poller in pollers.values():
        poller.busy()
    job = await api.succeeded(await api.save(kernel_id))
    listed = await api.snapshots()
    assert [s["id"] for s in listed] == [job["snapshot_id"]]
    assert listed[0]["size_bytes"] >= KERNEL_BYTES
    await api.ok("DELETE", "gpu-snapshot", "snapshots", job["snapshot_id"], expect=204)
    await asyncio.sleep(0.5)
    seen_busy = {name: await poller.stop() for name, poller in pollers.items()}
    # The figures, for the record (pytest -s); idle is the same polling before the save,
    # to tell a blocked event loop from a machine that is busy with other work.
    record = {
        "busy": seen_busy, "idle": {n: figures(p.idle) for n, p in pollers.items()},
        "save timings": job["result"]["timings"],
    }
    print(json.dumps(record))
    for seen in seen_busy.values():
        assert seen["n"] > 50, record
        assert seen["p99"] <= P99_LIMIT and seen["max"] <= MAX_LIMIT, record
    assert (await ws.execute("print(len(blob))")).strip() == str(KERNEL_BYTES)


def _fill_store(store_dir: Path, count: int) -> None:
    """``count`` small but complete snapshots of one notebook, committed as a save does."""
    store = SnapshotStore(store_dir)
    for i in range(count):
        snapshot_id = new_snapshot_id()
        partial = store.begin(snapshot_id)
        (partial / "pages-1.img").write_bytes(b"p" * 4096)
        store.commit(partial, {
            "id": snapshot_id, "name": f"snap-{i}", "created": time.time(), "reason": "user",
            "kernel": kernel_section(notebook_path="many.ipynb"),
        })


async def test_listing_200_snapshots_takes_under_50_ms(api: Api, store_dir: Path) -> None:
    await asyncio.to_thread(_fill_store, store_dir, 200)
    assert len(await api.snapshots()) == 200  # the first listing reads the manifests
    times = []
    for _ in range(10):
        started = time.perf_counter()
        assert len(await api.snapshots()) == 200
        times.append(time.perf_counter() - started)
    times.sort()
    print(json.dumps({"list 200": {"p50": times[5], "max": times[-1]}}))
    assert times[5] <= 0.050, times
