"""Hibernation's gpu tier with the real driver: each framework's kernel gives its GPU back,
sleeps with its threads held, and computes on after the wake.

For every row of ``test_frameworks`` that saves: the kernel builds its state and warms its
``step()``; its GPU is released (``GpuSleep.release``); it sleeps ``SLEEP_SECONDS``, far
longer than JAX's threads survive running on checkpointed CUDA (under 3 s, measured); it
wakes, and ``step()`` runs twice with the same live device bytes as before. Bitwise
continuation of the same kernels through a server is ``benchmarks/bench_hibernate.py``'s.
Also: a holder killed mid-sleep takes the kernel with it (``PTRACE_O_EXITKILL``); and
each row's sleeping kernel moves to the process tier without waking (dumped with its CUDA
state checkpointed), then comes back from that snapshot with the same device bytes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.driver import LibcudaDriver, ProcessState
from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
from jupyter_gpu_snapshot.gpu.inventory import read_inventory
from jupyter_gpu_snapshot.gpu.sleep import GpuSleep, holders_dir
from jupyter_gpu_snapshot.node.local_engine import make_engine

from ..conftest import RestoredTrees, execute, run, start_kernel, stop_kernel
from .test_frameworks import FRAMEWORKS, Framework

pytestmark = pytest.mark.gpu

SLEEP_SECONDS = 15.0
ROWS = [f for f in FRAMEWORKS if f.refused is None and f.id != "numba-cuda"]


def gpu_sleep() -> GpuSleep:
    return GpuSleep(LibcudaDriver(), holders_dir(Path("/tmp")), 10.0, read_inventory)


def on_gpu(pid: int) -> int:
    inventory = read_inventory()
    return inventory.bytes_of(pid) if inventory else 0


@pytest.mark.parametrize("fw", ROWS, ids=[f.id for f in ROWS])
def test_a_kernel_sleeps_with_its_gpu_released_and_computes_on_after_the_wake(
        fw: Framework, figures: dict[str, Any]) -> None:
    sleep = gpu_sleep()
    k = start_kernel(env=fw.env)
    try:
        k.execute(fw.setup, timeout=600)
        k.execute("step()", timeout=300)
        live = json.loads(k.execute("print(json.dumps(live_bytes()))").strip().splitlines()[-1])
        held = on_gpu(k.kernel_pid)
        started = time.monotonic()
        released = sleep.release(k.root_pid)
        figures["release_s"] = round(time.monotonic() - started, 3)
        figures["release"] = released.to_dict()
        assert LibcudaDriver().state(k.kernel_pid) == ProcessState.CHECKPOINTED
        assert on_gpu(k.kernel_pid) == 0 < held
        time.sleep(SLEEP_SECONDS)
        assert sleep.asleep(k.root_pid) is not None, "the kernel died asleep"
        started = time.monotonic()
        woken = sleep.wake(k.root_pid)
        figures["wake_s"] = round(time.monotonic() - started, 3)
        figures["wake"] = woken.to_dict()
        figures["gpu_bytes"] = held
        out = k.execute("print(json.dumps([live_bytes(), step(), step()]))", timeout=300)
        after, *_steps = json.loads(out.strip().splitlines()[-1])
        assert after == live
        assert LibcudaDriver().state(k.kernel_pid) == ProcessState.RUNNING
    finally:
        stop_kernel(k)


def test_a_killed_holder_takes_the_sleeping_kernel_with_it() -> None:
    sleep = gpu_sleep()
    k = start_kernel()
    try:
        k.execute("import torch; x = torch.ones(1 << 28, device='cuda'); print(float(x.sum()))")
        sleep.release(k.root_pid)
        status = sleep.asleep(k.root_pid)
        assert status is not None
        kernel = k.kernel_pid
        os.kill(int(status["holder_pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{kernel}") and _state(kernel) != "Z":
            assert time.monotonic() < deadline, "the kernel outlived its holder"
            time.sleep(0.1)
    finally:
        stop_kernel(k)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("fw", ROWS, ids=[f.id for f in ROWS])
def test_a_sleeping_kernel_moves_to_disk_untouched_and_wakes_from_its_snapshot(
        fw: Framework, store: SnapshotStore, restored: RestoredTrees,
        figures: dict[str, Any]) -> None:
    """The move from the gpu tier to the process tier: the sleeping kernel is dumped with
    its CUDA state checkpointed (no driver call), then restored stopped, held, and woken."""
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    sleep = next(h for h in engine.hooks if isinstance(h, CudaCheckpointHook)).gpu_sleep()
    k = start_kernel(env=fw.env)
    try:
        k.execute(fw.setup, timeout=600)
        k.execute("step()", timeout=300)
        live = json.loads(k.execute("print(json.dumps(live_bytes()))").strip().splitlines()[-1])
        sleep.release(k.root_pid, {"kernel_id": fw.id})
        target = SaveTarget(pid=k.root_pid, connection_info=k.km.get_connection_info())
        snapshot = run(engine.save(target, name=fw.id, stop=True))
    finally:
        stop_kernel(k)
    gpu = snapshot.manifest["gpu"]
    assert gpu["dumped_state"] == "checkpointed" and gpu["moved_bytes"] > 0
    started = time.monotonic()
    back = run(engine.restore(snapshot.id))
    restore_s = time.monotonic() - started
    client = restored.connect(back.connection_info, back.pid)
    out = execute(client, "print(json.dumps([live_bytes(), step(), step()]))", timeout=300)
    after, *_steps = json.loads(out.strip().splitlines()[-1])
    assert after == live
    assert LibcudaDriver().state(back.kernel_pid) == ProcessState.RUNNING
    figures.update(move_timings=snapshot.manifest["timings"], image_bytes=snapshot.size_bytes,
                   moved_bytes=gpu["moved_bytes"], restore_s=round(restore_s, 3),
                   restore_timings=back.timings)
