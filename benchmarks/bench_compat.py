"""What the node-compatibility record costs: digests of the kernel's mapped files at save,
with the digest cache empty (the first save of an engine) and full (every later save), and
the check at restore.

One snapshot-ready kernel with numpy (and, with ``--torch``, torch) imported is saved
``--repeats`` times by a fresh engine (cold cache) and as often again by one engine whose
cache the first of those saves filled. The digests run in a thread while the kernel is
dumped; what a save pays is the wait at commit (``environment_wait``). The mapped files are
in the page cache on both sides (a running kernel uses them), so this is the cost of hashing,
not of reading a cold disk.

    python benchmarks/bench_compat.py [--repeats 3] [--torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import host_facts
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.compatibility import NodeCompatibility
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install


class WithoutDigests(NodeCompatibility):
    """The baseline: a save that digests no file, to see what the digests add to the pause."""

    def record_files(self, paths: Any, cancel: Any = None) -> dict[str, Any]:
        return super().record_files([], cancel)


def save_once(engine: SnapshotEngine, root: int, info: dict[str, Any]) -> dict[str, float]:
    snapshot = asyncio.run(engine.save(SaveTarget(pid=root, connection_info=info)))
    timings = snapshot.manifest["timings"]
    checks = {}
    # A restore on another node starts with an empty cache; on this node the save filled it.
    compats = [("cold", NodeCompatibility()), ("cached", engine.compatibility)]
    for label, compat in compats if not isinstance(engine.compatibility, WithoutDigests) else []:
        started = time.monotonic()
        findings = compat.differences(snapshot.manifest)
        checks[f"restore_check_{label}_s"] = time.monotonic() - started
        assert not findings.refusals, findings.refusals
    engine.delete(snapshot.id)
    return {"digest_thread_s": timings["environment"],
            "commit_waited_s": timings["environment_wait"],
            "pause_s": timings["pause"], "save_total_s": timings["total"], **checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="import torch in the kernel too")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    with tempfile.TemporaryDirectory(prefix="jgs-bench-compat-") as tmp:
        work = Path(tmp)
        os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
        km = KernelManager(kernel_name=KERNEL_NAME)
        km.start_kernel()
        try:
            client = km.blocking_client()
            client.start_channels()
            client.wait_for_ready(timeout=60)
            code = "import numpy as np; a = np.ones(1000)" + ("; import torch" * args.torch)
            client.execute_interactive(code, timeout=600)
            client.stop_channels()
            root = km.provisioner.root_pid
            info = {k: (v.decode() if isinstance(v, bytes) else v)
                    for k, v in km.get_connection_info().items()}
            mapped = procfs.mapped_files(root)
            store = SnapshotStore(work / "store", work / "signing.key")
            baseline = [save_once(SnapshotEngine(store, compatibility=WithoutDigests()), root,
                                  info) for _ in range(args.repeats)]
            cold = [save_once(SnapshotEngine(store, compatibility=NodeCompatibility()), root, info)
                    for _ in range(args.repeats)]
            warm_engine = SnapshotEngine(store)
            save_once(warm_engine, root, info)  # fills the cache
            warm = [save_once(warm_engine, root, info) for _ in range(args.repeats)]
        finally:
            km.shutdown_kernel(now=True)

    def median(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}

    result = {
        "benchmark": "compat-mapped-file-digests",
        "machine": host_facts(),
        "kernel": "numpy" + (" + torch" if args.torch else ""),
        "mapped_files": len(mapped),
        "mapped_bytes": sum(os.path.getsize(p) for p in mapped),
        "repeats": args.repeats,
        "without_digests": {"samples": baseline, "median": median(baseline)},
        "cold_cache": {"samples": cold, "median": median(cold)},
        "cached": {"samples": warm, "median": median(warm)},
    }
    b = result["without_digests"]["median"]
    c, w = result["cold_cache"]["median"], result["cached"]["median"]
    print(f"{result['mapped_files']} mapped files, {result['mapped_bytes'] / 1e6:.0f} MB: "
          f"digests cold {c['digest_thread_s']:.3f}s (commit waited {c['commit_waited_s']:.3f}s),"
          f" cached {w['digest_thread_s']:.3f}s (waited {w['commit_waited_s']:.3f}s); "
          f"restore check cold {c['restore_check_cold_s']:.3f}s cached "
          f"{w['restore_check_cached_s']:.3f}s; pause {c['pause_s']:.2f}s / "
          f"{w['pause_s']:.2f}s (without digests {b['pause_s']:.2f}s); save total "
          f"{c['save_total_s']:.2f}s / {w['save_total_s']:.2f}s ({b['save_total_s']:.2f}s)")
    out = args.out or Path(__file__).parent / "results" / (
        f"compat-{datetime.now(timezone.utc).strftime('%Y%m%d')}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
