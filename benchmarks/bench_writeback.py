"""The first save of a kernel into an empty store, by content, with and without write-behind.

Every page of such a save is new, so its commit writes the whole image again, into a pack.
With write-behind (``packs.layout.WRITE_BEHIND``) the pack writer has the disk start on each
range as it appends it, and the final fsync waits only for the tail; without, the pages sit
in the page cache until that fsync (or the kernel's own writeback). One CPU kernel holding
random numpy bytes is saved keep-running into a fresh, empty store, the two ways in turn
(the order alternating), ``--repeats`` times each. Between saves the store's own write rate
is measured in the same directory: buffered writes of 16 MiB, then ``fdatasync``, the way a
pack is written; and the disk's raw rate beside it (``dd oflag=direct``).

Then the commit alone, the same two ways in turn: an image of ``--commit-gib`` GiB of random
pages written beside a draft and synced, committed into an empty store, with no kernel and
nothing else dirty in the page cache.

Reported per save: the pause, the commit (the save is durable when it ends: the time from
the end of the pause to durable), the part of it spent in the pack's final fsync, the new
bytes, and the commit over the new bytes at the write rate measured next to it; medians and
minimums per way.

    python benchmarks/bench_writeback.py [--gib 3] [--repeats 3] [--commit-gib 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from bench_cpu import machine_info
from bench_fill import printed
from common import settle
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.locks import snapshot_key
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.packs import layout
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install

STATE = """
import numpy as np
block = np.random.default_rng(20261208).integers(0, 2**63, size=int({gib} * (1 << 30)) // 8,
                                                 dtype=np.int64)
print(block.nbytes)
"""
WAYS = {"fsync at the end": False, "write-behind": True}
CONNECTION = {"transport": "tcp", "ip": "127.0.0.1", "key": "k" * 36,
              "signature_scheme": "hmac-sha256", "shell_port": 50001, "iopub_port": 50002,
              "stdin_port": 50003, "control_port": 50004, "hb_port": 50005}
RATE_BYTES = 2 << 30
RATE_BLOCK = 16 << 20
DIRECT_BYTES = 1 << 30


def write_rate(directory: Path) -> dict[str, float]:
    """Bytes per second of writing ``RATE_BYTES`` into a new file of ``directory``, 16 MiB
    at a time, until ``fdatasync`` returns: the store's write rate as a pack meets it."""
    settle()
    block = os.urandom(RATE_BLOCK)
    path = directory / "write-rate"
    started = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for _ in range(RATE_BYTES // RATE_BLOCK):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.monotonic() - started
    path.unlink()
    # The disk's raw rate beside it: dd with O_DIRECT, no page cache in the way.
    settle()
    started = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={RATE_BLOCK}",
                    f"count={DIRECT_BYTES // RATE_BLOCK}", "oflag=direct", "conv=fdatasync"],
                   check=True, capture_output=True)
    direct = time.monotonic() - started
    path.unlink()
    return {"bytes": RATE_BYTES, "seconds": round(seconds, 3),
            "bytes_per_s": round(RATE_BYTES / seconds),
            "direct_bytes": DIRECT_BYTES, "direct_bytes_per_s": round(DIRECT_BYTES / direct)}


@contextlib.contextmanager
def pack_finish_timed() -> Iterator[list[float]]:
    """Seconds spent in ``PackWriter.finish`` (the pack's fdatasync, then its ids): what the
    commit waited for the disk at its end."""
    spent: list[float] = []
    real = layout.PackWriter.finish

    def finish(writer: layout.PackWriter) -> None:
        started = time.monotonic()
        try:
            real(writer)
        finally:
            spent.append(time.monotonic() - started)

    layout.PackWriter.finish = finish  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        layout.PackWriter.finish = real  # type: ignore[method-assign]


def first_save(target: SaveTarget, criu: CriuRunner, root: Path, write_behind: bool,
               ) -> dict[str, Any]:
    """One save keep-running into the empty store at ``root``, removed afterwards."""
    layout.WRITE_BEHIND = write_behind
    store = SnapshotStore(root, chunk_images=True)
    settle()
    load = os.getloadavg()[0]
    try:
        with pack_finish_timed() as finish:
            snap = asyncio.run(SnapshotEngine(store, criu).save(target, name="first"))
        t = snap.manifest["timings"]
        stored = snap.manifest["stored"]
    finally:
        layout.WRITE_BEHIND = True
        shutil.rmtree(root, ignore_errors=True)
    return {"pause_s": round(t["pause"], 3), "durable_after_pause_s": round(t["commit"], 3),
            "pack_fsync_s": round(sum(finish), 3),
            "save_to_durable_s": round(t["total"], 3), "dump_s": round(t["dump"], 3),
            "new_page_bytes": stored["new_page_bytes"], "load_1min": load, "timings": t}


