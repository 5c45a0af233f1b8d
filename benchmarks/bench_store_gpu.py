"""Whole image files against the content-addressed store (``core/store/packs/``), on the GPU.

Both layouts in one run, whole images first, then chunked, each in a store of its own that
is deleted before the next layout starts (the GPU machine's disk is 64 GB):

- ``inference``: the Llama-3.1-8B-shaped kernel of ``bench_gpu.py`` (bf16 on the GPU) is
  saved, runs one forward pass, and is saved again. For the second save: the bytes written
  (chunked: the manifest's ``stored``; whole: the image), the pause, save -> durable (the
  commit done), then, the kernel killed and the page cache dropped, restore -> first cell
  output, cold (page cache dropped) and warm, with the image streamer's parts (bytes and
  rate of the store reads, hashing and criu's pipes) beside the machine's own floors
  measured in the same run (``common.machine_floors``). One kernel serves both layouts:
  the chunked layout starts from the kernel the whole layout restored.
- ``training``: a smaller Llama-shaped model (fp32 weights, about 1.5 GiB) with AdamW, saved
  four times with one optimizer step between saves; the same figures for each save, the
  disk the four snapshots hold (``du`` of the store, packs included), and each snapshot
  restored in turn, page cache dropped, its state digest compared; then the last one
  restored warm, and the machine's floors for its files.

Every save is keep-running, through the engine with the CUDA hook (allocator caches
dropped, the default). The commit's CPU parts are timed by wrapping the store's functions
in this process (the commit runs in a thread of it): whole-file digests, page ids, the
lookup and pack writes, the pack's fsync; and at restore the assembly.

    python benchmarks/bench_store_gpu.py [--workloads inference training] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_gpu import LLAMA_8B, STATE_CHECK, Kernel, first_cell, machine_info, pcie_rates
from common import CriuWithRestoreLog, fill_workers_set, machine_floors, settle

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.compatibility import NodeCompatibility
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.engine import SnapshotEngine
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore, images, streamer
from jupyter_gpu_snapshot.core.store.packs import (
    CHUNKS_DIR,
    ID_BYTES,
    PACK_SUFFIX,
    PAGE,
    PackWriter,
    PageStore,
    id_workers,
)
from jupyter_gpu_snapshot.core.store.snapshot import Snapshot
from jupyter_gpu_snapshot.gpu.broker import PluginInstall
from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.launch.kernelspec import install

GIB = 1 << 30
LAYOUTS = {"whole": False, "chunked": True}

# A narrower Llama in fp32 with AdamW: about 395 M parameters (1.47 GiB), two moments as
# much again each. Prints what bench_gpu.Kernel expects: digest, allocated, reserved, params.
TRAINING = """
import hashlib, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=32000, hidden_size={hidden}, intermediate_size={hidden} * 8 // 3,
    num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=4,
    tie_word_embeddings=False)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
prompt = torch.arange(1, 129, device="cuda").unsqueeze(0)
def step():
    loss = model(prompt, labels=prompt).loss
    loss.backward(); opt.step(); opt.zero_grad()
    torch.cuda.synchronize()
def state_digest():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1)[::1021].cpu().numpy().tobytes())
        for v in opt.state.get(p, {{}}).values():
            h.update(v.detach().reshape(-1)[::1021].cpu().numpy().tobytes())
    return h.hexdigest()
