"""What autosave costs a training run, and what a hard kill then loses.

Notebook 02's training (its model, data and train step, read from the notebook) runs in a
python3-snapshot kernel of a real ``jupyter server`` with the extension, as one long cell,
twice in one run, for the same wall-clock time:

1. without autosave (the notebook's policy turned off through the REST API);
2. with autosave every ``--interval`` minutes, allowed to pause the running cell.

Both count their optimizer steps. The second half's autosave jobs give each autosave's
kernel pause; the steps lost to them are the first half's steps minus the second's (and,
less noisily, the pauses times the first half's step rate). The overhead at an interval is
pause / interval. Then the server and the kernel are SIGKILLed together, as a power loss
would, a new server restores the notebook's newest autosave, and the work lost is the
time and the steps between that autosave and the kill (at most one interval plus a save).
The restored kernel trains on, and its losses are compared bit for bit with the losses the
killed kernel had for the same steps.

    python benchmarks/bench_autosave.py --minutes 4 --interval 2 [--out FILE]
    python benchmarks/bench_autosave.py --dry-run       # CPU, numpy, seconds: checks the logic
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nbformat
import psutil
from common import settle
from jupyter_client.blocking import BlockingKernelClient
from server_process import Server, connect, run_cell

from jupyter_gpu_snapshot.launch.kernelspec import install
from testkit.processes import kill_kernels

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_02 = REPO / "notebooks" / "02-pytorch-training-survives-reboot.ipynb"
DEFAULT_INTERVAL_MINUTES = 15.0  # c.GPUSnapshot.autosave_interval_minutes
LOG_STEPS = 20_000_000  # room in the kernel's loss log (80 MB)

# Notebook 02 trains whole epochs; here one optimizer step is the unit, so that a run can
# stop at a deadline and the steps of two runs can be counted. The step is notebook 02's.
TORCH_STEP = """
X, y, model, optimizer = make_run(seed=0)
loss_log = torch.zeros(LOG_STEPS, device=device)
order, cursor = None, 0
def one_step(batch=4096):
    global order, cursor
    if order is None or cursor >= X.shape[0]:
        order, cursor = torch.randperm(X.shape[0], device=device), 0
    idx = order[cursor:cursor + batch]
    cursor += batch
    loss = torch.nn.functional.mse_loss(model(X[idx]), y[idx])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    loss_log[step] = loss.detach()
def sync():
    torch.cuda.synchronize()
def log_bytes(n):
    return loss_log[:n].cpu().numpy().tobytes()
"""

# --dry-run: the same loop around a numpy linear model, to check the benchmark on a CPU.
NUMPY_STEP = """
import numpy as np
rng = np.random.default_rng(0)
X = rng.standard_normal((20000, 16)).astype(np.float32)
y = np.sin(X @ rng.standard_normal((16, 1)).astype(np.float32))
w = np.zeros((16, 1), np.float32)
ballast = rng.bytes(64 << 20)
loss_log = np.zeros(LOG_STEPS, np.float32)
order, cursor = None, 0
def one_step(batch=256):
    global order, cursor, w
    if order is None or cursor >= len(X):
        order, cursor = rng.permutation(len(X)), 0
    idx = order[cursor:cursor + batch]
    cursor += batch
    err = X[idx] @ w - y[idx]
    loss_log[step] = (err ** 2).mean()
    w = w - np.float32(1e-2) * (2 * X[idx].T @ err / len(idx))
def sync():
    pass
def log_bytes(n):
    return loss_log[:n].tobytes()
"""

LOOP = """
import time
step, gaps = 0, []
def run_for(seconds, stall=0.1):
    # Gaps between steps longer than `stall` are kept: an autosave's pause shows as one.
    global step
    deadline = last = time.time()
    deadline += seconds
    while last < deadline:
        one_step()
        step += 1
        now = time.time()
        if now - last > stall:
            gaps.append((last, now - last))
        last = now
    sync()
def run_steps(n):
    global step
    for _ in range(n):
        one_step()
        step += 1
    sync()
def stalls():
    return gaps
def dump_log(path):
    with open(path, "wb") as f:
        f.write(log_bytes(step))
