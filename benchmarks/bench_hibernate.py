"""Hibernation on the GPU machine: the GPU memory an idle kernel frees, and what its next
cell waits for, in each tier.

A real ``jupyter server`` with the extension; for each framework a notebook kernel builds
its GPU state and prints its digest. Then, per case and per tier (``gpu`` first: the GPU
released, the process kept; then ``process``: saved and ended, the wake a plain restore,
in the same run):

1. the kernel hibernates (``POST kernels/{id}/hibernate``), and ``nvidia-smi`` reads the
   GPU's used memory before and after;
2. another process allocates most of the freed memory, uses it and exits;
3. a cell sent over the notebook's websocket wakes the kernel: the time from its
   execute_request to the first output the kernel itself prints is set against the wake
   job's own restore (the engine's restore of the same snapshot, in the same run), and the
   digest must equal the one printed before.

``move`` (a tier for this benchmark): the kernel sleeps in the gpu tier, then moves to the
process tier (timed from that request; its GPU is not touched again), and the cell wakes it
from the snapshot the move wrote.

    python benchmarks/bench_hibernate.py [--cases torch4,jax,cupy,torch] [--tiers gpu,process,move]
                                         [--small] [--out FILE]
    python benchmarks/bench_hibernate.py --cases numpy     # CPU: checks the benchmark itself
    python benchmarks/bench_hibernate.py --turns           # three kernels take turns on GPU 0

``--turns``: three PyTorch kernels, each holding 40 % of GPU 0's memory (two fit at once),
answer cells in turn, twice round; each cell's kernel wakes (the gpu tier) after the least
recently used idle one gives its memory back. Each cell's time to its first output, and its
digest against the one printed before the kernel first slept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench_gpu import LLAMA_8B
from server_process import Server
from tornado.websocket import websocket_connect

from jupyter_gpu_snapshot.launch.kernelspec import install

GIB = 1 << 30
LLAMA_SMALL = LLAMA_8B.replace("hidden_size=4096", "hidden_size=2048").replace(
    "num_hidden_layers=32", "num_hidden_layers=8").replace("vocab_size=128256", "vocab_size=32000")
JAX = """
import hashlib, jax, jax.numpy as jnp, numpy as np
x = jax.random.normal(jax.random.key(0), ({n},), dtype=jnp.float32)
def state_digest():
    # The bytes themselves (every 257th value), then a reduction computed on the GPU.
    h = hashlib.sha256(np.asarray(x[::257]).tobytes())
    h.update(np.asarray(jnp.cumsum(x[: 1 << 20])).tobytes())
    return h.hexdigest()
print(state_digest())
"""
CUPY = """
import hashlib, cupy as cp
x = cp.random.default_rng(0).standard_normal({n}, dtype=cp.float32)
def state_digest():
    # The bytes themselves (every 257th value), then an elementwise kernel's result: CuPy's
    # float cumsum and sum are not bitwise repeatable from one call to the next.
    h = hashlib.sha256(x[::257].get().tobytes())
    h.update((x[: 1 << 20] * 3 + 1).get().tobytes())
    return h.hexdigest()
assert state_digest() == state_digest()  # the digest itself is repeatable
print(state_digest())
"""
TORCH4 = """
import hashlib, torch
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn({n}, device="cuda", generator=g)
def state_digest():
    h = hashlib.sha256(x[::257].cpu().numpy().tobytes())
    h.update((x[: 1 << 20] * 3 + 1).cpu().numpy().tobytes())
    return h.hexdigest()
print(state_digest())
"""
# A CPU-only case, to check the benchmark itself on a machine without a GPU.
NUMPY = """
import hashlib, numpy as np
x = np.random.default_rng(0).standard_normal({n}, dtype=np.float32)
def state_digest():
    return hashlib.sha256(np.cumsum(x[: 1 << 20]).tobytes()).hexdigest()
print(state_digest())
"""
# The wake cell prints at once, so its first output measures the wake, not the digest.
WAKE_CELL = "print('awake', flush=True)\nprint(state_digest())"
SQUATTER = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
x = torch.ones(int(free * 0.9) // 4, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
print(int(x.numel() * 4), float(x[-1]))
"""


def gpu_used_bytes() -> int:
    """The GPU's used memory; -1 on a machine without one (``--cases numpy``)."""
    if shutil.which("nvidia-smi") is None:
        return -1
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]) << 20


def driver_version() -> str:
    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name",
                          "--format=csv,noheader"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[0]


def execute_request(session: str, code: str) -> dict[str, Any]:
    header = {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "username": "bench",
              "session": session, "version": "5.3",
              "date": datetime.now(timezone.utc).isoformat()}
    return {"header": header, "parent_header": {}, "metadata": {}, "channel": "shell",
            "buffers": [], "content": {"code": code, "silent": False, "store_history": True,
                                       "user_expressions": {}, "allow_stdin": False,
                                       "stop_on_error": True}}


