"""The portable copy of a kernel's namespace against ``torch.save``, for a Llama-3.1-8B-shaped
model on the GPU machine.

One python3-snapshot kernel holds ``LlamaForCausalLM`` with the real Llama-3.1-8B shapes
(``bench_gpu.LLAMA_8B``: 32 layers of q/k/v/o and gate/up/down projections and their norms,
untied 128256 x 4096 embeddings and LM head; 8.03 B parameters, 16.06 GB of bf16 on the
GPU; random weights, no download). In the same run, to the same disk (the store's):

- ``torch.save(model.state_dict(), path)`` inside the kernel, then the file's fsync, each
  timed; and the portable copy written inside the kernel by the code a save asks the kernel
  to run (``kernel.portable.write_portable``), then its files' fsync; alternated, best of
  ``--repeat``;
- the product's save, ``jupyter gpu-snapshot save --kernel-id ID --portable --stop --json``:
  the manifest's ``timings["portable"]`` (the kernel writing its copy into the save's
  directory, before the pause) and the whole save (image and copy, digested, durable);
- the fallback, ``jupyter gpu-snapshot restore NAME --fallback portable``, page cache
  dropped first: its phases timed from the CLI's progress lines (a fresh kernel started,
  the copy assembled and checked, loaded onto the GPU), then the model's bytes compared
  in the fresh kernel with those it had (a fingerprint of every tensor, and the logits of a
  fixed prompt);
- the machine's limits: the disk's sequential write (``dd`` of 4 GiB, ``conv=fsync``) and
  cold read, and the copy rates between the GPU and pinned or pageable host memory.

The target: the portable copy takes at most 1.5 times what ``torch.save`` takes.

    python benchmarks/bench_portable.py [--small] [--repeat 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from bench_gpu import LLAMA_8B, machine_info
from common import host_facts, read_rate, settle
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.criu import CriuRunner
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, install

GIB = 1 << 30
TARGET = 1.5
# A probe run's model: the same code, narrower and shallower (about 1.3 GB of bf16).
LLAMA_SMALL = LLAMA_8B.replace("hidden_size=4096", "hidden_size=2048").replace(
    "num_hidden_layers=32", "num_hidden_layers=8").replace("vocab_size=128256", "vocab_size=32000")

# Every tensor's bytes, summed on the GPU with position weights (a swapped or changed byte
# changes its sum), hashed by name: the whole model compared without 16 GB through the CPU.
# Underscored, so that no portable copy carries it.
FINGERPRINT = """
import hashlib as _hashlib, torch as _torch
def _fingerprint(module):
    digest = _hashlib.sha256()
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().contiguous().reshape(-1).view(_torch.uint8)
        total = 0
        for start in range(0, flat.numel(), 1 << 26):
            part = flat[start:start + (1 << 26)].to(_torch.int64)
            weights = _torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
            total += int((part * weights).sum())
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{total};".encode())
    return digest.hexdigest()
import json as _json
print(_json.dumps({"fingerprint": _fingerprint(model), "logits": state_digest(),
                   "devices": sorted({str(p.device) for p in model.parameters()}),
                   "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                   "tensors": len(model.state_dict()),
                   "bytes": sum(t.numel() * t.element_size()
                                for t in model.state_dict().values())}))
"""

TORCH_SAVE = """
import os as _os, time as _time
_t = _time.perf_counter()
torch.save(model.state_dict(), {path!r})
_written = _time.perf_counter() - _t
_fd = _os.open({path!r}, _os.O_RDONLY); _os.fsync(_fd); _os.close(_fd)
print(_written, _time.perf_counter() - _t, _os.path.getsize({path!r}))
"""

PORTABLE_WRITE = """
import os as _os, time as _time, pathlib as _pathlib
from jupyter_gpu_snapshot.kernel import portable as _portable
_t = _time.perf_counter()
_copy = _portable.write_portable({{"model": model}}, _pathlib.Path({path!r}))
_written = _time.perf_counter() - _t
for _name in _copy["files"]:
    _fd = _os.open(_os.path.join({path!r}, _name), _os.O_RDONLY); _os.fsync(_fd); _os.close(_fd)