step()
params = sum(p.numel() for p in model.parameters())
print(state_digest(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), params)
"""
# A smaller inference kernel for a probe run (--small).
LLAMA_SMALL = LLAMA_8B.replace("hidden_size=4096", "hidden_size=2048").replace(
    "num_hidden_layers=32", "num_hidden_layers=8").replace("vocab_size=128256", "vocab_size=32000")


# -- the commit's and the restore's parts, timed in this process ------------------------------
PARTS: dict[str, float] = {}
# (owner, attribute, key): what each key times.
TIMED: list[tuple[Any, str, str]] = [
    (SnapshotStore, "commit", "store_commit"),  # digest_new + sign + rename + unlink
    (images, "digest_new", "digest_new"),  # whole files digested+fsynced, large ones chunked
    (images, "_digest", "whole_file_digests"),  # BLAKE3 of the files kept whole
    (PageStore, "chunk_files", "chunk_files"),  # every large file, pack, recipes
    (PageStore, "index", "read_index"),  # the store's page ids, sorted
    (PageStore, "_chunk_one", "chunk_one"),  # read + file digest + ids + new pages
    (PageStore, "_page_ids", "page_ids"),  # one keyed BLAKE3 per 4 KiB page
    (id_workers, "page_ids", "page_ids"),  # the same, where it is a function of the module
    (PageStore, "_ids", "page_ids_or_wait"),  # the ids of a block: from workers, or here
    (PageStore, "_store_new", "store_new"),  # lookup, dedup, gather, pack append
    (PackWriter, "append", "pack_write"),  # write(2) of the new pages
    (PackWriter, "finish", "pack_fsync"),  # fsync of the pack, ids written
    (streamer.ImageStreamer, "prepare", "images_checked_first"),  # restore: small files
    (PageStore, "collect", "collect"),  # delete: packs no recipe needs
]


def _wrap(owner: Any, attr: str, key: str) -> None:
    raw = owner.__dict__[attr]
    static = isinstance(raw, staticmethod)
    original: Callable[..., Any] = raw.__func__ if static else raw

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PARTS[key] = PARTS.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, attr, staticmethod(timed) if static else timed)


def time_parts() -> None:
    for owner, attr, key in TIMED:
        if attr in owner.__dict__:  # a part the code no longer has is left out
            _wrap(owner, attr, key)


class Measured:
    """Wall time, this process's CPU time (all threads) and its children's (criu), the
    parts above, and the bytes the disks wrote, over a block."""

    def __enter__(self) -> Measured:
        PARTS.clear()
        self.disk = disk_written()
        self.cpu = time.process_time()
        self.children = _children_cpu()
        self.wall = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.monotonic() - self.wall
        self.cpu_s = time.process_time() - self.cpu
        self.children_cpu_s = _children_cpu() - self.children
        self.parts = {k: round(v, 4) for k, v in PARTS.items()}
        os.sync()  # outside the timed region: what the block left dirty is written now
        self.disk_written_bytes = disk_written() - self.disk

    def figures(self) -> dict[str, Any]:
        return {"cpu_s": round(self.cpu_s, 3), "criu_cpu_s": round(self.children_cpu_s, 3),
                "parts_s": self.parts, "disk_written_bytes": self.disk_written_bytes}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def disk_written() -> int:
    """Bytes written to the machine's disks so far (/sys/block, whole disks only)."""
    total = 0
    for dev in Path("/sys/block").iterdir():
        if dev.name.startswith(("loop", "ram", "dm-", "zram", "nbd")):
            continue
        try:
            total += int((dev / "stat").read_text().split()[6]) * 512
        except (OSError, IndexError, ValueError):
            continue
    return total


