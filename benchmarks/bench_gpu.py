"""Save and restore of GPU kernels holding 1, 8 and 24 GiB of live tensors, against the raw
sequence (driver calls + criu CLI) on an identical process, in the same run.

For each size two python3-snapshot kernels get the same state: a live uint8 tensor of the
size, plus a quarter of it (at least 0.5 GiB) allocated and freed again, which PyTorch's
caching allocator keeps reserved. Then:

- ours, kernel A: save keep-running without cache dropping (pause, total, image); save
  stopping, restore, first executed cell; save keep-running with cache dropping (image);
- raw, kernel B: lock -> checkpoint -> criu dump --leave-running -> restore -> unlock
  (pause); the same stopping, then criu restore -> restore -> unlock -> first cell. This is
  the engine's sequence before CRIU's CUDA plugin took over the CUDA steps (it lets the
  threads run while CUDA is checkpointed, which JAX does not survive): ours must pause no
  longer than it.

The pinned host<->device copy rate is measured in the same run, so the checkpoint and
restore rates can be read as a fraction of it. Images are deleted after each step: the GPU
machine's disk is 64 GB.

    python benchmarks/bench_gpu.py [--sizes 1 8 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import settle
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.compatibility import NodeCompatibility
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.broker import PluginInstall
from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.gpu.inventory import read_inventory
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install

GIB = 1 << 30

SETUP = """
import torch
live = torch.randint(0, 256, ({live},), dtype=torch.uint8, device="cuda")
scratch = torch.empty({cached}, dtype=torch.uint8, device="cuda"); del scratch
torch.cuda.synchronize()
def state_digest():
    return str(int(live[::4096].sum()))
print(state_digest(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
"""

# A Llama-3.1-8B-shaped model (random bf16 weights, no download): what people hold in a
# notebook. Its state digest is the sha256 of the logits of a fixed prompt.
LLAMA_8B = """
import hashlib, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rope_theta=500000.0, tie_word_embeddings=False)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config).eval()
prompt = torch.arange(1, 65, device="cuda").unsqueeze(0)
def state_digest():
    with torch.no_grad():
        logits = model(prompt).logits.float().cpu()
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()
params = sum(p.numel() for p in model.parameters())
torch.cuda.synchronize()
print(state_digest(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), params)
"""
STATE_CHECK = "print(state_digest())"

PCIE = """
import json, torch
n = 4 << 30
host = torch.empty(n, dtype=torch.uint8).pin_memory()
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
def rate(copy):
    best = 0.0
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); copy(); end.record(); end.synchronize()
        best = max(best, n / (start.elapsed_time(end) / 1e3))
    return best
pageable = torch.ones(n, dtype=torch.uint8)
print(json.dumps({"h2d_bytes_per_s": rate(lambda: dev.copy_(host, non_blocking=True)),
                  "d2h_bytes_per_s": rate(lambda: host.copy_(dev, non_blocking=True)),
                  "h2d_pageable_bytes_per_s": rate(lambda: dev.copy_(pageable))}))
