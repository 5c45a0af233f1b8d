"""How fast the server answers while a big kernel is saved, listed and deleted, and how long
a listing of 200 snapshots takes: the latencies behind tests/server/test_event_loop.py.

A real ``jupyter server`` with the extension runs in its own process. Two threads here GET
``gpu-snapshot/kernels/{id}/status`` and ``api/status`` every ``--poll-ms`` and keep each
answer's latency: for ``--idle`` seconds first (the baseline of this machine now), then
while a kernel holding ``--gib`` GiB is saved, its snapshots listed and the snapshot
deleted. Then 200 small snapshots are committed beside the server and listed through the
API ``--listings`` times (the first listing reads their manifests, the others none).

Latency on a shared machine says as much about the machine as about the server: the result
records the load average before and after, and the idle baseline of the same run.

    python benchmarks/bench_event_loop.py [--gib 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import host_facts
from server_process import Server, connect, run_cell

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install
from testkit.manifests import commit_tiny


def figures(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    if not ordered:
        return {"n": 0}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"n": len(ordered), "p50": at(0.50), "p99": at(0.99), "max": round(ordered[-1], 4)}


class Poller(threading.Thread):
    """GETs one path every ``interval`` seconds; latencies go to the current phase."""

    def __init__(self, server: Server, path: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.server, self.path, self.interval = server, path, interval
        self.phases: dict[str, list[float]] = {"idle": []}
        self.phase = "idle"
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.perf_counter()
            self.server.request("GET", self.path)
            self.phases[self.phase].append(time.perf_counter() - started)
            self.stopping.wait(self.interval)

    def enter(self, phase: str) -> None:
        self.phases[phase] = []
        self.phase = phase


def timed_listing(server: Server) -> float:
    started = time.perf_counter()
    server.request("GET", "gpu-snapshot/snapshots")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="memory the kernel holds")
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle baseline")
    parser.add_argument("--listings", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    result: dict[str, Any] = {
        "benchmark": "event-loop-latency", "machine": host_facts(),
        "load_before": os.getloadavg(), "kernel_gib": args.gib, "poll_ms": args.poll_ms,
    }
    with tempfile.TemporaryDirectory(prefix="jgs-bench-loop-") as tmp:
        base = Path(tmp)
        key_file = base / "signing.key"
        server = Server(base, {"signing_key_file": str(key_file),
                               "snapshot_on_shutdown": False}, "loop")
        try:
            kernel_id = server.request("POST", "api/kernels", {"name": KERNEL_NAME})["id"]
            client = connect(server.connection_info(kernel_id))
            run_cell(client, f"blob = b'y' * {int(args.gib * (1 << 30))}", timeout=600)
            pollers = {
                "kernel status": Poller(server, f"gpu-snapshot/kernels/{kernel_id}/status",
                                        args.poll_ms / 1000),
                "/api/status": Poller(server, "api/status", args.poll_ms / 1000),
            }
            for poller in pollers.values():
                poller.start()
            time.sleep(args.idle)  # the idle baseline: polling alone
            for poller in pollers.values():
                poller.enter("busy")
            job = server.request("POST", f"gpu-snapshot/kernels/{kernel_id}/snapshots", {})
            job = server.wait_job(job)
            assert job["status"] == "succeeded", job
            server.request("GET", "gpu-snapshot/snapshots")
            server.request("DELETE", f"gpu-snapshot/snapshots/{job['snapshot_id']}")
            for poller in pollers.values():
                poller.stopping.set()
                poller.join()
            client.stop_channels()
            result["idle"] = {n: figures(p.phases["idle"]) for n, p in pollers.items()}
            result["busy"] = {n: figures(p.phases["busy"]) for n, p in pollers.items()}
            result["save_timings"] = job["result"]["timings"]

            listed = SnapshotStore(base / "store", key_file)
            for i in range(200):
                commit_tiny(listed, f"listed-{i}", "many.ipynb")
            first = timed_listing(server)
            again = [timed_listing(server) for _ in range(args.listings)]
            result["list_200"] = {"first_s": round(first, 4), **figures(again)}
        finally:
            server.stop()
    result["load_after"] = os.getloadavg()
    for name, busy in result["busy"].items():
        idle = result["idle"][name]
        print(f"{name}: idle p50 {idle['p50']:.4f}s p99 {idle['p99']:.4f}s; while "
              f"{args.gib:g} GiB saved, listed, deleted: p50 {busy['p50']:.4f}s "
              f"p99 {busy['p99']:.4f}s max {busy['max']:.4f}s (n={busy['n']})")
    listing = result["list_200"]
    print(f"200 snapshots listed: first {listing['first_s']:.4f}s, then p50 "
          f"{listing['p50']:.4f}s max {listing['max']:.4f}s")
    out = args.out or Path(__file__).parent / "results" / (
        f"event-loop-{datetime.now(timezone.utc).strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
