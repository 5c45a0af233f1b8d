"""Save and restore of CPU kernels holding 0.1, 1 and 4 GB of numpy, against raw criu.

For each size one snapshot-ready kernel is started; the same process is dumped both by
the raw CLI (``criu dump --leave-running --tcp-close``) and by the engine, in alternating
order, then restored by each (``criu restore -d`` vs ``SnapshotEngine.restore``) up to the
first executed cell over a fresh client. Absolute times on shared machines are noisy; the
comparison within one run is what counts.

    python benchmarks/bench_cpu.py [--sizes 0.1 1 4] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import host_facts, settle
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install


def machine_info(criu: CriuRunner) -> dict[str, Any]:
    return {**host_facts(), "criu": ".".join(map(str, criu.version())), "driver": None}


def connect_and_run(info: dict[str, Any]) -> float:
    """Seconds until a fresh client has run one cell."""
    started = time.monotonic()
    client = BlockingKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        reply = client.execute_interactive("1 + 1", timeout=120, output_hook=lambda _m: None)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
    return time.monotonic() - started




def raw_dump(criu: CriuRunner, root: int, images: Path) -> float:
    images.mkdir(parents=True)
    argv = criu.dump_argv(root, images, images, leave_running=True)
    started = time.monotonic()
    subprocess.run(argv, check=True)
    return time.monotonic() - started


def raw_restore(criu: CriuRunner, images: Path, info: dict[str, Any]) -> tuple[float, int]:
    pidfile = images / "restore.pid"
    pidfile.unlink(missing_ok=True)
    started = time.monotonic()
    subprocess.run(criu.restore_argv(images, images, pidfile), check=True)
    restored = time.monotonic() - started
    first_cell = connect_and_run(info)
    return restored + first_cell, int(pidfile.read_text())


def bench_size(gib: float, repeats: int, work: Path, criu: CriuRunner) -> dict[str, Any]:
    km = KernelManager(kernel_name=KERNEL_NAME)
    km.start_kernel()
    client = km.blocking_client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    n = int(gib * (1 << 30) / 8)
    client.execute_interactive(f"import numpy as np; data = np.ones({n})", timeout=600)
    client.stop_channels()
    root = km.provisioner.root_pid
    info = {
        k: (v.decode() if isinstance(v, bytes) else v) for k, v in km.get_connection_info().items()
    }
    rss = procfs.tree_rss(root)
    engine = SnapshotEngine(SnapshotStore(work / "store", work / "signing.key"), criu)

    rows: dict[str, list[float]] = {k: [] for k in (
        "raw_pause", "ours_pause", "ours_save_total", "raw_restore_first_cell",
        "ours_restore_first_cell", "ours_verify", "ours_verify_wait", "ours_restore_criu",
        "ours_restore_preflight")}
    image_bytes = 0
    images: list[tuple[Path, Any]] = []
    for i in range(repeats):
        raw_dir = work / f"raw-{i}"
        snapshot = None
        for who in ("raw", "ours") if i % 2 == 0 else ("ours", "raw"):
            settle()
            if who == "raw":
                rows["raw_pause"].append(raw_dump(criu, root, raw_dir))
            else:
                snapshot = asyncio.run(engine.save(SaveTarget(pid=root, connection_info=info)))
                rows["ours_pause"].append(snapshot.manifest["timings"]["pause"])
                rows["ours_save_total"].append(snapshot.manifest["timings"]["total"])
                image_bytes = snapshot.size_bytes
        images.append((raw_dir, snapshot))
    # Restores need the kernel's ports: end the original, then restore every pair of
    # images, alternating who goes first, ending each copy before the next.
    km.shutdown_kernel(now=True)
    for i, (raw_dir, snapshot) in enumerate(images):
        for who in ("raw", "ours") if i % 2 == 0 else ("ours", "raw"):
            settle(cold=True)
            if who == "raw":
                seconds, pid = raw_restore(criu, raw_dir, info)
                rows["raw_restore_first_cell"].append(seconds)
            else:
                started = time.monotonic()
                back = asyncio.run(engine.restore(snapshot))
                seconds = time.monotonic() - started + connect_and_run(info)
                rows["ours_restore_first_cell"].append(seconds)
                rows["ours_verify"].append(back.timings["verify"])
                rows["ours_verify_wait"].append(back.timings["verify_wait"])
                rows["ours_restore_criu"].append(back.timings["restore"])
                rows["ours_restore_preflight"].append(back.timings["preflight"])
                pid = back.pid
            procfs.kill_tree(pid)
        shutil.rmtree(raw_dir)
        engine.delete(snapshot.id)
    if km.has_kernel:
        km.shutdown_kernel(now=True)

    med = {k: statistics.median(v) for k, v in rows.items() if v}
    return {
        "gib_numpy": gib,
        "rss_bytes": rss,
        "image_bytes": image_bytes,
        "repeats": repeats,
        "samples": rows,
        "median": med,
        "pause_overhead_s": med["ours_pause"] - med["raw_pause"],
        "pause_overhead_pct": 100 * (med["ours_pause"] / med["raw_pause"] - 1),
        "restore_overhead_s": med["ours_restore_first_cell"] - med["raw_restore_first_cell"],
        "restore_overhead_pct": 100
        * (med["ours_restore_first_cell"] / med["raw_restore_first_cell"] - 1),
        # The digests are checked while criu restores the tree stopped; what the check still
        # adds is the wait for it once criu is done.
        "restore_overhead_without_verify_wait_s": med["ours_restore_first_cell"]
        - med["ours_verify_wait"]
        - med["raw_restore_first_cell"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1, 4])
    parser.add_argument("--repeats", type=int, default=4, help="even keeps the order balanced")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    criu = CriuRunner()
    result = {"benchmark": "cpu-save-restore", "machine": machine_info(criu), "cases": []}
    with tempfile.TemporaryDirectory(prefix="jgs-bench-") as tmp:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        for gib in args.sizes:
            case = bench_size(gib, args.repeats, Path(tmp) / f"case-{gib}", criu)
            result["cases"].append(case)
            m = case["median"]
            print(
                f"{gib:>5} GiB: pause raw {m['raw_pause']:.2f}s ours {m['ours_pause']:.2f}s "
                f"(+{case['pause_overhead_s']:.2f}s); save total {m['ours_save_total']:.2f}s; "
                f"restore->cell raw {m['raw_restore_first_cell']:.2f}s "
                f"ours {m['ours_restore_first_cell']:.2f}s (+{case['restore_overhead_s']:.2f}s; "
                f"verify {m['ours_verify']:.2f}s overlapped, waited {m['ours_verify_wait']:.2f}s)",
                flush=True,
            )
    out = args.out or Path(__file__).parent / "results" / (
        f"cpu-{datetime.now(timezone.utc).strftime('%Y%m%d')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