"""




def machine_info(criu: CriuRunner, driver: LibcudaDriver) -> dict[str, Any]:
    inventory = read_inventory()
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpus": [d.to_dict() for d in inventory.devices] if inventory else [],
        "driver": driver.info.version,
        "cuda_driver_version": driver.info.cuda_version,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / (1 << 20), 1),
        "linux": platform.release(),
        "criu": ".".join(map(str, criu.version())),
        "python": platform.python_version(),
        "disk_free_gib": round(shutil.disk_usage(tempfile.gettempdir()).free / GIB, 1),
    }


def pcie_rates() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PCIE], capture_output=True, text=True,
                         check=True)
    rates: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return rates


def first_cell(info: dict[str, Any], check: str = "1 + 1") -> tuple[float, str]:
    """Seconds until a fresh client has run one cell, and what it printed."""
    started = time.monotonic()
    client = BlockingKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    printed: list[str] = []
    try:
        client.wait_for_ready(timeout=300)
        reply = client.execute_interactive(
            check, timeout=300,
            output_hook=lambda m: printed.append(m["content"].get("text", ""))
            if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
    return time.monotonic() - started, "".join(printed).strip()


class Kernel:
    """A python3-snapshot kernel holding the benchmark's GPU state.

    ``setup`` defines ``state_digest()`` and prints it, then allocated and reserved bytes,
    then anything else (kept in ``extra``).
    """

    def __init__(self, setup: str) -> None:
        self.km = KernelManager(kernel_name=KERNEL_NAME)
        self.km.start_kernel()
        client = self.km.blocking_client()
        client.start_channels()
        client.wait_for_ready(timeout=120)
        out: list[str] = []
        reply = client.execute_interactive(
            setup, timeout=600,
            output_hook=lambda m: out.append(m["content"].get("text", ""))
            if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
        client.stop_channels()
        digest, allocated, reserved, *self.extra = "".join(out).split()
        self.checksum, self.allocated, self.reserved = digest, int(allocated), int(reserved)
        self.root = int(self.km.provisioner.root_pid)
        self.info = {k: v.decode() if isinstance(v, bytes) else v
                     for k, v in self.km.get_connection_info().items()}

    @property
    def pid(self) -> int:
        found = procfs.kernel_of(self.root)
        assert found is not None
        return int(found.pid)

    def end(self) -> None:
        if procfs.tree_alive(self.root):
            procfs.kill_tree(self.root)
        try:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
        except Exception as exc:  # the launched tree may be gone already (restored copy)
            print(f"note: shutting down the kernel manager: {exc}", file=sys.stderr)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ours(k: Kernel, work: Path, criu: CriuRunner) -> dict[str, Any]:
    store = SnapshotStore(work / "store")

    def engine(drop: bool) -> SnapshotEngine:
        plugin = PluginInstall(Path(GPUSnapshot().libdir))
        cuda = CudaCheckpointHook(60.0, drop_caches=drop, plugin=plugin)
        return SnapshotEngine(store, criu, [cuda], NodeCompatibility(gpus=cuda.node_gpus))

    result: dict[str, Any] = {}
    settle()
    kept = asyncio.run(engine(False).save(SaveTarget(pid=k.root, connection_info=k.info)))
    result["keep_running_no_drop"] = {
        "pause_s": kept.manifest["timings"]["pause"],
        "save_total_s": kept.manifest["timings"]["total"],
        "timings": kept.manifest["timings"],
        "cuda": kept.manifest["gpu"]["timings"],
        "image_bytes": kept.size_bytes,
        "moved_bytes": kept.manifest["gpu"]["moved_bytes"],
    }
    store.delete(kept.id)

    settle()
    stopped = asyncio.run(engine(False).save(SaveTarget(pid=k.root, connection_info=k.info),
                                             stop=True))
    settle(cold=True)
    started = time.monotonic()
    back = asyncio.run(engine(False).restore(stopped.id))
    cell_s, printed = first_cell(k.info, STATE_CHECK)
    assert printed == k.checksum, "restored state differs"
    result["stop_restore_no_drop"] = {
        "save_total_s": stopped.manifest["timings"]["total"],
        "save_timings": stopped.manifest["timings"],
        "image_bytes": stopped.size_bytes,
        "restore_timings": back.timings,
        "restore_to_first_cell_s": time.monotonic() - started,
        "first_cell_s": cell_s,
    }
    store.delete(stopped.id)
    k.root = back.pid  # the restored tree is the kernel from here on

    settle()
    dropped = asyncio.run(engine(True).save(SaveTarget(pid=k.root, connection_info=k.info)))
    result["keep_running_drop"] = {
        "pause_s": dropped.manifest["timings"]["pause"],
        "save_total_s": dropped.manifest["timings"]["total"],
        "image_bytes": dropped.size_bytes,
        "moved_bytes": dropped.manifest["gpu"]["moved_bytes"],
        "live_bytes": dropped.manifest["gpu"]["live_bytes"],
        "allocator_caches": dropped.manifest["gpu"]["allocator_caches"],
        "host_rss_bytes": procfs.tree_rss(k.root),
    }
    store.delete(dropped.id)
    return result


def raw_keep_running(k: Kernel, images: Path, criu: CriuRunner,
                     driver: LibcudaDriver) -> dict[str, Any]:
    """The sequence before CRIU's CUDA plugin: lock, checkpoint, dump, restore, unlock."""
    images.mkdir(parents=True)
    settle()
    t0 = time.monotonic()
    driver.lock(k.pid, 60_000)
    driver.checkpoint(k.pid)
    t1 = time.monotonic()
    subprocess.run(criu.dump_argv(k.root, images, images, leave_running=True), check=True)
    t2 = time.monotonic()
    driver.restore(k.pid)
    driver.unlock(k.pid)
    t3 = time.monotonic()
    kept = {"pause_s": t3 - t0, "suspend_s": t1 - t0, "dump_s": t2 - t1, "resume_s": t3 - t2,
            "image_bytes": dir_bytes(images)}
    shutil.rmtree(images)
    return kept