def du(path: Path) -> int:
    """Bytes the tree takes on disk (allocated blocks, as ``du``)."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[0])


# -- saving and restoring -------------------------------------------------------------------
def make_engine(root: Path, chunked: bool, criu: CriuWithRestoreLog) -> SnapshotEngine:
    store = SnapshotStore(root, chunk_images=chunked)
    plugin = PluginInstall(Path(GPUSnapshot().libdir))
    cuda = CudaCheckpointHook(60.0, drop_caches=True, plugin=plugin)
    return SnapshotEngine(store, criu.runner, [cuda], NodeCompatibility(gpus=cuda.node_gpus))


def written(snapshot: Snapshot) -> int:
    """What the save added to the store: the image, or what ``stored`` counts (new pages,
    their ids, recipes, files kept whole)."""
    stored = snapshot.manifest.get("stored") or {}
    if "new_page_bytes" not in stored:
        return snapshot.size_bytes
    new = int(stored["new_page_bytes"])
    return (int(stored.get("whole_bytes", 0)) + new + int(stored.get("recipe_bytes", 0))
            + new // PAGE * ID_BYTES)


def save(engine: SnapshotEngine, k: Kernel) -> tuple[Snapshot, dict[str, Any]]:
    settle()
    with Measured() as m:
        snap = asyncio.run(engine.save(SaveTarget(pid=k.root, connection_info=k.info)))
    t = snap.manifest["timings"]
    image = snap.size_bytes
    rec = {
        "id": snap.id,
        "image_bytes": image,
        "bytes_written": written(snap),
        "written_over_image": written(snap) / image,
        "stored": snap.manifest.get("stored"),
        "pause_s": t["pause"],
        "save_to_durable_s": t["total"],
        "durable_over_pause_s": t["total"] - t["pause"],
        "commit_s": t["commit"],
        "timings": t,
        "cuda": (snap.manifest.get("gpu") or {}).get("timings"),
        "moved_bytes": (snap.manifest.get("gpu") or {}).get("moved_bytes"),
        "store_du_bytes": du(engine.store.root),
        **m.figures(),
    }
    return snap, rec


def kill(k: Kernel) -> None:
    procfs.kill_tree(k.root)
    deadline = time.monotonic() + 30
    while procfs.tree_alive(k.root) and time.monotonic() < deadline:
        time.sleep(0.1)


def restore(engine: SnapshotEngine, criu: CriuWithRestoreLog, k: Kernel, snap: Snapshot,
            expect: str, cold: bool = True, fill_workers: int | None = None) -> dict[str, Any]:
    """Kill the kernel, drop the page cache (``cold``, as after a reboot), restore ``snap``:
    seconds to the first cell's output, which must be ``expect``. The restored kernel is
    ``k`` from here on. Where the image time went: the image streamer's figures, each with
    its bytes and rate. ``fill_workers`` 1: criu fills the memory on one thread, as criu
    does without our patch (scripts/criu-patches); ``criu_fill``: what criu's log says of
    how it filled the memory."""
    kill(k)
    settle(cold=cold)
    with Measured() as m, fill_workers_set(fill_workers):
        started = time.monotonic()
        back = asyncio.run(engine.restore(snap.id))
        restored_s = time.monotonic() - started
        k.root = back.pid
        cell_s, printed = first_cell(k.info, STATE_CHECK)
        to_cell = time.monotonic() - started
    assert printed == expect, f"restored state differs: {printed!r} != {expect!r}"
    images = dict(back.notes.get("images") or {})
    # The check reads and hashes what it checks; the pipes carry what criu did not read in
    # place.
    checked = sum(images.get(f"checked_{when}_bytes", 0) for when in ("beside", "after"))
    for part, size in (("read", checked), ("hash", checked),
                       ("pipe", images.get("streamed_bytes", 0))):
        seconds = images.get(f"{part}_seconds", 0.0)
        images[f"{part}_bytes_per_s"] = round(size / seconds) if seconds else None
    criu_s = back.timings.get("restore", 0.0)
    images["criu_bytes_per_s"] = round(snap.size_bytes / criu_s) if criu_s else None
    return {"cold": cold, "fill_workers": fill_workers or "default",
            "restore_to_first_cell_s": to_cell, "restore_s": restored_s,
            "first_cell_s": cell_s, "image_bytes": snap.size_bytes, "images": images,
            "timings": back.timings, "criu_fill": criu.fill_lines(), "state_equal": True,
            **m.figures()}


def store_files(engine: SnapshotEngine, snap: Snapshot) -> list[Path]:
    """What a restore of ``snap`` reads: its packs where it is chunked, else its files."""
    packs = sorted((engine.store.root / CHUNKS_DIR).glob(f"*{PACK_SUFFIX}"))
    return packs or sorted(p for p in snap.path.iterdir() if p.is_file())


def run_cell(k: Kernel, code: str) -> str:
    _, printed = first_cell(k.info, code)
    return printed


def drop_store(engine: SnapshotEngine, snaps: list[Snapshot]) -> dict[str, Any]:
    with Measured() as m:
        for s in snaps:
            engine.store.delete(s.id)
    shutil.rmtree(engine.store.root, ignore_errors=True)
    return {"delete_s": m.wall_s, **m.figures()}


def inference(k: Kernel, layout: str, work: Path, criu: CriuWithRestoreLog) -> dict[str, Any]:
    engine = make_engine(work / f"store-{layout}", LAYOUTS[layout], criu)
    first, rec1 = save(engine, k)
    # One forward pass: the cell computes the logits of the prompt.
    digest = run_cell(k, STATE_CHECK)
    assert digest == k.checksum, "forward pass gave other logits"
    second, rec2 = save(engine, k)
    result: dict[str, Any] = {"save_1": rec1, "save_2": rec2}
    result["store_du_two_snapshots_bytes"] = du(engine.store.root)
    # Only the second snapshot is kept for its restore: a 16 GB image fewer on the disk.
    with Measured() as m:
        engine.store.delete(first.id)
    result["delete_first"] = {"delete_s": m.wall_s, **m.figures()}
    result["restore_2"] = restore(engine, criu, k, second, k.checksum)
    result["restore_2_warm"] = restore(engine, criu, k, second, k.checksum, cold=False)
    # The same restores with criu filling memory on one thread: its own way, in this run.
    result["restore_2_one_worker"] = restore(engine, criu, k, second, k.checksum, fill_workers=1)
    result["restore_2_one_worker_warm"] = restore(engine, criu, k, second, k.checksum, cold=False,
                                                  fill_workers=1)
    result["floors"] = machine_floors(store_files(engine, second))
    result["drop"] = drop_store(engine, [second])
    return result


def training(k: Kernel, layout: str, work: Path, criu: CriuWithRestoreLog,
             saves: int) -> dict[str, Any]:
    engine = make_engine(work / f"store-{layout}", LAYOUTS[layout], criu)
    snaps: list[tuple[Snapshot, str]] = []
    result: dict[str, Any] = {"saves": []}
    for i in range(saves):
        if i:
            run_cell(k, "step()")
        digest = run_cell(k, STATE_CHECK)
        snap, rec = save(engine, k)
        rec["state_digest"] = digest
        snaps.append((snap, digest))
        result["saves"].append(rec)
        print(f"  training {layout} save {i + 1}: {fmt_save(rec)}", flush=True)
    result["store_du_bytes"] = du(engine.store.root)
    result["chunks_du_bytes"] = du(engine.store.root / CHUNKS_DIR) if (
        engine.store.root / CHUNKS_DIR).exists() else 0
    result["images_sum_bytes"] = sum(s.size_bytes for s, _ in snaps)
    result["restores"] = []
    for i, (snap, digest) in enumerate(snaps):
        r = restore(engine, criu, k, snap, digest)
        result["restores"].append(r)
        print(f"  training {layout} restore {i + 1}: {fmt_restore(r)}", flush=True)
    # The last snapshot once more from the page cache, and the machine's floors for it.
    last, digest = snaps[-1]
    result["restore_last_warm"] = restore(engine, criu, k, last, digest, cold=False)
    print(f"  training {layout} restore {len(snaps)}, warm: "
          f"{fmt_restore(result['restore_last_warm'])}", flush=True)
    result["floors"] = machine_floors(store_files(engine, last))
    result["drop"] = drop_store(engine, [s for s, _ in snaps])
    return result


def fmt_save(r: dict[str, Any]) -> str:
    return (f"image {r['image_bytes'] / 1e9:.2f} GB, written {r['bytes_written'] / 1e9:.3f} GB "
            f"({r['written_over_image']:.1%}), pause {r['pause_s']:.2f}s, durable "
            f"{r['save_to_durable_s']:.2f}s (commit {r['commit_s']:.2f}s), disk wrote "
            f"{r['disk_written_bytes'] / 1e9:.2f} GB")


def fmt_restore(r: dict[str, Any]) -> str:
    return (f"restore->first cell {r['restore_to_first_cell_s']:.2f}s "
            f"(criu {r['timings'].get('restore', 0.0):.2f}s); criu filled: "
            + ("; ".join(r["criu_fill"]) or "on one thread"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="*", default=["inference", "training"],
                        choices=["inference", "training"])
    parser.add_argument("--saves", type=int, default=4, help="training saves")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="the store layouts to run, in this order")
    parser.add_argument("--small", action="store_true",
                        help="small kernels, to try the run end to end")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    time_parts()
    criu = CriuRunner()
    driver = LibcudaDriver()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    result: dict[str, Any] = {
        "benchmark": "store-whole-vs-chunked",
        "machine": machine_info(criu, driver),
        "pcie": pcie_rates(),
        "commit": os.environ.get("JGS_BENCH_COMMIT", head),
        "small": args.small,
        "cases": {},
    }
    out = args.out or Path(__file__).parent / "results" / "store-gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def flush() -> None:
        out.write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory(prefix="jgs-bench-store-") as tmp:
        work = Path(tmp)
        os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
        logged = CriuWithRestoreLog(work)
        if "inference" in args.workloads:
            case: dict[str, Any] = {"model": "Llama-3.1-8B-shaped LlamaForCausalLM, random "
                                    "bf16 weights" if not args.small else "small Llama, bf16"}
            result["cases"]["inference"] = case
            t = time.monotonic()
            k = Kernel(LLAMA_SMALL if args.small else LLAMA_8B)
            case["setup_s"] = time.monotonic() - t
            case["params"], case["allocated_bytes"] = int(k.extra[0]), k.allocated
            try:
                for layout in args.layouts:
                    case["disk_free_before_" + layout + "_gib"] = round(
                        shutil.disk_usage(tmp).free / GIB, 1)
                    case[layout] = inference(k, layout, work, logged)
                    flush()
                    r = case[layout]
                    print(f"inference {layout}: save 2: {fmt_save(r['save_2'])}; "
                          f"{fmt_restore(r['restore_2'])}", flush=True)
            finally:
                k.end()
            flush()
        if "training" in args.workloads:
            hidden, layers = (512, 4) if args.small else (1536, 12)
            case = {"model": f"Llama-shaped, hidden {hidden}, {layers} layers, fp32, AdamW",
                    "saves": args.saves}
            result["cases"]["training"] = case
            t = time.monotonic()
            k = Kernel(TRAINING.format(hidden=hidden, layers=layers))
            case["setup_s"] = time.monotonic() - t
            case["params"], case["allocated_bytes"] = int(k.extra[0]), k.allocated
            try:
                for layout in args.layouts:
                    case[layout] = training(k, layout, work, logged, args.saves)
                    flush()
                    r = case[layout]
                    print(f"training {layout}: {args.saves} snapshots hold "
                          f"{r['store_du_bytes'] / 1e9:.2f} GB on disk; images "
                          f"{r['images_sum_bytes'] / 1e9:.2f} GB", flush=True)
            finally:
                k.end()
            flush()
    result["summary"] = summary(result)
    flush()
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the targets are about."""
    s: dict[str, Any] = {}
    inf = result["cases"].get("inference", {})
    if "whole" in inf and "chunked" in inf:
        w, c = inf["whole"], inf["chunked"]
        s["inference_save_2"] = {
            layout: {
                "image_bytes": r["save_2"]["image_bytes"],
                "bytes_written": r["save_2"]["bytes_written"],
                "written_over_image": r["save_2"]["written_over_image"],
                "pause_s": r["save_2"]["pause_s"],
                "save_to_durable_s": r["save_2"]["save_to_durable_s"],
                "commit_s": r["save_2"]["commit_s"],
                "restore_to_first_cell_s": r["restore_2"]["restore_to_first_cell_s"],
                "restore_s": r["restore_2"]["restore_s"],
                "warm_restore_to_first_cell_s": r["restore_2_warm"]["restore_to_first_cell_s"],
                "one_worker_restore_to_first_cell_s":
                    r["restore_2_one_worker"]["restore_to_first_cell_s"],
                "one_worker_warm_restore_to_first_cell_s":
                    r["restore_2_one_worker_warm"]["restore_to_first_cell_s"],
                "images": r["restore_2"]["images"],
                "warm_images": r["restore_2_warm"]["images"],
                "floors": r["floors"],
            }
            for layout, r in (("whole", w), ("chunked", c))
        }
        cs = c["save_2"]
        s["targets"] = {
            "written_le_10pct_of_image": cs["written_over_image"] <= 0.10,
            "durable_le_pause_plus_1s": cs["save_to_durable_s"] <= cs["pause_s"] + 1.0,
            "chunked_within_0_5s_of_whole": c["restore_2"]["restore_to_first_cell_s"]
            <= w["restore_2"]["restore_to_first_cell_s"] + 0.5,
            "warm_restore_to_first_cell_le_10s":
                c["restore_2_warm"]["restore_to_first_cell_s"] <= 10.0,
            "cold_restore_to_first_cell_le_10s": c["restore_2"]["restore_to_first_cell_s"] <= 10.0,
            "cold_restore_reads_ge_80pct_of_the_disk":
                c["restore_2"]["image_bytes"] / c["restore_2"]["restore_s"]
                >= 0.8 * c["floors"]["store_read_cold"]["bytes_per_s"],
            "durable_le_pause_plus_5s": cs["save_to_durable_s"] <= cs["pause_s"] + 5.0,
        }
    tr = result["cases"].get("training", {})
    if "whole" in tr and "chunked" in tr:
        s["training"] = {
            layout: {
                "bytes_written": [r["bytes_written"] for r in tr[layout]["saves"]],
                "pause_s": [r["pause_s"] for r in tr[layout]["saves"]],
                "save_to_durable_s": [r["save_to_durable_s"] for r in tr[layout]["saves"]],
                "restore_to_first_cell_s": [r["restore_to_first_cell_s"]
                                            for r in tr[layout]["restores"]],
                "criu_s": [r["timings"].get("restore") for r in tr[layout]["restores"]],
                "store_du_bytes": tr[layout]["store_du_bytes"],
                "images_sum_bytes": tr[layout]["images_sum_bytes"],
            }
            for layout in ("whole", "chunked")
        }
    return s


if __name__ == "__main__":
    main()
