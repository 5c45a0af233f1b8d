"""The GPU scenarios, for real: python3-snapshot kernels training with PyTorch on the GPU.

Each test checks the process the user would be left with: training continues with losses
bitwise equal to an uninterrupted run, CuPy arrays survive, and after every injected
failure the kernel still computes on the GPU with its data intact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.driver import (
    CudaError,
    LibcudaDriver,
    ProcessState,
)
from jupyter_gpu_snapshot.node.local_engine import make_engine

from ..conftest import KernelHandle, RestoredTrees, execute, run, start_kernel, stop_kernel
from .conftest import DETERMINISTIC_TORCH

pytestmark = pytest.mark.gpu

# A small deterministic training loop: model + AdamW + CUDA RNG for inputs and dropout.
TRAINING = DETERMINISTIC_TORCH + """
import json
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(1024, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
def train(n):
    for _ in range(n):
        x = torch.randn(128, 256, device="cuda")
        y = torch.randint(0, 10, (128,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(json.dumps([v.hex() for v in losses]))
"""


def losses(client_or_kernel: Any, steps: int) -> list[str]:
    code = f"train({steps})"
    if isinstance(client_or_kernel, KernelHandle):
        out = client_or_kernel.execute(code, timeout=300)
    else:
        out = execute(client_or_kernel, code, timeout=300)
    return list(json.loads(out.strip().splitlines()[-1]))


def cli(store: SnapshotStore, *args: str) -> dict[str, Any]:
    """Run ``jupyter gpu-snapshot`` as a user would, from its module."""
    env = {**os.environ, "COLUMNS": "100000"}
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store.root), *args,
         "--json"], capture_output=True, text=True, timeout=600, env=env, check=False)
    assert out.returncode == 0, f"gpu-snapshot {args[0]} failed: {out.stderr}"
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def cuda_state(pid: int) -> ProcessState | None:
    return LibcudaDriver().state(pid)


def kernel_log(handle: KernelHandle) -> str:
    path = getattr(handle.km.provisioner, "log_path", None)
    return Path(path).read_text()[-3000:] if path and Path(path).exists() else "(no log)"


@pytest.fixture
def training_kernel() -> Any:
    handle = start_kernel()
    try:
        handle.execute(TRAINING, timeout=300)
    except AssertionError as exc:
        stop_kernel(handle)
        raise AssertionError(f"{exc}\n-- kernel log --\n{kernel_log(handle)}") from exc
    try:
        yield handle
    finally:
        stop_kernel(handle)


def test_training_continues_bitwise_after_save_and_after_restore(
        store, training_kernel, restored: RestoredTrees, figures):
    reference = start_kernel()
    try:
        reference.execute(TRAINING, timeout=300)
        expected = losses(reference, 30)
    finally:
        stop_kernel(reference)

    k = training_kernel
    assert losses(k, 10) == expected[:10]
    kept = cli(store, "save", "--pid", str(k.root_pid), "--name", "kept")
    # Saved and kept running: training goes on as if nothing happened.
    assert losses(k, 10) == expected[:20]
    assert cuda_state(k.kernel_pid) == ProcessState.RUNNING
    gpu = kept["gpu"]
    assert gpu["driver_version"] and gpu["devices"] and gpu["moved_bytes"] > 0
    assert gpu["processes"][0]["ns_pid"] == procfs.ns_pid(k.kernel_pid)
    figures["keep_running"] = {"timings": kept["timings"], "image_bytes": kept["size_bytes"],
                               "moved_bytes": gpu["moved_bytes"],
                               "live_bytes": gpu["live_bytes"],
                               "allocator_caches": gpu["allocator_caches"],
                               "cuda_timings": gpu["timings"]}

    old_host_pid = k.kernel_pid
    stopped = cli(store, "save", "--pid", str(k.root_pid), "--name", "stopped", "--stop")
    assert not procfs.tree_alive(k.root_pid)
    k.client.stop_channels()
    started = time.monotonic()
    back = cli(store, "restore", "stopped")
    client = restored.connect(Path(back["connection_file"]), back["pid"])
    assert execute(client, "print(1 + 1)").strip() == "2"
    first_cell = time.monotonic() - started
    assert back["kernel_pid"] != old_host_pid
    assert cuda_state(back["kernel_pid"]) == ProcessState.RUNNING
    # Killed, restored, continued: the same losses, bit for bit.
    assert losses(client, 10) == expected
    figures["stop_restore"] = {"save_timings": stopped["timings"],
                               "image_bytes": stopped["size_bytes"],
                               "restore_timings": back["timings"],
                               "restore_to_first_cell_s": round(first_cell, 3)}


def test_cupy_arrays_survive(store, restored: RestoredTrees):
    k = start_kernel()
    try:
        k.execute("""
import cupy as cp
a = cp.arange(50_000_000, dtype=cp.float32) * 3
b = cp.random.default_rng(7).standard_normal((2048, 2048), dtype=cp.float32)
checks = (float(a.sum()), float((b @ b).sum()))
print(checks)
""", timeout=300)
        cli(store, "save", "--pid", str(k.root_pid), "--name", "cupy", "--stop")
        k.client.stop_channels()
        back = cli(store, "restore", "cupy")
        client = restored.connect(Path(back["connection_file"]), back["pid"])
        out = execute(client, "print((float(a.sum()), float((b @ b).sum())) == checks, a[7])")
        assert out.split() == ["True", "21.0"]
    finally:
        stop_kernel(k)


def test_kernel_in_its_own_pid_namespace_uses_cuda(kernel):
    assert procfs.namespace_init(kernel.kernel_pid) is not None
    out = kernel.execute(
        "import os, torch; print(os.getpid(), torch.ones(4, device='cuda').sum().item())",
        timeout=300)
    assert out.split() == [str(procfs.ns_pid(kernel.kernel_pid)), "4.0"]
    assert cuda_state(kernel.kernel_pid) == ProcessState.RUNNING


BUSY = """
import time, torch
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.randn(8192, 8192, device="cuda"); b = torch.randn(8192, 8192, device="cuda")
expected = float((a @ b).sum())
t, n = time.time(), 0
while time.time() - t < {seconds}:
    c = a @ b
    n += 1
torch.cuda.synchronize()
print("done", n, float(c.sum()) == expected)
"""


def test_lock_timeout_against_a_busy_gpu_leaves_the_kernel_computing(
        store, training_kernel, figures):
    k = training_kernel
    before = losses(k, 3)
    msg_id = k.client.execute(BUSY.format(seconds=15))
    time.sleep(4)  # the queue of matrix products is full by now
    engine = make_engine(GPUSnapshot(store_dir=str(store.root), cuda_lock_timeout=1.0))
    started = time.monotonic()
    with pytest.raises(CudaError) as err:
        run(engine.save(SaveTarget(pid=k.root_pid), name="busy"))
    figures["lock_timeout_refusal_s"] = round(time.monotonic() - started, 3)
    assert err.value.step == "suspend" and "timed out after 1 s" in err.value.message
    assert cuda_state(k.kernel_pid) == ProcessState.RUNNING
    reply = k.client.get_shell_msg(timeout=120)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = k.client.get_shell_msg(timeout=120)
    assert reply["content"]["status"] == "ok"
    out = k.execute("print(n, float(c.sum()) == expected)")
    assert out.split()[1] == "True" and int(out.split()[0]) > 10
    assert len(losses(k, 2)) == len(before) + 2  # and trains on
    store.ensure()
    assert store.list() == []


def test_criu_killed_mid_dump_leaves_the_kernel_computing(store, training_kernel, tmp_path,
                                                          figures):
    k = training_kernel
    k.execute("big = torch.randn(512, 1024, 1024, device='cuda'); big_sum = float(big.sum())",
              timeout=300)
    real = shutil.which("criu")
    killer = tmp_path / "criu-killer"
    killer.write_text(
        "#!/bin/sh\n"
        f'case "$1" in dump) "{real}" "$@" & pid=$!; sleep 1; kill -9 $pid; wait $pid; '
        f'exit $?;; *) exec "{real}" "$@";; esac\n')
    killer.chmod(0o755)
    engine = make_engine(GPUSnapshot(store_dir=str(store.root), criu_path=str(killer)))
    with pytest.raises(SnapshotError) as err:
        run(engine.save(SaveTarget(pid=k.root_pid), name="killed", stop=True))
    assert err.value.step == "dump"
    assert procfs.tree_alive(k.root_pid)
    assert cuda_state(k.kernel_pid) == ProcessState.RUNNING
    out = k.execute(
        "print(float(big.sum()) == big_sum, float((big[0] @ big[0]).abs().sum()) > 0)")
    assert out.split() == ["True", "True"]
    assert len(losses(k, 2)) == 2
    store.ensure()
    assert store.list() == []
    assert not any(p.name.startswith(".partial-") for p in store.root.iterdir())
    figures["criu_killed_error"] = err.value.message[:300]


def test_restore_is_refused_when_gpu_memory_is_short(store, training_kernel, restored,
                                                     figures):
    k = training_kernel
    k.execute("x = torch.full((8 * 2**30,), 7, dtype=torch.uint8, device='cuda')", timeout=300)
    cli(store, "save", "--pid", str(k.root_pid), "--name", "large", "--stop")
    k.client.stop_channels()
    hog = start_kernel()
    try:
        # Leave less free GPU memory than the snapshot needs.
        hog.execute("import torch; free, _ = torch.cuda.mem_get_info(); "
                    "hog = torch.empty(free - 4 * 2**30, dtype=torch.uint8, device='cuda')",
                    timeout=300)
        env = {**os.environ, "COLUMNS": "100000"}
        out = subprocess.run(
            [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store.root),
             "restore", "large"], capture_output=True, text=True, timeout=600, env=env,
            check=False)
        assert out.returncode == 2 and "free" in out.stderr and "needs" in out.stderr
        figures["refusal"] = out.stderr.strip()[-300:]
    finally:
        stop_kernel(hog)
    back = cli(store, "restore", "large")
    client = restored.connect(Path(back["connection_file"]), back["pid"])
    assert execute(client, "print(int(x[-1]), x.shape[0] == 8 * 2**30)").split() == ["7", "True"]



def test_cli_resume_brings_back_a_kernel_left_checkpointed(kernel):
    """What a save killed between its CUDA steps leaves behind, and the way back."""
    kernel.execute("import torch; x = torch.arange(1_000_000, device='cuda')", timeout=300)
    driver = LibcudaDriver()
    pid = kernel.kernel_pid
    driver.lock(pid, 10_000)
    driver.checkpoint(pid)
    assert cuda_state(pid) == ProcessState.CHECKPOINTED
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "resume", "--pid", str(pid)],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert f"CUDA running again in: {pid}" in out.stdout
    assert cuda_state(pid) == ProcessState.RUNNING
    assert kernel.execute("print(int(x.sum().item()))").strip() == str(sum(range(1_000_000)))