def raw(k: Kernel, work: Path, criu: CriuRunner, driver: LibcudaDriver) -> dict[str, Any]:
    result: dict[str, Any] = {"keep_running": raw_keep_running(k, work / "raw-kept", criu,
                                                               driver)}

    images = work / "raw-stopped"
    images.mkdir(parents=True)
    settle()
    driver.lock(k.pid, 60_000)
    driver.checkpoint(k.pid)
    subprocess.run(criu.dump_argv(k.root, images, images, leave_running=False), check=True)
    settle(cold=True)
    pidfile = images / "restore.pid"
    started = time.monotonic()
    subprocess.run(criu.restore_argv(images, images, pidfile), check=True)
    t_criu = time.monotonic() - started
    k.root = int(pidfile.read_text())
    driver.restore(k.pid)
    driver.unlock(k.pid)
    t_cuda = time.monotonic() - started - t_criu
    cell_s, printed = first_cell(k.info, STATE_CHECK)
    assert printed == k.checksum, "restored state differs (raw)"
    result["stop_restore"] = {"criu_restore_s": t_criu, "cuda_resume_s": t_cuda,
                              "restore_to_first_cell_s": time.monotonic() - started,
                              "first_cell_s": cell_s, "image_bytes": dir_bytes(images)}
    shutil.rmtree(images)
    return result


