"""One large kernel restored by several criu builds in one run: stock criu, the previous
patch (one ``parallel-page-fill.patch``) and the series of ``scripts/criu-patches``.

One snapshot-ready kernel is saved once per layout (whole image files, and kept by
content, the store's default), keep-running, then killed; each snapshot is restored by
each build in turn, warm (the images in the page cache) and, with ``--cold``, cold (the
page cache dropped), ``--repeats`` times, builds interleaved. Every restore's state is
compared, and criu's log says how it filled the memory. The kernel is a CPU one holding
``--gib`` GiB of random numpy bytes, or the Llama-3.1-8B shape of ``bench_gpu.py`` on the
GPU (``--kernel llama8b``, with the CUDA hook and each build's own CUDA plugin).

    python benchmarks/bench_criu_builds.py --build stock=DIR --build old=DIR \\
        --build series=DIR --previous-protocol old [--kernel cpu --gib 4] \\
        [--layouts whole chunked] [--cold] [--repeats 3] [--out FILE]

A build's DIR holds ``criu`` (the binary, or a script that runs ``criu.bin`` beside it)
and ``libdir/``, its CUDA plugin and stand-in as ``scripts/install-criu.sh`` lays them out
(``criu/``, ``bin/``; needed for the GPU kernel only). The result is written after every
restore, so a run cut short keeps what it measured. The builds named by ``--previous-protocol``
are answered as the previous release's image streamer answered the old patch: a pages
image's runs asked for as "<image>@extents" and its files as "<image>@file/<k>"; the
others by this release's server, which hands a pages image over in place when criu's
request asks for it (``in_place``) and otherwise sends it through a pipe. Saves use the
last build.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_gpu import LLAMA_8B, STATE_CHECK, Kernel, first_cell
from common import CriuWithRestoreLog, host_facts, settle

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core import restore as restore_module
from jupyter_gpu_snapshot.core.compatibility import NodeCompatibility
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore, streamer
from jupyter_gpu_snapshot.core.store.packs import write_all
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from jupyter_gpu_snapshot.core.store.streamer_protocol import (
    ProtocolError,
    read_request,
    receive_pipe,
    send_reply,
)
from jupyter_gpu_snapshot.gpu.broker import PluginInstall
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.launch.kernelspec import install

CPU_STATE = """
import hashlib, numpy as np
block = np.random.default_rng(20261207).integers(0, 2**63, size=int({gib} * (1 << 30)) // 8,
                                                 dtype=np.int64)
def state_digest():
    return hashlib.sha256(block.tobytes()).hexdigest()