async def run_over_websocket(server: Server, kernel_id: str, code: str, timeout: float
                             ) -> dict[str, Any]:
    """Send one cell as JupyterLab does; when each kind of answer came, and what it printed."""
    url = (f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels"
           f"?token={server.token}")
    ws = await websocket_connect(url)
    message = execute_request(uuid.uuid4().hex, code)
    msg_id = message["header"]["msg_id"]
    sent = time.monotonic()
    await ws.write_message(json.dumps(message))
    seen: dict[str, float] = {}
    printed: list[str] = []
    reply: dict[str, Any] | None = None
    idle = False
    while reply is None or not idle:
        left = sent + timeout - time.monotonic()
        raw = await asyncio.wait_for(ws.read_message(), left)
        if raw is None:
            raise RuntimeError("the websocket closed")
        msg = json.loads(raw)
        if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        seen.setdefault(kind, time.monotonic() - sent)
        if kind == "stream":
            seen.setdefault("first_kernel_output", time.monotonic() - sent)
            printed.append(msg["content"]["text"])
        elif kind == "execute_reply":
            reply = msg["content"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    ws.close()
    if reply["status"] != "ok":
        raise RuntimeError(f"the cell failed: {reply}")
    return {"seen_s": seen, "printed": "".join(printed)}


def until_hibernated(server: Server, kernel_id: str, timeout: float,
                     tier: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        listing = server.request("GET", "gpu-snapshot/hibernation")["kernels"]
        found = {k["kernel_id"]: k for k in listing}.get(kernel_id)
        if found and found["state"] == "hibernated" and tier in (None, found.get("tier")):
            return dict(found)
        if found is None:
            jobs = server.request("GET", f"gpu-snapshot/jobs?kernel_id={kernel_id}")["jobs"]
            failed = [j for j in jobs if j["status"] == "failed" and j["reason"] == "hibernate"]
            if failed:
                raise RuntimeError(f"the hibernation failed: {failed[0]['error']}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"kernel {kernel_id} did not hibernate: {found}")
        time.sleep(0.2)


def one_case(server: Server, name: str, setup: str, tiers: list[str]) -> dict[str, Any]:
    """One framework's kernel: built once, then per tier: hibernate, let another process
    use the GPU, wake."""
    kernel_id = server.open_notebook(f"{name}.ipynb")
    started = time.monotonic()
    first = asyncio.run(run_over_websocket(server, kernel_id, setup, 900))
    setup_s = time.monotonic() - started
    digest = first["printed"].split()[0]
    found: dict[str, Any] = {"kernel_id": kernel_id, "setup_s": setup_s, "digest_before": digest}
    for tier in tiers:
        try:
            found[tier] = one_sleep(server, kernel_id, digest, tier)
        except Exception as exc:  # one tier's failure is a result too
            found[tier] = {"error": f"{type(exc).__name__}: {exc}"}
    return found


def one_sleep(server: Server, kernel_id: str, digest: str, tier: str) -> dict[str, Any]:
    """``tier`` gpu or process; or move: the gpu tier first, then the move to the process
    tier (timed from its request), and the wake from the snapshot the move wrote."""
    used_awake = gpu_used_bytes()
    moved_s = None
    if tier == "move":
        server.request("POST", f"gpu-snapshot/kernels/{kernel_id}/hibernate", {"tier": "gpu"})
        until_hibernated(server, kernel_id, 900)
    asked = time.monotonic()
    server.request("POST", f"gpu-snapshot/kernels/{kernel_id}/hibernate",
                   {"tier": "process" if tier == "move" else tier})
    found = until_hibernated(server, kernel_id, 900,
                             tier="process" if tier == "move" else None)
    hibernate_s = time.monotonic() - asked
    if tier == "move":
        moved_s = hibernate_s
    used_asleep = gpu_used_bytes()
    listed = {k["id"]: k for k in server.request("GET", "api/kernels")}
    squat = subprocess.run([sys.executable, "-c", SQUATTER if used_awake >= 0 else "print(0)"],
                           capture_output=True, text=True)
    squatted = squat.stdout.split() if squat.returncode == 0 else []
    woke = asyncio.run(run_over_websocket(server, kernel_id, WAKE_CELL, 900))
    jobs = server.request("GET", f"gpu-snapshot/jobs?kernel_id={kernel_id}")["jobs"]
    wake = max((j for j in jobs if j["kind"] == "wake"), key=lambda j: j["started"])
    timings = (wake["result"] or {}).get("timings") or {}
    # The gpu tier's wake is the driver's restore and unlock, then the threads let go.
    restore_s = float(timings.get("total") or sum(timings.values()) or 0.0)
    lines = woke["printed"].split()
    first_output = woke["seen_s"].get("first_kernel_output")
    return {
        "tier": tier,
        "digest_after": lines[-1] if lines else None,
        "state_equal": bool(lines) and lines[-1] == digest,
        "hibernate_s": hibernate_s,
        "move_to_process_tier_s": moved_s,
        "snapshot_id": found["snapshot_id"],
        "kernel_gpu_bytes": found["gpu_bytes"],
        "host_bytes": found["host_bytes"],
        "gpu_used_awake_bytes": used_awake,
        "gpu_used_hibernated_bytes": used_asleep,
        "gpu_freed_bytes": used_awake - used_asleep,
        "listed_state_while_hibernated": listed.get(kernel_id, {}).get("execution_state"),
        "other_process": {
            "returncode": squat.returncode,
            "allocated_bytes": int(squatted[0]) if squatted else 0,
            "stderr": squat.stderr[-2000:] if squat.returncode else "",
        },
        "execute_to_first_output_s": first_output,
        "execute_to_waking_note_s": woke["seen_s"].get("display_data"),
        "wake_job_s": (wake["finished"] or 0) - wake["started"],
        "restore_s": restore_s,
        "restore_timings": (wake["result"] or {}).get("timings"),
        "over_restore_s": (first_output - restore_s) if first_output is not None else None,
        "hibernate_timings": hibernate_timings(server, kernel_id),
    }


def hibernate_timings(server: Server, kernel_id: str) -> dict[str, Any] | None:
    jobs = server.request("GET", f"gpu-snapshot/jobs?kernel_id={kernel_id}")["jobs"]
    slept = [j for j in jobs if j["reason"] == "hibernate" and j["kind"] != "wake"]
    newest = max(slept, key=lambda j: j["started"], default=None)
    return ((newest or {}).get("result") or {}).get("timings")


def gpu_total_bytes() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]) << 20


def sleeping(server: Server) -> dict[str, str]:
    listing = server.request("GET", "gpu-snapshot/hibernation")["kernels"]
    return {k["kernel_id"]: k["state"] for k in listing}


def turns(server: Server, rounds: int = 2) -> dict[str, Any]:
    """Three kernels that together need more than GPU 0 has, answering cells in turn."""
    each = int(gpu_total_bytes() * 0.4)
    setup = TORCH4.format(n=each // 4)
    kernels: dict[str, str] = {}
    digests: dict[str, str] = {}
    cells: list[dict[str, Any]] = []
    for name in ("a", "b", "c"):
        if len(kernels) == 2:  # the third fits only once one sleeps
            first = next(iter(kernels.values()))
            server.request("POST", f"gpu-snapshot/kernels/{first}/hibernate", {"tier": "gpu"})
            until_hibernated(server, first, 900)
        kernels[name] = server.open_notebook(f"turn-{name}.ipynb")
        ran = asyncio.run(run_over_websocket(server, kernels[name], setup, 900))
        digests[name] = ran["printed"].split()[0]
    for _ in range(rounds):
        for name, kernel_id in kernels.items():
            before = sleeping(server)
            ran = asyncio.run(run_over_websocket(server, kernel_id, WAKE_CELL, 900))
            lines = ran["printed"].split()
            cells.append({
                "kernel": name,
                "was_asleep": kernel_id in before,
                "execute_to_first_output_s": ran["seen_s"].get("first_kernel_output"),
                "state_equal": bool(lines) and lines[-1] == digests[name],
                "asleep_after": sorted(n for n, k in kernels.items() if k in sleeping(server)),
                "gpu_used_bytes": gpu_used_bytes(),
            })
            print(json.dumps(cells[-1]), flush=True)
    return {"kernel_gpu_bytes": each, "gpu_total_bytes": gpu_total_bytes(), "cells": cells,
            "all_equal": all(c["state_equal"] for c in cells)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="torch4,jax,cupy,torch")
    parser.add_argument("--tiers", default="gpu,process")
    parser.add_argument("--turns", action="store_true",
                        help="three kernels taking turns on GPU 0, instead of the cases")
    parser.add_argument("--small", action="store_true", help="a 2 GiB model, not the 8B shape")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-hibernate-"))
    install()
    setups = {
        "torch": LLAMA_SMALL if args.small else LLAMA_8B,
        "torch4": TORCH4.format(n=(1 if args.small else 4) * GIB // 4),
        "jax": JAX.format(n=(1 if args.small else 4) * GIB // 4),
        "cupy": CUPY.format(n=(1 if args.small else 4) * GIB // 4),
        "numpy": NUMPY.format(n=GIB // 16),
    }
    settings: dict[str, Any] = {"autosave": False, "autosave_check_seconds": 0.5}
    if os.environ.get("JUPYTER_GPU_SNAPSHOT_LIBDIR"):
        # The server's environment is cleaned of JUPYTER_* variables: say it as a setting.
        settings["libdir"] = os.environ["JUPYTER_GPU_SNAPSHOT_LIBDIR"]
    server = Server(base, settings, "hibernate")
    result: dict[str, Any] = {
        "benchmark": "hibernate",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "driver": driver_version(),
        "linux": os.uname().release,
        "cores": os.cpu_count(),
        "commit": os.environ.get("JGS_BENCH_COMMIT", ""),
        "small": args.small,
        "cases": {},
    }
    try:
        if args.turns:
            result["turns"] = turns(server)
        for name in [] if args.turns else args.cases.split(","):
            try:
                result["cases"][name] = one_case(server, name, setups[name],
                                                 args.tiers.split(","))
            except Exception as exc:  # one framework's failure is a result too
                result["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({name: result["cases"][name]}, indent=1), flush=True)
    finally:
        server.stop()
        result["server_log_tail"] = server.log_path.read_text(errors="replace")[-4000:]
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
