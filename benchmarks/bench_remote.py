"""Upload and download of a snapshot through the remote store, against plain s3fs put/get.

One SeaweedFS server on loopback (the same real S3 server the tests use) receives, in the
same run and in alternating order: our upload and download of a snapshot directory (parallel
multipart, digests checked while downloading), the same with AES-256-GCM encryption, and
s3fs ``put_file``/``get_file`` of the same files (what ``aws s3 cp`` does: multipart upload,
no digest check). Shared machines are noisy; the comparison within one run is what counts.

    PYTHONPATH=. python benchmarks/bench_remote.py [--gib 1] [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import host_facts, settle

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from testkit.remote_snapshots import make_snapshot
from testkit.seaweed import SeaweedServer

MiB = 1 << 20


def machine_info() -> dict[str, Any]:
    import fsspec
    import s3fs

    return {**host_facts(), "fsspec": fsspec.__version__, "s3fs": s3fs.__version__}


@contextlib.contextmanager
def seaweed_bucket(work: Path, bucket: str = "bench") -> Iterator[dict[str, Any]]:
    """A SeaweedFS server on loopback, its data under ``work``, with one empty bucket;
    yields the s3fs storage options that reach it. The server stops on the way out."""
    server = SeaweedServer(work / "seaweed")
    try:
        server.start()
        server.make_bucket(bucket)
        yield dict(server.storage_options(), skip_instance_cache=True)
    finally:
        server.stop()


def timed(action: Callable[[], object]) -> float:
    settle()
    started = time.monotonic()
    action()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the snapshot")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what else ran on the machine, etc.")
    args = parser.parse_args()
    load_before = os.getloadavg()

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    stack = contextlib.ExitStack()  # the server, stopped before the work directory goes
    try:
        options = stack.enter_context(seaweed_bucket(work))
        local = SnapshotStore(work / "local")
        total = int(args.gib * (1 << 30))
        # One big pages image, as CRIU writes it, and the small files beside it.
        snap = make_snapshot(
            local, {"pages-1.img": total - 3 * MiB, "mm-1.img": 2 * MiB, "core-1.img": MiB}
        )
        nbytes = sum(p.stat().st_size for p in snap.path.iterdir())
        settings = {"part_bytes": args.part_mib * MiB, "workers": args.workers}
        stores = {
            "ours": RemoteStore("s3://bench/ours", options, **settings),  # type: ignore[arg-type]
            "ours_encrypted": RemoteStore(
                "s3://bench/sealed", options, key=os.urandom(32), **settings  # type: ignore[arg-type]
            ),
        }
        plain = stores["ours"].fs
        samples: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            samples.setdefault(name, []).append(seconds)
            print(f"{name}: {seconds:.2f} s ({nbytes / seconds / MiB:.0f} MiB/s)", flush=True)

        def s3fs_put() -> None:
            for p in sorted(snap.path.iterdir()):
                plain.put_file(str(p), f"bench/plain/{snap.id}/{p.name}")

        def s3fs_get(into: Path) -> None:
            into.mkdir(parents=True)
            for p in sorted(snap.path.iterdir()):
                plain.get_file(f"bench/plain/{snap.id}/{p.name}", str(into / p.name))

        for repeat in range(args.repeats):
            order = ["s3fs", "ours", "ours_encrypted"]
            if repeat % 2:
                order.reverse()
            for name in order:
                into = work / f"down-{name}-{repeat}"
                if name == "s3fs":
                    record("s3fs_put", timed(s3fs_put))
                    record("s3fs_get", timed(lambda i=into: s3fs_get(i)))
                    plain.rm(f"bench/plain/{snap.id}", recursive=True)
                else:
                    store = stores[name]
                    record(f"{name}_upload", timed(lambda s=store: s.upload(snap.path)))
                    down = timed(lambda s=store, i=into: s.download(snap.id, i))
                    record(f"{name}_download", down)
                    store.delete(snap.id)
                shutil.rmtree(into, ignore_errors=True)

        medians = {k: statistics.median(v) for k, v in samples.items()}

        def ratio(ours: str, theirs: str) -> float:
            return round(medians[ours] / medians[theirs], 2)

        result = {
            "benchmark": "remote-transfer",
            "script": "benchmarks/bench_remote.py",
            "machine": machine_info(),
            "server": "SeaweedFS (weed server -s3) on loopback, data on local disk",
            "note": args.note,
            "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
            "bytes": nbytes,
            "settings": settings,
            "samples_s": samples,
            "median_s": medians,
            "median_mib_s": {k: round(nbytes / v / MiB, 1) for k, v in medians.items()},
            # time ratios: below 1 is faster than s3fs
            "ours_over_s3fs": {
                "upload": ratio("ours_upload", "s3fs_put"),
                "download": ratio("ours_download", "s3fs_get"),
                "upload_encrypted": ratio("ours_encrypted_upload", "s3fs_put"),
                "download_encrypted": ratio("ours_encrypted_download", "s3fs_get"),
            },
        }
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    out = args.out or Path(__file__).parent / "results" / (
        f"remote-{datetime.now(timezone.utc):%Y%m%d}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median_mib_s"], indent=2))
    print(json.dumps(result["ours_over_s3fs"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