print(state_digest(), 0, 0)
"""
LAYOUTS = {"whole": False, "chunked": True}


@dataclass
class Build:
    name: str
    directory: Path
    criu: CriuWithRestoreLog
    previous_protocol: bool

    def identity(self) -> dict[str, Any]:
        criu = self.directory / "criu"
        # A carried build runs its binary through a script that finds its libraries.
        binary = self.directory / "criu.bin"
        binary = binary if binary.exists() else criu
        version = subprocess.run([str(criu), "--version"], capture_output=True, text=True)
        usage = subprocess.run([str(criu), "--help"], capture_output=True, text=True)
        return {"directory": self.directory.name,
                "version": version.stdout.splitlines()[0] if version.stdout else "",
                "sha256": hashlib.sha256(binary.read_bytes()).hexdigest(),
                "has_fill_workers_option": "--fill-workers" in usage.stdout,
                "previous_protocol": self.previous_protocol}


class PreviousReleaseServer(streamer.ImageStreamer):
    """The image streamer as the previous release answered its patch of criu: criu took a
    pages image's pipe first and left it unread, then asked for "<image>@extents" (rows of
    four little-endian 64-bit numbers on a pipe: the file's number, the offset in it, the
    offset in the image, the length) and for "<image>@file/<k>", each file handed over
    open. Everything else as this release serves it."""

    def _serve(self, conn: socket.socket) -> None:
        handed: dict[str, list[int]] = {}
        with conn:
            try:
                while (request := read_request(conn)) is not None:
                    base, at, spec = request.name.partition("@")
                    image = self._servable(base)
                    if image is not None and at and spec.startswith("file/"):
                        self._old_file(conn, handed.get(base, []), int(spec[5:]))
                        continue
                    if image is not None and at and (spec != "extents" or image.extents is None
                                                     or base in self._checked_first):
                        image = None
                    send_reply(conn, image is not None)
                    if image is None:
                        continue
                    pipe = receive_pipe(conn, base)
                    self._check_beside_once(image)
                    if at:
                        handed[base] = self._old_extents(image, pipe)
                    else:
                        self._start(self._send, base, image, pipe)
            except (OSError, ProtocolError):
                pass

    def _old_extents(self, image: streamer.ImageFile, pipe: int) -> list[int]:
        assert image.extents is not None
        try:
            fds, numbers = np.unique(image.extents[:, 0], return_inverse=True)
            table = np.column_stack([numbers.reshape(-1), image.extents[:, 1:]])
            with contextlib.suppress(BrokenPipeError):
                write_all(pipe, table.astype("<u8").tobytes())
            self.stats.extents_sent += len(table)
            return [int(fd) for fd in fds]
        finally:
            os.close(pipe)

    def _old_file(self, conn: socket.socket, fds: list[int], number: int) -> None:
        if number >= len(fds):
            send_reply(conn, False)
            return
        send_reply(conn, True)
        socket.send_fds(conn, [b"\0"], [fds[number]])
        self.stats.files_handed += 1
        self.stats.read_in_place += number == 0


@contextlib.contextmanager
def served_as(build: Build) -> Iterator[None]:
    """Within, restores are served as ``build``'s criu expects."""
    if not build.previous_protocol:
        yield
        return
    names = vars(restore_module)
    current = names["ImageStreamer"]
    names["ImageStreamer"] = PreviousReleaseServer
    try:
        yield
    finally:
        names["ImageStreamer"] = current


def engine_for(store: SnapshotStore, build: Build, gpu: bool) -> SnapshotEngine:
    """``build``'s engine for ``store``: with the CUDA hook and the build's own CUDA plugin
    for the GPU kernel."""
    if not gpu:
        return SnapshotEngine(store, build.criu.runner)
    cuda = CudaCheckpointHook(60.0, drop_caches=True,
                              plugin=PluginInstall(build.directory / "libdir"))
    return SnapshotEngine(store, build.criu.runner, [cuda], NodeCompatibility(gpus=cuda.node_gpus))


def kill(k: Kernel) -> None:
    procfs.kill_tree(k.root)
    deadline = time.monotonic() + 30
    while procfs.tree_alive(k.root) and time.monotonic() < deadline:
        time.sleep(0.1)
    while procfs.ports_in_use(k.info) and time.monotonic() < deadline + 90:
        time.sleep(0.5)