print(_written, _time.perf_counter() - _t, _copy["bytes"])
"""

# In a process of its own, so that its pinned buffers never enter the kernel's image.
COPY_RATES = """
import json, time, torch
n = 4 << 30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
pageable = torch.ones(n, dtype=torch.uint8)
def rate(copy):
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); copy(); torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t))
    return round(best)
print(json.dumps({
    "d2h_pinned_bytes_per_s": rate(lambda: pinned.copy_(dev, non_blocking=True)),
    "d2h_pageable_bytes_per_s": rate(lambda: pageable.copy_(dev)),
    "h2d_pinned_bytes_per_s": rate(lambda: dev.copy_(pinned, non_blocking=True)),
    "h2d_pageable_bytes_per_s": rate(lambda: dev.copy_(pageable)),
}))
"""


class Kernel:
    """A python3-snapshot kernel whose connection file is where the CLI finds it by id."""

    def __init__(self, runtime: Path) -> None:
        self.id = str(uuid.uuid4())
        self.km = KernelManager(kernel_name=KERNEL_NAME,
                                connection_file=str(runtime / f"kernel-{self.id}.json"))
        self.km.start_kernel()
        self.client = self.km.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 900) -> str:
        return execute(self.client, code, timeout)

    def end(self) -> None:
        self.client.stop_channels()
        root = getattr(self.km.provisioner, "root_pid", None)
        if root and procfs.tree_alive(int(root)):
            procfs.kill_tree(int(root))
        try:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
        except Exception as exc:  # the save ended its tree already
            print(f"note: shutting down the kernel manager: {exc}", file=sys.stderr)


def execute(client: BlockingKernelClient, code: str, timeout: float) -> str:
    printed: list[str] = []
    errors: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            errors.append("\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel failed: {''.join(errors)[-3000:]}")
    return "".join(printed).strip()


def cli(store: Path, *args: str) -> tuple[str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), *args],
        capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"jupyter gpu-snapshot {args[0]} failed: {done.stderr[-3000:]}")
    return done.stdout, round(seconds, 3)


def fall_back(store: Path, name: str) -> tuple[dict[str, float], list[str], Path]:
    """``restore NAME --fallback portable``, timed line by line: its phases (seconds from
    the command's start to each progress line), what it printed, its kernel's connection
    file."""
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), "restore",
         name, "--fallback", "portable"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    seen: dict[str, float] = {}
    lines: list[str] = []
    for line in process.stdout:
        now = round(time.monotonic() - started, 3)
        lines.append(line.rstrip())
        for key, start in (("kernel_starting", "starting a fresh"),
                           ("checking", "checking the portable copy"),
                           ("loading", "loading the portable copy")):
            if line.startswith(start):
                seen[key] = now
        if not line.startswith(("starting", "checking", "loading")):
            seen.setdefault("loaded", now)  # the report's first line: the load is done
    stderr = process.stderr.read() if process.stderr else ""
    if process.wait() != 0:
        raise RuntimeError(f"restore --fallback failed: {stderr[-3000:]}")
    seen["total"] = round(time.monotonic() - started, 3)
    connect = next(line for line in lines if line.startswith("connect with:"))
    return seen, lines, Path(connect.split("--existing ", 1)[1])


def end_kernel_of(connection_file: Path) -> None:
    """End the standalone kernel that listens on the connection file's shell port."""
    port = int(json.loads(connection_file.read_text())["shell_port"])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.pid and conn.laddr and conn.laddr.port == port \
                and conn.status == psutil.CONN_LISTEN:
            procfs.kill_tree(procfs.namespace_init(conn.pid) or conn.pid)
    connection_file.unlink(missing_ok=True)


def disk_write(directory: Path, size: int = 4 * GIB) -> dict[str, Any]:
    """``dd`` of ``size`` zero bytes into ``directory``, fsynced before it returns; then
    the file's cold sequential read (``common.read_rate``)."""
    path = directory / "dd.bin"
    settle(cold=True)
    started = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={size >> 24}",
                    "conv=fsync"], check=True, capture_output=True)
    seconds = time.monotonic() - started
    read = read_rate([path], cold=True)
    path.unlink()
    return {"write": {"bytes": size, "seconds": round(seconds, 3),
                      "bytes_per_s": round(size / seconds)},
            "read_cold": read}


