"""Second upload and download of a kernel saved twice: whole image files against pages kept
by content, through a real S3 server.

One snapshot-ready kernel holds about 1 GiB of random numpy data and is saved by the engine
into two local stores that share a signing key: one keeping whole image files
(``chunk_images=False``), one keeping pages by content (the default). Then about 5 % of the
data changes in place, in runs spread over the array, a little new data is allocated, and
the kernel is saved into both stores again. For each layout, on one SeaweedFS server on
loopback (``bench_remote.seaweed_bucket``), under its own prefix: node A uploads the 1st
snapshot, then the 2nd; node B (a store of its own, the same signing key, a second S3
client) downloads the 1st, then the 2nd. What counts is the 2nd of each: the bytes the 2nd
upload wrote to the bucket (objects new or replaced, from listings before and after), the
bytes the 2nd download read from it (every GET counted), and their times. ``--sealed`` adds
the same pair with AES-256-GCM encryption. Shared machines are noisy; the comparison
within one run is what counts.

    PYTHONPATH=. python benchmarks/bench_remote_chunked.py [--gib 1] [--sealed] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench_remote import machine_info, seaweed_bucket
from common import settle
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install

MiB = 1 << 20
BUCKET = "bench"
LAYOUTS = {"whole": False, "chunked": True}  # name -> chunk_images

FILL = """
import numpy as np
rng = np.random.default_rng(1)
data = rng.random({n})
"""
# About 5 % of the array rewritten in place, in 64 runs spread over it, then new data.
CHANGE = """
runs = 64
step, span = data.size // runs, data.size // 20 // runs
for i in range(runs):
    data[i * step : i * step + span] = rng.random(span)
