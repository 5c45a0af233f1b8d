"""How criu fills a restored kernel's memory (scripts/criu-patches), four ways, one run.

One snapshot-ready CPU kernel holding random numpy bytes is saved whole and by content
(the store's default), then restored in turn, from the page cache:

- ``in place``: by content; the image streamer hands the pages image over in place and the
  workers read it from the store's packs, where the streamer says it lies;
- ``pipe``: by content, from a server that never hands an image over in place: criu alone
  reads the stream's one pipe;
- ``one worker``: by content, in place, ``--fill-workers 1``: criu reads the packs alone;
- ``whole``: kept whole; the workers read the files of the snapshot's directory.

Each way is restored ``--repeats`` times in turn; the state is compared after each, and
criu's log says how it filled the memory. The machine's own limits are measured in the
same run.

    python benchmarks/bench_fill.py [--gib 1.5] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_cpu import machine_info
from common import (
    CriuWithRestoreLog,
    copy_rate,
    fill_workers_set,
    parallel_population_rate,
    population_rate,
    read_rate,
    settle,
)
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install
from testkit.image_servers import offering_no_extents

STATE = """
import hashlib, numpy as np
block = np.random.default_rng(20261128).integers(0, 2**63, size=int({gib} * (1 << 30)) // 8,
                                                 dtype=np.int64)
print(hashlib.sha256(block.tobytes()).hexdigest())
"""
CHECK = "print(hashlib.sha256(block.tobytes()).hexdigest())"


@dataclass(frozen=True)
class Way:
    whole: bool = False  # the snapshot kept whole, else by content
    extents: bool = True  # whether the image streamer hands a pages image over in place
    workers: int | None = None  # --fill-workers; None: criu's default


WAYS = {
    "in place": Way(),
    "pipe": Way(extents=False),
    "one worker": Way(workers=1),
    "whole": Way(whole=True),
}


def printed(info: dict[str, Any], code: str) -> str:
    """What ``code`` prints in the kernel at ``info``, through a fresh client."""
    client = BlockingKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    try:
        client.wait_for_ready(timeout=120)
        reply = client.execute_interactive(code, timeout=300, output_hook=hook)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
    return "".join(out).strip()


def restore_once(engine: SnapshotEngine, criu: CriuWithRestoreLog, snap_id: str, way: Way,
                 expect: str) -> dict[str, Any]:
    settle()
    with fill_workers_set(way.workers), \
            contextlib.nullcontext() if way.extents else offering_no_extents():
        started = time.monotonic()
        back = asyncio.run(engine.restore(snap_id))
        seconds = time.monotonic() - started
    try:
        assert printed(back.connection_info, CHECK) == expect, "the restored state differs"
    finally:
        procfs.kill_tree(back.pid)
    images = back.notes["images"]
    return {"restore_s": seconds, "criu_s": back.timings.get("restore"),
            "read_in_place": images["read_in_place"], "pipe_seconds": images["pipe_seconds"],
            "criu_fill": criu.fill_lines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    criu = CriuRunner()
    result: dict[str, Any] = {"benchmark": "criu-fill-ways", "machine": machine_info(criu),
                              "gib": args.gib, "runs": {way: [] for way in WAYS}}
    with tempfile.TemporaryDirectory(prefix="jgs-bench-fill-") as tmp:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        km = KernelManager(kernel_name=KERNEL_NAME)
        km.start_kernel()
        expect = printed(km.get_connection_info(), STATE.format(gib=args.gib))
        target = SaveTarget(pid=int(km.provisioner.root_pid),
                            connection_info=km.get_connection_info(),
                            kernel_name="python3-snapshot")
        logged = CriuWithRestoreLog(Path(tmp))
        engines, snaps = {}, {}
        for whole in (True, False):
            store = SnapshotStore(Path(tmp) / f"store-{whole}", chunk_images=not whole)
            engines[whole] = SnapshotEngine(store, logged.runner)
            snaps[whole] = asyncio.run(engines[whole].save(target, name="fill", stop=not whole))
        for _ in range(args.repeats):
            for name, way in WAYS.items():
                snap = snaps[way.whole]
                run = restore_once(engines[way.whole], logged, snap.id, way, expect)
                result["runs"][name].append(run)
                print(f"{name}: restore {run['restore_s']:.2f}s (criu {run['criu_s']:.2f}s): "
                      + "; ".join(run["criu_fill"]), flush=True)
                while procfs.ports_in_use(snap.connection_info):
                    time.sleep(0.5)
        packs = sorted((engines[False].store.root / "chunks").glob("*.pack"))
        result["floors"] = {
            "store_read_warm": read_rate(packs, cold=False),
            "populate_4k": population_rate(huge=False, size=1 << 30),
            "populate_2_threads": parallel_population_rate(2, size=1 << 30),
            "memcpy": copy_rate(size=1 << 30),
        }
    result["median_restore_s"] = {way: statistics.median(r["restore_s"] for r in runs)
                                  for way, runs in result["runs"].items()}
    result["median_criu_s"] = {way: statistics.median(r["criu_s"] for r in runs)
                               for way, runs in result["runs"].items()}
    print(json.dumps({k: result[k] for k in ("median_restore_s", "median_criu_s")}, indent=1))
    out = args.out or Path(__file__).parent / "results" / "fill-cpu.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