def pause_pairs(gib: float, repeat: int, work: Path, criu: CriuRunner,
                driver: LibcudaDriver) -> dict[str, Any]:
    """The pause of a keep-running save, ours and raw taken in turn on one kernel, ``repeat``
    times each, so that both meet the same disk and page cache; medians compared."""
    live = int(gib * GIB)
    k = Kernel(SETUP.format(live=live, cached=max(GIB // 2, live // 4)))
    store = SnapshotStore(work / "store")
    plugin = PluginInstall(Path(GPUSnapshot().libdir))
    cuda = CudaCheckpointHook(60.0, drop_caches=False, plugin=plugin)
    engine = SnapshotEngine(store, criu, [cuda], NodeCompatibility(gpus=cuda.node_gpus))
    ours: list[dict[str, float]] = []
    raws: list[dict[str, float]] = []
    try:
        for _ in range(repeat):
            settle()
            kept = asyncio.run(engine.save(SaveTarget(pid=k.root, connection_info=k.info)))
            ours.append({"pause_s": kept.manifest["timings"]["pause"],
                         **{f"cuda_{s}_s": v for s, v in kept.manifest["gpu"]["timings"].items()}})
            store.delete(kept.id)
            raws.append(raw_keep_running(k, work / "raw", criu, driver))
        _, printed = first_cell(k.info, STATE_CHECK)
        assert printed == k.checksum, "state differs after the pause pairs"
    finally:
        k.end()
    med_ours = statistics.median(r["pause_s"] for r in ours)
    med_raw = statistics.median(r["pause_s"] for r in raws)
    return {"live_gib": gib, "repeat": repeat, "ours": ours, "raw": raws,
            "pause_ours_median_s": med_ours, "pause_raw_median_s": med_raw,
            "pause_ratio_of_medians": med_ours / med_raw}


def bench_size(gib: float, work: Path, criu: CriuRunner, driver: LibcudaDriver,
               rates: dict[str, float], case: dict[str, Any], flush: Any) -> None:
    """Fill ``case`` step by step, calling ``flush`` after each so a cut-off run keeps data."""
    live = int(gib * GIB)
    cached = max(GIB // 2, live // 4)
    case.update(live_gib=gib, cached_scratch_bytes=cached)
    bench_kernel(SETUP.format(live=live, cached=cached), live, work, criu, driver, rates, case,
                 flush)


def bench_kernel(setup: str, live: int, work: Path, criu: CriuRunner, driver: LibcudaDriver,
                 rates: dict[str, float], case: dict[str, Any], flush: Any) -> None:
    """Ours, then raw, each on a fresh kernel made by ``setup``; then the summary."""
    k = Kernel(setup)
    try:
        case["allocated_bytes"], case["reserved_bytes"] = k.allocated, k.reserved
        case["kernel_extra"] = k.extra
        live = live or k.allocated  # a model: its allocated bytes are what it holds live
        case["ours"] = ours(k, work / "ours", criu)
    finally:
        k.end()
    flush()
    k = Kernel(setup)
    try:
        case["raw"] = raw(k, work / "raw", criu, driver)
    finally:
        k.end()
    o, r = case["ours"], case["raw"]
    kept, dropped = o["keep_running_no_drop"], o["keep_running_drop"]
    checkpoint_s = kept["cuda"].get("checkpoint", 0.0)
    restore_s = kept["cuda"].get("restore", 0.0)
    case["summary"] = {
        "pause_ours_s": kept["pause_s"],
        "pause_raw_s": r["keep_running"]["pause_s"],
        "pause_ratio": kept["pause_s"] / r["keep_running"]["pause_s"],
        "save_total_ours_s": kept["save_total_s"],
        "save_total_drop_s": dropped["save_total_s"],
        "commit_share_of_pause": kept["timings"]["commit"] / kept["pause_s"],
        "image_no_drop_bytes": kept["image_bytes"],
        "image_drop_bytes": dropped["image_bytes"],
        "image_raw_bytes": r["keep_running"]["image_bytes"],
        "image_drop_over_live_plus_rss": dropped["image_bytes"]
        / (live + dropped["host_rss_bytes"]),
        "restore_first_cell_ours_s": o["stop_restore_no_drop"]["restore_to_first_cell_s"],
        "restore_first_cell_raw_s": r["stop_restore"]["restore_to_first_cell_s"],
        # Digests are checked while criu restores the tree stopped: "verify" overlaps criu,
        # "verify_wait" is what the restore still waited for them.
        "restore_verify_s": o["stop_restore_no_drop"]["restore_timings"].get("verify", 0.0),
        "restore_verify_wait_s": o["stop_restore_no_drop"]["restore_timings"].get(
            "verify_wait", 0.0),
        "restore_over_raw_s": o["stop_restore_no_drop"]["restore_to_first_cell_s"]
        - r["stop_restore"]["restore_to_first_cell_s"],
        "checkpoint_rate_bytes_per_s": kept["moved_bytes"] / checkpoint_s if checkpoint_s else 0,
        "restore_rate_bytes_per_s": kept["moved_bytes"] / restore_s if restore_s else 0,
    }
    s = case["summary"]
    s["checkpoint_rate_of_pinned_d2h"] = s["checkpoint_rate_bytes_per_s"] / rates[
        "d2h_bytes_per_s"]
    s["restore_rate_of_pinned_h2d"] = s["restore_rate_bytes_per_s"] / rates["h2d_bytes_per_s"]
    flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[1, 8, 24])
    parser.add_argument("--llama8b", action="store_true",
                        help="also a kernel holding a Llama-3.1-8B-shaped model (random bf16)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pause-pairs", type=int, default=0, metavar="N",
                        help="only compare keep-running pauses, ours and raw in turn, N each")
    args = parser.parse_args()
    install()
    criu = CriuRunner()
    driver = LibcudaDriver()
    result: dict[str, Any] = {"benchmark": "gpu-save-restore",
                              "machine": machine_info(criu, driver), "cases": []}
    result["pinned_copy"] = pcie_rates()
    rates = result["pinned_copy"]
    print(f"pinned copy: H2D {rates['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"D2H {rates['d2h_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    out = args.out or Path(__file__).parent / "results" / (
        f"gpu-{datetime.now(timezone.utc).strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jgs-bench-gpu-") as tmp:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        if args.pause_pairs:
            result["benchmark"] = "gpu-pause-pairs"
            for gib in args.sizes:
                pairs = pause_pairs(gib, args.pause_pairs, Path(tmp) / f"pairs-{gib}", criu,
                                    driver)
                result["cases"].append(pairs)
                out.write_text(json.dumps(result, indent=2))
                print(f"{gib:>4} GiB: pause median ours {pairs['pause_ours_median_s']:.2f}s, "
                      f"raw {pairs['pause_raw_median_s']:.2f}s "
                      f"(x{pairs['pause_ratio_of_medians']:.3f}) over {args.pause_pairs} each",
                      flush=True)
            print(f"wrote {out}")
            return
        for gib in args.sizes:
            free = shutil.disk_usage(tmp).free
            # One image at a time: the GPU bytes (live + cached) plus host memory and margin.
            if free < 1.4 * 1.25 * gib * GIB + 4 * GIB:
                result["cases"].append({"live_gib": gib, "skipped": f"{free / GIB:.0f} GiB "
                                        "free disk is too little for its images"})
                continue
            case: dict[str, Any] = {}
            result["cases"].append(case)
            bench_size(gib, Path(tmp) / f"case-{gib}", criu, driver, rates, case,
                       lambda: out.write_text(json.dumps(result, indent=2)))
            s = case["summary"]
            print(
                f"{gib:>4} GiB: pause ours {s['pause_ours_s']:.2f}s raw {s['pause_raw_s']:.2f}s "
                f"(x{s['pause_ratio']:.3f}); save total {s['save_total_ours_s']:.2f}s; image "
                f"{s['image_no_drop_bytes'] / GIB:.2f} GiB, dropped "
                f"{s['image_drop_bytes'] / GIB:.2f} GiB (x{s['image_drop_over_live_plus_rss']:.2f}"
                f" of live+RSS); restore->cell ours {s['restore_first_cell_ours_s']:.2f}s "
                f"(verify {s['restore_verify_s']:.2f}s overlapped, waited "
                f"{s['restore_verify_wait_s']:.2f}s) raw {s['restore_first_cell_raw_s']:.2f}s;"
                f" checkpoint {s['checkpoint_rate_of_pinned_d2h']:.0%} of pinned D2H, restore "
                f"{s['restore_rate_of_pinned_h2d']:.0%} of pinned H2D",
                flush=True,
            )
        if args.llama8b:
            case = {"model": "Llama-3.1-8B-shaped LlamaForCausalLM, random bf16 weights",
                    # The CRIUgpu paper's figures for this model on one H100, for comparison.
                    "criugpu_paper": {"checkpoint_s": 77.4, "restore_s": 38.8, "image_gb": 55.9}}
            result["cases"].append(case)
            bench_kernel(LLAMA_8B, 0, Path(tmp) / "case-llama8b", criu, driver, rates, case,
                         lambda: out.write_text(json.dumps(result, indent=2)))
            s, dropped = case["summary"], case["ours"]["keep_running_drop"]
            print(f"llama-8b ({case['kernel_extra'][0]} params): save to durable "
                  f"{s['save_total_drop_s']:.1f}s (pause {dropped['pause_s']:.1f}s), "
                  f"restore->cell {s['restore_first_cell_ours_s']:.1f}s, raw "
                  f"{s['restore_first_cell_raw_s']:.1f}s; image "
                  f"{s['image_drop_bytes'] / 1e9:.1f} GB", flush=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