extra = rng.random({extra})
"""


class Kernel:
    """A snapshot-ready kernel started by jupyter_client, as the server starts one."""

    def __init__(self) -> None:
        self.km = KernelManager(kernel_name=KERNEL_NAME)
        self.km.start_kernel()
        self.client = self.km.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str) -> None:
        reply = self.client.execute_interactive(code, timeout=600, output_hook=lambda _m: None)
        assert reply["content"]["status"] == "ok", reply["content"]

    def target(self) -> SaveTarget:
        info = {
            k: (v.decode() if isinstance(v, bytes) else v)
            for k, v in self.km.get_connection_info().items()
        }
        return SaveTarget(pid=self.km.provisioner.root_pid, connection_info=info)  # type: ignore[union-attr]

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


def bucket_objects(remote: RemoteStore) -> dict[str, tuple[int, str]]:
    """Every object in the bucket: key -> (size, ETag)."""
    remote.fs.invalidate_cache()
    found: dict[str, dict[str, Any]] = remote.fs.find(BUCKET, detail=True)
    return {k: (int(v["size"]), str(v.get("ETag", ""))) for k, v in found.items()}


def counting_reads(remote: RemoteStore) -> list[int]:
    """Count the bytes of every read from the bucket: all of them go through ``cat_file``
    (whole objects and ranged GETs alike)."""
    fetched: list[int] = []
    cat_file = remote.fs.cat_file

    def counted(path: str, *args: Any, **kwargs: Any) -> bytes:
        data: bytes = cat_file(path, *args, **kwargs)
        fetched.append(len(data))
        return data

    remote.fs.cat_file = counted
    return fetched


def upload(remote: RemoteStore, snap: Snapshot, local: SnapshotStore) -> dict[str, Any]:
    before = bucket_objects(remote)
    settle()
    started = time.monotonic()
    uploaded = remote.upload(snap.path, local=local)
    seconds = time.monotonic() - started
    after = bucket_objects(remote)
    written = {k: v for k, v in after.items() if before.get(k) != v}
    return {
        "seconds": seconds,
        "bytes_written": sum(size for size, _ in written.values()),
        "objects_written": len(written),
        "new_page_bytes": uploaded.remote_manifest.get("new_page_bytes"),
        "chunked": uploaded.chunked,
    }


def download(remote: RemoteStore, fetched: list[int], snap: Snapshot,
             store: SnapshotStore) -> dict[str, Any]:
    fetched.clear()
    settle()
    started = time.monotonic()
    remote.download(snap.id, store)
    seconds = time.monotonic() - started
    return {"seconds": seconds, "bytes_fetched": sum(fetched), "reads": len(fetched)}


def save(engine: SnapshotEngine, kernel: Kernel, name: str) -> tuple[Snapshot, dict[str, Any]]:
    settle()
    snap = asyncio.run(engine.save(kernel.target(), name=name))
    return snap, {
        "pause_s": snap.manifest["timings"]["pause"],
        "total_s": snap.manifest["timings"]["total"],
        "size_bytes": snap.size_bytes,
        "new_bytes": snap.new_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="numpy data in the kernel")
    parser.add_argument("--extra-mib", type=int, default=16, help="new data before the 2nd save")
    parser.add_argument("--sealed", action="store_true", help="add the encrypted pair")
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what else ran on the machine, etc.")
    args = parser.parse_args()
    install()
    criu = CriuRunner()
    load_before = os.getloadavg()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-chunked-"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
    key_file = work / "signing.key"
    settings: dict[str, Any] = {"part_bytes": args.part_mib * MiB, "workers": args.workers}
    saves: dict[str, list[dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    try:
        # -- node A: one kernel, saved twice into each layout --------------------------------
        stores = {n: SnapshotStore(work / f"node-a-{n}", key_file, chunk_images=c)
                  for n, c in LAYOUTS.items()}
        engines = {n: SnapshotEngine(s, criu) for n, s in stores.items()}
        snaps: dict[str, list[Snapshot]] = {n: [] for n in LAYOUTS}
        kernel = Kernel()
        try:
            kernel.run(FILL.format(n=int(args.gib * (1 << 30)) // 8))
            for step in (1, 2):
                if step == 2:
                    kernel.run(CHANGE.format(extra=args.extra_mib * MiB // 8))
                # Alternate which layout saves first.
                for name in LAYOUTS if step == 1 else reversed(LAYOUTS):
                    snap, facts = save(engines[name], kernel, f"save-{step}")
                    snaps[name].append(snap)
                    saves.setdefault(name, []).append(facts)
                    print(f"save {step} {name}: {facts}", flush=True)
        finally:
            kernel.shutdown()

        # -- the bucket: each layout (and, with --sealed, each sealed layout) on its own ----
        with seaweed_bucket(work / "s3", BUCKET) as options:
            cases: list[tuple[str, bytes | None]] = [(n, None) for n in LAYOUTS]
            if args.sealed:
                cases += [(n, os.urandom(32)) for n in LAYOUTS]
            for name, key in cases:
                label = f"{name}{'_sealed' if key else ''}"
                url = f"s3://{BUCKET}/{label}"
                node_a = RemoteStore(url, options, key=key, **settings)
                ups = [upload(node_a, s, stores[name]) for s in snaps[name]]
                node_b = RemoteStore(url, options, key=key, **settings)
                fetched = counting_reads(node_b)
                store_b = SnapshotStore(work / f"node-b-{label}", key_file,
                                        chunk_images=LAYOUTS[name])
                downs = [download(node_b, fetched, s, store_b) for s in snaps[name]]
                row = {"layout": name, "sealed": key is not None,
                       "upload": ups, "download": downs}
                rows.append(row)
                print(f"{label}: upload {ups}\n{label}: download {downs}", flush=True)
                shutil.rmtree(store_b.root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def summary(row: dict[str, Any]) -> dict[str, Any]:
        up, down = row["upload"][1], row["download"][1]
        return {
            "layout": row["layout"], "sealed": row["sealed"],
            "upload_2_mib": round(up["bytes_written"] / MiB, 1),
            "upload_2_s": round(up["seconds"], 2),
            "download_2_mib": round(down["bytes_fetched"] / MiB, 1),
            "download_2_s": round(down["seconds"], 2),
            "upload_1_s": round(row["upload"][0]["seconds"], 2),
            "download_1_s": round(row["download"][0]["seconds"], 2),
        }

    result = {
        "benchmark": "remote-whole-vs-chunked",
        "script": "benchmarks/bench_remote_chunked.py",
        "machine": {**machine_info(), "criu": ".".join(map(str, criu.version()))},
        "commit": head,
        "server": "SeaweedFS (weed server -s3) on loopback, data on local disk",
        "note": args.note,
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "kernel": {
            "numpy_gib": args.gib,
            "changed_in_place": "5 % of the array, in 64 runs spread over it",
            "extra_mib": args.extra_mib,
        },
        "settings": settings,
        "saves": saves,
        "rows": rows,
        "summary": [summary(r) for r in rows],
    }
    out = args.out or Path(__file__).parent / "results" / (
        f"remote-chunked-{datetime.now(timezone.utc):%Y%m%d}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