def restore_once(engine: SnapshotEngine, build: Build, k: Kernel, snap: Snapshot,
                 cold: bool) -> dict[str, Any]:
    """Kill the kernel, restore ``snap`` with ``build``: seconds to the restore and to the
    first cell's output, which must be the saved state. The restored kernel is ``k`` from
    here on."""
    kill(k)
    settle(cold=cold)
    with served_as(build):
        started = time.monotonic()
        back = asyncio.run(engine.restore(snap.id))
        restore_s = time.monotonic() - started
        k.root = back.pid
        _, printed = first_cell(k.info, STATE_CHECK)
        to_cell_s = time.monotonic() - started
    assert printed.strip() == k.checksum, f"{build.name}: the restored state differs"
    images = back.notes.get("images") or {}
    return {"cold": cold, "restore_s": round(restore_s, 3), "to_first_cell_s": round(to_cell_s, 3),
            "criu_s": round(back.timings.get("restore", 0.0), 3),
            "read_in_place": images.get("read_in_place"),
            "streamed_bytes": images.get("streamed_bytes"),
            "criu_fill": build.criu.fill_lines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--previous-protocol", action="append", default=[], metavar="NAME")
    parser.add_argument("--kernel", choices=["cpu", "llama8b"], default="cpu")
    parser.add_argument("--gib", type=float, default=4.0, help="the CPU kernel's numpy GiB")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--cold", action="store_true", help="cold restores too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu = args.kernel == "llama8b"
    install()
    with tempfile.TemporaryDirectory(prefix="jgs-bench-builds-") as tmp:
        work = Path(tmp)
        os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
        builds = []
        for spec in args.build:
            name, _, directory = spec.partition("=")
            builds.append(Build(name, Path(directory).resolve(),
                                CriuWithRestoreLog(work, str(Path(directory).resolve() / "criu"),
                                                   name=f"criu-{name}"),
                                name in args.previous_protocol))
        result: dict[str, Any] = {
            "benchmark": "criu-builds", "machine": host_facts(),
            "kernel": "Llama-3.1-8B shape (bench_gpu.LLAMA_8B)" if gpu
            else f"CPU, {args.gib} GiB of random numpy bytes",
            "builds": {b.name: b.identity() for b in builds},
            # A copy of the tree without its history (the GPU machine's) is told its commit.
            "commit": os.environ.get("JGS_BENCH_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                cwd=Path(__file__).parent).stdout.strip(),
            "saves": {}, "runs": {},
            # Other work on the machine slows every build alike, builds interleaved.
            "load_average_at_start": os.getloadavg(),
        }
        out = args.out or Path(__file__).parent / "results" / "criu-builds.json"
        k = Kernel(LLAMA_8B if gpu else CPU_STATE.format(gib=args.gib))
        try:
            stores = {layout: SnapshotStore(work / f"store-{layout}", chunk_images=chunked)
                      for layout, chunked in LAYOUTS.items() if layout in args.layouts}
            snaps = {}
            for layout, store in stores.items():
                settle()
                snap = asyncio.run(engine_for(store, builds[-1], gpu).save(
                    SaveTarget(pid=k.root, connection_info=k.info)))
                snaps[layout] = snap
                result["saves"][layout] = {"image_bytes": snap.size_bytes,
                                           "timings": snap.manifest["timings"]}
            temperatures = [False, True] if args.cold else [False]
            for _ in range(args.repeats):
                for build in builds:
                    for layout, store in stores.items():
                        engine = engine_for(store, build, gpu)
                        for cold in temperatures:
                            run = restore_once(engine, build, k, snaps[layout], cold)
                            key = f"{build.name}/{layout}/{'cold' if cold else 'warm'}"
                            result["runs"].setdefault(key, []).append(run)
                            summarize(result)
                            result["load_average_at_end"] = os.getloadavg()
                            out.write_text(json.dumps(result, indent=2))
                            print(f"{key}: restore {run['restore_s']:.2f}s, first cell "
                                  f"{run['to_first_cell_s']:.2f}s (criu {run['criu_s']:.2f}s): "
                                  + ("; ".join(run["criu_fill"]) or "criu alone"), flush=True)
        finally:
            k.end()
    print(json.dumps(result["median_to_first_cell_s"], indent=1))
    print(f"wrote {out}")


def summarize(result: dict[str, Any]) -> None:
    """Medians of each build, layout and temperature, and each build's over the others'."""
    runs = result["runs"]
    medians = {key: statistics.median(r["to_first_cell_s"] for r in rs) for key, rs in runs.items()}
    result["median_to_first_cell_s"] = medians
    result["median_restore_s"] = {key: statistics.median(r["restore_s"] for r in rs)
                                  for key, rs in runs.items()}
    ratios: dict[str, float] = {}
    for key, median in medians.items():
        build, case = key.split("/", 1)
        for other, other_median in medians.items():
            if other.endswith("/" + case) and other != key:
                name = f"{build} over {other.split('/')[0]}, {case}"
                ratios[name] = round(median / other_median, 3)
    result["ratio_to_first_cell"] = ratios


if __name__ == "__main__":
    main()