"""


def training_code(dry_run: bool) -> str:
    """Notebook 02's set-up and training definitions, plus the step loop."""
    if dry_run:
        return f"LOG_STEPS = {LOG_STEPS}\n{NUMPY_STEP}\n{LOOP}"
    nb = nbformat.read(NOTEBOOK_02, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    setup = next(c for c in cells if "use_deterministic_algorithms" in c)
    definitions = next(c for c in cells if "def make_run" in c and "def train" in c)
    return f"{setup}\n{definitions}\nLOG_STEPS = {LOG_STEPS}\n{TORCH_STEP}\n{LOOP}"


def train_half(server: Server, notebook: str, seconds: float, code: str,
               autosave: bool
               ) -> tuple[str, BlockingKernelClient, dict[str, Any], dict[str, Any]]:
    """One half: a fresh kernel for ``notebook`` trains for ``seconds`` in one cell."""
    kernel_id = server.open_notebook(notebook)
    if not autosave:
        server.request("PUT", f"gpu-snapshot/kernels/{kernel_id}/autosave", {"enabled": False})
    connection_info = server.connection_info(kernel_id)
    client = connect(connection_info)
    run_cell(client, code, timeout=600)
    settle()
    started = time.time()
    run_cell(client, f"run_for({seconds})", timeout=seconds + 600)
    ended = time.time()
    out = run_cell(client, "import json; print(json.dumps({'steps': step, 'stalls': stalls()}))",
                   timeout=120)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result.update(kernel_id=kernel_id, started=started, ended=ended,
                  steps_per_s=result["steps"] / (ended - started))
    # An autosave that paused the cell's last steps may still be committing.
    while True:
        jobs = server.request("GET", f"gpu-snapshot/jobs?kernel_id={kernel_id}")["jobs"]
        if not any(j["status"] == "running" for j in jobs):
            break
        time.sleep(0.2)
    result["autosaves"] = [
        {
            "snapshot_id": j["snapshot_id"],
            "status": j["status"],
            "error": (j.get("error") or {}).get("message"),
            "started": j["started"],
            "pause_s": ((j.get("result") or {}).get("timings") or {}).get("pause"),
            "save_total_s": ((j.get("result") or {}).get("timings") or {}).get("total"),
            "image_bytes": (j.get("result") or {}).get("size_bytes"),
            "gpu_bytes": (((j.get("result") or {}).get("gpu") or {}).get("moved_bytes")),
        }
        for j in sorted(jobs, key=lambda j: j["started"])
        if j["kind"] == "save" and j["reason"] == "autosave"
    ]
    return kernel_id, client, result, connection_info


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "linux": platform.release(),
        "python": platform.python_version(),
        "driver": None,
        "gpus": [],
    }
    with contextlib.suppress(Exception):  # no GPU layer on a CPU machine
        from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver
        from jupyter_gpu_snapshot.gpu.inventory import read_inventory

        info["driver"] = LibcudaDriver().info.version
        inventory = read_inventory()
        info["gpus"] = [d.to_dict() for d in inventory.devices] if inventory else []
    with contextlib.suppress(Exception):
        criu = subprocess.run(["criu", "--version"], capture_output=True, text=True, timeout=30)
        info["criu"] = criu.stdout.strip().splitlines()[0]
    return info


