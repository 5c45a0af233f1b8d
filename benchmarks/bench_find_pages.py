"""How long a restore takes to find the pages of a snapshot kept by content, before criu
runs: by sorting every id of the store, or from the plan its save remembered
(``packs.RememberedPlan``), checked against the recipe.

One image of random pages (``--gib``, with a run of zero pages) is committed by content,
then a second save of it with a few pages changed here and there, as after a forward pass;
the second snapshot's pages are found ``--repeats`` times each way, from the page cache.
The machine's own sort rate is measured in the same run.

    python benchmarks/bench_find_pages.py [--gib 4] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_cpu import machine_info

from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.store import SnapshotStore, packs
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot, new_snapshot_id
from testkit.manifests import kernel_section

IMAGE = "pages-1.img"
STEP = 64 << 20


def commit(store: SnapshotStore, write: Any) -> Snapshot:
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    with open(partial / IMAGE, "wb") as f:
        write(f)
    return store.commit(partial, {"id": snapshot_id, "name": snapshot_id, "created": time.time(),
                                  "reason": "user", "kernel": kernel_section()})


def find(store: SnapshotStore, snapshot: Snapshot, remembered: bool) -> float:
    """Seconds to open the snapshot's images for a restore; without ``remembered``, its
    plan is removed first, so the store's ids are sorted."""
    if not remembered:
        for plan in (store.root / packs.CHUNKS_DIR).glob(f"*{packs.PLAN_SUFFIX}"):
            plan.unlink()
    else:
        store.find_pages(snapshot)
    started = time.monotonic()
    with store.served_images(store.reload(snapshot)):
        pass
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // STEP * STEP
    rng = np.random.default_rng(20261128)
    with tempfile.TemporaryDirectory(prefix="jgs-bench-find-") as tmp:
        store = SnapshotStore(Path(tmp) / "store")

        def first(f: Any) -> None:
            for offset in range(0, size, STEP):
                block = rng.integers(0, 2**63, STEP // 8, dtype=np.int64)
                if offset == STEP:
                    block[:] = 0  # a run of zero pages
                f.write(block.tobytes())

        commit(store, first)

        def second(f: Any) -> None:
            # The first image again, read back from the store, with one page in 500 changed.
            with store.served_images(store.reload(store.list()[0])) as served:
                whole = served[IMAGE]
                data = bytearray(STEP)
                for offset in range(0, size, STEP):
                    whole.read_into(memoryview(data), offset)
                    pages = np.frombuffer(data, np.uint64).reshape(-1, packs.PAGE // 8)
                    pages[::500, 0] += 1
                    f.write(data)

        snapshot = commit(store, second)
        ids = (snapshot.path / f"{IMAGE}.chunks").stat().st_size // packs.ID_BYTES
        runs: dict[str, list[float]] = {"sorting the ids": [], "remembered plan": []}
        for _ in range(args.repeats):
            runs["sorting the ids"].append(find(store, snapshot, remembered=False))
            runs["remembered plan"].append(find(store, snapshot, remembered=True))
        keys = np.random.default_rng(1).integers(0, 2**63, ids, dtype=np.uint64)
        started = time.monotonic()
        packs.argsort(keys)
        sort_s = time.monotonic() - started
    result = {
        "benchmark": "find-pages", "machine": machine_info(CriuRunner()),
        "image_bytes": size, "pages": ids, "runs": runs,
        "median_s": {way: statistics.median(r) for way, r in runs.items()},
        "floors": {"argsort_of_the_ids_s": sort_s, "cores": os.cpu_count()},
    }
    print(json.dumps({k: result[k] for k in ("pages", "median_s", "floors")}, indent=1))
    out = args.out or Path(__file__).parent / "results" / "find-pages-cpu.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