def commit_only(gib: float, root: Path, write_behind: bool) -> dict[str, Any]:
    """The commit alone: an image of ``gib`` GiB of random pages, written and synced beside
    a draft as criu leaves one, committed into the empty store at ``root`` (removed
    afterwards). No kernel and no criu: nothing else dirty in the page cache."""
    layout.WRITE_BEHIND = write_behind
    store = SnapshotStore(root, chunk_images=True)
    snapshot_id = new_snapshot_id()
    partial = store.begin(snapshot_id)
    manifest = {"id": snapshot_id, "name": "commit", "created": time.time(),
                "kernel": {"name": KERNEL_NAME, "connection_info": CONNECTION, "log_files": []}}
    store.write_draft(partial, manifest)
    rng = np.random.default_rng(20261208)
    with open(partial / "pages-1.img", "wb") as image:
        for _ in range(int(gib * 4)):
            image.write(rng.integers(0, 2**63, size=(256 << 20) // 8, dtype=np.int64).tobytes())
    settle()
    load = os.getloadavg()[0]
    try:
        with pack_finish_timed() as finish, store.locks.hold(
                snapshot_key(snapshot_id), "benchmark", "commit"):
            started = time.monotonic()
            snap = store.commit(partial, manifest)
            seconds = time.monotonic() - started
    finally:
        layout.WRITE_BEHIND = True
        shutil.rmtree(root, ignore_errors=True)
    return {"commit_s": round(seconds, 3), "pack_fsync_s": round(sum(finish), 3),
            "new_page_bytes": snap.manifest["stored"]["new_page_bytes"], "load_1min": load}


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commit-gib", type=float, default=1,
                        help="the commit alone, of an image this large (0: not measured)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    criu = CriuRunner()
    result: dict[str, Any] = {
        "benchmark": "first-save-writeback", "machine": machine_info(criu), "gib": args.gib,
        "load_average_start": os.getloadavg(), "runs": {way: [] for way in WAYS},
        "commit_gib": args.commit_gib, "commit_only": {way: [] for way in WAYS}}
    with tempfile.TemporaryDirectory(prefix="jgs-bench-writeback-") as tmp:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        km = KernelManager(kernel_name=KERNEL_NAME)
        km.start_kernel()
        try:
            printed(km.get_connection_info(), STATE.format(gib=args.gib))
            target = SaveTarget(pid=int(km.provisioner.root_pid),
                                connection_info=km.get_connection_info(),
                                kernel_name="python3-snapshot")
            for repeat in range(args.repeats):
                order = list(WAYS) if repeat % 2 == 0 else list(reversed(WAYS))
                for way in order:
                    rate = write_rate(Path(tmp))
                    run = first_save(target, criu, Path(tmp) / "store", WAYS[way])
                    run["write_rate"] = rate
                    run["new_bytes_at_rate_s"] = round(
                        run["new_page_bytes"] / rate["bytes_per_s"], 3)
                    run["durable_after_pause_over_write_time"] = round(
                        run["durable_after_pause_s"] / run["new_bytes_at_rate_s"], 3)
                    result["runs"][way].append(run)
                    print(f"{way}: pause {run['pause_s']:.2f}s, durable "
                          f"{run['durable_after_pause_s']:.2f}s after it (final fsync "
                          f"{run['pack_fsync_s']:.2f}s), "
                          f"{run['new_page_bytes'] / 1e9:.2f} GB new, disk "
                          f"{rate['bytes_per_s'] / 1e9:.2f} GB/s (direct "
                          f"{rate['direct_bytes_per_s'] / 1e9:.2f}) -> "
                          f"{run['durable_after_pause_over_write_time']:.2f}x its write time, "
                          f"load {run['load_1min']:.1f}", flush=True)
        finally:
            km.shutdown_kernel(now=True)
        for repeat in range(args.repeats if args.commit_gib else 0):
            order = list(WAYS) if repeat % 2 == 0 else list(reversed(WAYS))
            for way in order:
                done = commit_only(args.commit_gib, Path(tmp) / "store", WAYS[way])
                result["commit_only"][way].append(done)
                print(f"{way}, the commit alone: {done['commit_s']:.2f}s (final fsync "
                      f"{done['pack_fsync_s']:.2f}s), load {done['load_1min']:.1f}", flush=True)
    result["load_average_end"] = os.getloadavg()
    result["summary"] = {
        way: {key: summary(runs, key) for key in (
            "pause_s", "durable_after_pause_s", "pack_fsync_s", "new_bytes_at_rate_s",
            "durable_after_pause_over_write_time")}
        for way, runs in result["runs"].items()}
    if args.commit_gib:
        result["summary"]["commit_only"] = {
            way: {key: summary(runs, key) for key in ("commit_s", "pack_fsync_s")}
            for way, runs in result["commit_only"].items()}
    rates = [r["write_rate"]["bytes_per_s"] for runs in result["runs"].values() for r in runs]
    result["summary"]["write_rate_bytes_per_s"] = {"median": statistics.median(rates),
                                                   "min": min(rates), "max": max(rates)}
    direct = [r["write_rate"]["direct_bytes_per_s"] for runs in result["runs"].values()
              for r in runs]
    result["summary"]["direct_write_rate_bytes_per_s"] = {
        "median": statistics.median(direct), "min": min(direct), "max": max(direct)}
    print(json.dumps(result["summary"], indent=1))
    out = args.out or Path(__file__).parent / "results" / "writeback-cpu.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