def copy_rates() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", COPY_RATES], capture_output=True, text=True,
                         check=True)
    rates: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return rates


def timed_writes(k: Kernel, work: Path, repeat: int) -> dict[str, Any]:
    """torch.save and the portable copy, alternated, each into a fresh place on the disk."""
    runs: dict[str, list[dict[str, float]]] = {"torch_save": [], "portable": []}
    for _ in range(repeat):
        for kind, code in (("torch_save", TORCH_SAVE), ("portable", PORTABLE_WRITE)):
            target = work / kind
            if kind == "portable":
                target.mkdir()
            else:
                target = target.with_suffix(".pt")
            settle(cold=True)
            written, durable, size = k.run(code.format(path=str(target))).split()
            runs[kind].append({"written_s": round(float(written), 3),
                               "fsynced_s": round(float(durable), 3), "bytes": int(size)})
            print(f"{kind}: {float(written):.1f}s written, {float(durable):.1f}s with fsync, "
                  f"{int(size) / 1e9:.2f} GB", flush=True)
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
            os.sync()
    best = {kind: {"written_s": min(r["written_s"] for r in rs),
                   "fsynced_s": min(r["fsynced_s"] for r in rs), "bytes": rs[0]["bytes"]}
            for kind, rs in runs.items()}
    return {"runs": runs, "best": best}