def summarize(without: dict[str, Any], with_: dict[str, Any], interval_s: float,
              kill: dict[str, Any]) -> dict[str, Any]:
    saved = [a for a in with_["autosaves"] if a["status"] == "succeeded"]
    pauses = [float(a["pause_s"]) for a in saved if a["pause_s"] is not None]
    mean_pause = statistics.mean(pauses) if pauses else None
    overhead = {}
    if mean_pause is not None:
        for minutes in sorted({interval_s / 60, 10.0, DEFAULT_INTERVAL_MINUTES}):
            overhead[f"{minutes:g}min"] = mean_pause / (minutes * 60)
    return {
        "autosaves": len(saved),
        "autosave_pauses_s": pauses,
        "mean_pause_s": mean_pause,
        "steps_without": without["steps"],
        "steps_with": with_["steps"],
        "steps_lost_measured": without["steps"] - with_["steps"],
        "steps_lost_from_pauses": round(sum(pauses) * without["steps_per_s"]),
        "overhead_pause_over_interval": overhead,
        "goal_overhead_at_10min": 0.02,
        "hard_kill_lost_seconds": kill.get("lost_seconds"),
        "hard_kill_lost_steps": kill.get("lost_steps"),
        "hard_kill_lost_within_one_interval": kill.get("within_one_interval"),
        "losses_continue_bitwise": kill.get("bitwise_equal"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=None,
                        help="training time of each half (default 4; 0.5 with --dry-run)")
    parser.add_argument("--interval", type=float, default=None,
                        help="autosave interval in minutes (default 2; 0.15 with --dry-run)")
    parser.add_argument("--continue-steps", type=int, default=2000,
                        help="steps the restored kernel trains on for the bitwise check")
    parser.add_argument("--dry-run", action="store_true",
                        help="numpy on the CPU instead of PyTorch on the GPU, for seconds")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    minutes = args.minutes if args.minutes is not None else (0.5 if args.dry_run else 4.0)
    interval = args.interval if args.interval is not None else (0.15 if args.dry_run else 2.0)
    seconds, interval_s = minutes * 60, interval * 60
    code = training_code(args.dry_run)
    install()
    settings = {
        "autosave": True,
        "autosave_interval_minutes": interval,
        "autosave_after_cell_minutes": 0.0,  # only the interval: its cost is what is measured
        "autosave_during_cell": True,  # the training is one long cell
        "autosave_check_seconds": 1.0,
        "autosave_keep": 2,
        "autosave_min_free_bytes": 1 << 30,
        "snapshot_on_shutdown": False,
    }
    result: dict[str, Any] = {
        "benchmark": "autosave",
        "dry_run": args.dry_run,
        "machine": machine_info(),
        "minutes_per_half": minutes,
        "interval_minutes": interval,
        "training": "numpy linear model (dry run)" if args.dry_run else
        "notebook 02: 64-512-512-1 MLP, Adam, batch 4096, 200k samples on the GPU",
    }
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or REPO / "benchmarks" / "results" / (
        f"autosave-{'dry-' if args.dry_run else ''}{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="jgs-bench-autosave-"))
    servers: list[Server] = []
    kernel_ids: list[str] = []
    try:
        first = Server(base, settings, "before")
        servers.append(first)
        kid, client, without, _ = train_half(first, "without.ipynb", seconds, code, autosave=False)
        client.stop_channels()
        first.request("DELETE", f"api/kernels/{kid}")
        result["without_autosave"] = without
        print(f"without autosave: {without['steps']} steps "
              f"({without['steps_per_s']:.1f}/s)", flush=True)

        kid, client, with_, with_connection = train_half(
            first, "with.ipynb", seconds, code, autosave=True)
        kernel_ids.append(kid)
        result["with_autosave"] = with_
        print(f"with autosave every {interval:g} min: {with_['steps']} steps, pauses "
              f"{[a['pause_s'] for a in with_['autosaves']]}", flush=True)

        # The power loss, right after the run: the work since the last autosave is lost.
        log_before = base / "losses-before-kill.f32"
        run_cell(client, f"dump_log({str(log_before)!r})", timeout=300)
        steps_at_kill = int(run_cell(client, "print(step)", timeout=60).strip())
        client.stop_channels()
        killed_at = time.time()
        first.power_loss([kid])
        settle(cold=True)

        second = Server(base, settings, "after")
        servers.append(second)
        latest = second.request(
            "GET", "gpu-snapshot/snapshots?latest=true&notebook_path=with.ipynb")["snapshots"]
        kill: dict[str, Any] = {"steps_at_kill": steps_at_kill, "offered": latest}
        result["hard_kill"] = kill
        if not latest:
            raise RuntimeError("no snapshot of with.ipynb is offered after the restart")
        snapshot = latest[0]
        kill["lost_seconds"] = killed_at - float(snapshot["created"])
        job = second.request("POST", f"gpu-snapshot/snapshots/{snapshot['id']}/restore",
                             {"path": "with.ipynb"})
        job = second.wait_job(job)
        if job["status"] != "succeeded":
            raise RuntimeError(f"the restore failed: {job['error']}")
        kernel_ids.append(job["result"]["kernel_id"])
        kill["restore_s"] = (job["finished"] or time.time()) - job["started"]
        # The restored process listens with the original's connection info: the file the
        # first server wrote for it went with that server's runtime directory.
        client = connect(with_connection)
        restored_step = int(run_cell(client, "print(step)", timeout=300).strip())
        kill["steps_at_autosave"] = restored_step
        kill["lost_steps"] = steps_at_kill - restored_step
        more = max(0, min(args.continue_steps, steps_at_kill - restored_step))
        log_after = base / "losses-after-restore.f32"
        run_cell(client, f"run_steps({more}); dump_log({str(log_after)!r})", timeout=600)
        client.stop_channels()
        before, after = log_before.read_bytes(), log_after.read_bytes()
        n = 4 * (restored_step + more)
        kill["continued_steps"] = more
        kill["bitwise_equal"] = len(after) == n and after == before[:n]
        kill["within_one_interval"] = (
            kill["lost_seconds"] <= interval_s + max(
                [a["save_total_s"] or 0 for a in with_["autosaves"]] + [0]) + 5)
        second.stop()
        result["summary"] = summarize(without, with_, interval_s, kill)
        print(json.dumps(result["summary"], indent=2), flush=True)
    finally:
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        for server in servers:
            server.kill()
        kill_kernels(kernel_ids)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