def gpu_tag(machine: dict[str, Any]) -> str:
    names = [str(g.get("name", "")) for g in machine.get("gpus", [])]
    found = re.search(r"\b([A-Z]\d{2,4})\b", names[0]) if names else None
    return found[1].lower() if found else "gpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="a probe: a smaller Llama-shaped model (about 1.3 GB)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="torch.save and the in-kernel copy, each this many times")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install()
    machine = {**host_facts(), **machine_info(CriuRunner(), LibcudaDriver())}
    result: dict[str, Any] = {
        "benchmark": "portable-copy",
        "machine": machine,
        "model": ("Llama-3.1-8B-shaped LlamaForCausalLM (transformers), random bf16 weights"
                  if not args.small else "a smaller Llama-shaped model (probe)"),
    }
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = args.out or Path(__file__).parent / "results" / (
        f"portable-{gpu_tag(machine)}-{date}{'-small' if args.small else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    result["copy_rates"] = copy_rates()
    print(f"copy rates: {result['copy_rates']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="jgs-bench-portable-") as tmp:
        root = Path(tmp)
        runtime, work, store = root / "runtime", root / "work", root / "store"
        for path in (runtime, work, store):
            path.mkdir()
        os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
        os.environ["JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE"] = str(root / "signing.key")
        result["disk"] = {**disk_write(store), "free_bytes": shutil.disk_usage(store).free,
                          "directory": "the store's"}
        print(f"disk: {result['disk']}", flush=True)
        keep()

        k = Kernel(runtime)
        try:
            started = time.monotonic()
            built = k.run(LLAMA_8B if not args.small else LLAMA_SMALL).split()
            result["build_s"] = round(time.monotonic() - started, 1)
            result["parameters"] = int(built[3])
            before = json.loads(k.run(FINGERPRINT))
            result["model_bytes"] = before["bytes"]
            result["tensors"] = before["tensors"]
            print(f"model: {before['bytes'] / 1e9:.2f} GB in {before['tensors']} tensors on "
                  f"{before['devices']}", flush=True)
            result["in_kernel"] = timed_writes(k, work, args.repeat)
            keep()
            settle(cold=True)
            saved, save_s = cli(store, "save", "--kernel-id", k.id, "--name", "llama",
                                "--portable", "--stop", "--json")
        finally:
            k.end()
        summary = json.loads(saved)
        manifest = SnapshotStore(store).get(summary["id"]).manifest
        portable = manifest["portable"]
        timings = summary["timings"]
        result["product_save"] = {
            "cli_s": save_s,
            "timings": timings,
            "portable_s": timings["portable"],
            "portable_bytes": portable["bytes"],
            "portable_kernel_seconds": portable["seconds"],
            "carried": [[e["name"], e["kind"], e["bytes"], e["devices"]]
                        for e in portable["carried"]],
            "not_carried": portable["not_carried"],
            "snapshot_bytes": summary["size_bytes"],
            "stored": manifest.get("stored"),
            "gpu_moved_bytes": (manifest.get("gpu") or {}).get("moved_bytes"),
        }
        print(f"save --portable: copy {timings['portable']:.1f}s, whole save "
              f"{timings['total']:.1f}s ({save_s:.1f}s through the CLI)", flush=True)
        keep()

        settle(cold=True)
        phases, lines, connection_file = fall_back(store, "llama")
        try:
            client = BlockingKernelClient()
            client.load_connection_file(str(connection_file))
            client.start_channels()
            client.wait_for_ready(timeout=120)
            after = json.loads(execute(client, FINGERPRINT, 900))
            client.stop_channels()
        finally:
            end_kernel_of(connection_file)
        result["fallback"] = {
            "phases_at_s": phases,
            "kernel_start_s": round(phases["checking"] - phases["kernel_starting"], 3),
            "check_s": round(phases["loading"] - phases["checking"], 3),
            "load_s": round(phases["loaded"] - phases["loading"], 3),
            # Without the connection file's path: a temporary directory of this run.
            "printed": [line for line in lines if not line.startswith("connect with:")],
            "fingerprint_equal": after["fingerprint"] == before["fingerprint"],
            "logits_equal": after["logits"] == before["logits"],
            "devices": after["devices"],
            "dtypes": after["dtypes"],
            "page_cache": "dropped before the restore",
        }
        print(f"fallback: {phases}, bitwise {result['fallback']['fingerprint_equal']}",
              flush=True)

    best = result["in_kernel"]["best"]
    torch_save, copy = best["torch_save"], best["portable"]
    product = result["product_save"]["portable_s"]
    result["summary"] = {
        "model_bytes": result["model_bytes"],
        "torch_save_s": torch_save["written_s"],
        "torch_save_fsync_s": torch_save["fsynced_s"],
        "portable_s": copy["written_s"],
        "portable_fsync_s": copy["fsynced_s"],
        "product_portable_s": product,
        "product_save_total_s": result["product_save"]["timings"]["total"],
        "fallback_total_s": result["fallback"]["phases_at_s"]["total"],
        "fallback_load_s": result["fallback"]["load_s"],
        "portable_over_torch_save": round(copy["written_s"] / torch_save["written_s"], 3),
        "portable_over_torch_save_fsync": round(copy["fsynced_s"] / torch_save["fsynced_s"], 3),
        "product_portable_over_torch_save": round(product / torch_save["written_s"], 3),
        "product_portable_over_torch_save_fsync": round(product / torch_save["fsynced_s"], 3),
        "portable_fsync_bytes_per_s": round(copy["bytes"] / copy["fsynced_s"]),
        "disk_write_bytes_per_s": result["disk"]["write"]["bytes_per_s"],
        "d2h_pinned_bytes_per_s": result["copy_rates"]["d2h_pinned_bytes_per_s"],
        "bitwise_equal_after_fallback": result["fallback"]["fingerprint_equal"],
        "target": f"portable copy <= {TARGET}x torch.save",
    }
    s = result["summary"]
    s["target_met"] = (s["portable_over_torch_save_fsync"] <= TARGET
                       and s["product_portable_over_torch_save"] <= TARGET)
    keep()
    print(json.dumps(s, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
