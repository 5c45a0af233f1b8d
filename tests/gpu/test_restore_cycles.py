"""A GPU that works after every restore: snapshot-ready kernels started next to restored
ones initialise CUDA, cycle after cycle (docs/gpu.md, "Kernels in their own PID namespace").

libcuda names a socket after a process's PID namespace number and its pid there; a restored
kernel holds the name its original had, and Linux gives the original's namespace number to
the next namespace created, so the kernel started next gets it. Each test counts the cycles
where that happened (``same_namespace_number``): those are the ones a kernel with the saved
kernel's pid could not use CUDA in.

- ``test_new_kernel_uses_cuda_after_every_restore``: restore a PyTorch (JAX) kernel, start a
  new snapshot-ready kernel, run PyTorch (JAX) work on the GPU in it, check the restored
  kernel's state; ``JGS_RESTORE_CYCLES`` cycles (20).
- ``test_restore_next_to_a_kernel_started_after_the_save``: the other order. A kernel
  started after the save gets the saved kernel's namespace number; the restore must still
  bring the saved kernel back (criu binds its socket name again), and both compute.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.hooks import SaveTarget
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.node.local_engine import make_engine

from ..conftest import KernelError, KernelHandle, connect, execute, run, start_kernel, stop_kernel

pytestmark = pytest.mark.gpu

CYCLES = int(os.environ.get("JGS_RESTORE_CYCLES", "20"))
OTHER_ORDER_CYCLES = int(os.environ.get("JGS_RESTORE_OTHER_ORDER_CYCLES", "5"))

# Per framework: the saved kernel's state and check(), and the new kernel's CUDA work.
FRAMEWORKS: dict[str, tuple[str, str]] = {
    "torch": (
        "import torch\n"
        "state = torch.arange(1 << 24, device='cuda', dtype=torch.float32)\n"
        "def check():\n"
        "    return float(state.sum())\n",
        "import os, torch\n"
        "x = torch.ones(1 << 20, device='cuda')\n"
        "print(os.getpid(), float((x * 2).sum()), torch.cuda.get_device_name())\n",
    ),
    "jax": (
        "import jax, jax.numpy as jnp\n"
        "state = jnp.arange(1 << 24, dtype=jnp.float32)\n"
        "def check():\n"
        "    return float(state.sum())\n",
        "import os, jax, jax.numpy as jnp\n"
        "x = jnp.ones(1 << 20)\n"
        "print(os.getpid(), float((x * 2).sum()), jax.devices()[0].platform)\n",
    ),
}
CUDA_SOCKET = re.compile(r"^@cuda-uvmfd-(\d+)-(\d+)@$")


def namespace_number(pid: int) -> int:
    return int(procfs.pid_namespace(pid).removeprefix("pid:[").removesuffix("]"))


def cuda_sockets(pid: int) -> list[tuple[int, int]]:
    """(namespace number, pid) of the CUDA socket names process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    with open(f"/proc/{pid}/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            match = CUDA_SOCKET.match(fields[7]) if len(fields) > 7 else None
            if match and fields[6] in inodes:
                found.append((int(match[1]), int(match[2])))
    return found


def saved_kernel(framework: str, store: SnapshotStore) -> tuple[Any, dict[str, Any]]:
    """A kernel holding ``framework`` state on the GPU, saved and stopped."""
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    k = start_kernel()
    try:
        expected = k.execute(FRAMEWORKS[framework][0] + "print(check())", timeout=600).strip()
        original = {"namespace_number": namespace_number(k.kernel_pid),
                    "ns_pid": procfs.ns_pid(k.kernel_pid),
                    "cuda_sockets": cuda_sockets(k.kernel_pid), "check": expected}
        t = time.monotonic()
        snapshot = run(engine.save(
            SaveTarget(pid=k.root_pid, connection_info=k.km.get_connection_info()),
            name=f"cycles-{framework}"))
        original["save_s"] = round(time.monotonic() - t, 2)
    finally:
        stop_kernel(k)
    return (engine, snapshot), original


def new_kernel_work(framework: str, claimed: set[tuple[int, int]]) -> tuple[KernelHandle,
                                                                          dict[str, Any]]:
    """Start a snapshot-ready kernel and run the framework's CUDA work in it."""
    t = time.monotonic()
    k = start_kernel()
    number = namespace_number(k.kernel_pid)
    result: dict[str, Any] = {
        "ns_pid": procfs.ns_pid(k.kernel_pid),
        "same_namespace_number": any(n == number for n, _ in claimed),
        "claimed_here": sorted(p for n, p in claimed if n == number),
    }
    try:
        out = k.execute(FRAMEWORKS[framework][1], timeout=300)
        result.update(ok=True, out=out.strip())
    except KernelError as err:
        result.update(ok=False, error=str(err)[-600:])
    result["seconds"] = round(time.monotonic() - t, 2)
    return k, result


def restore(engine: Any, snapshot: Any) -> tuple[Any, Any, dict[str, Any]]:
    t = time.monotonic()
    back = run(engine.restore(snapshot.id))
    seconds = round(time.monotonic() - t, 2)
    client = connect(back.connection_info)
    return back, client, {"restore_s": seconds, "cuda_sockets": cuda_sockets(back.kernel_pid),
                          "namespace_number": namespace_number(back.kernel_pid)}


def summary(cycles: list[dict[str, Any]], original: dict[str, Any]) -> dict[str, Any]:
    return {
        "cycles": len(cycles),
        "failed": sum(not c["new_kernel"]["ok"] or not c.get("restored_ok", True)
                      for c in cycles),
        "same_namespace_number": sum(c["new_kernel"]["same_namespace_number"] for c in cycles),
        "saved_kernel": original,
        "per_cycle": cycles,
    }


@pytest.mark.timeout(60 * 30)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_new_kernel_uses_cuda_after_every_restore(framework: str, store: SnapshotStore,
                                                  figures: dict[str, Any]):
    (engine, snapshot), original = saved_kernel(framework, store)
    cycles: list[dict[str, Any]] = []
    figures.update(summary(cycles, original))
    for _ in range(CYCLES):
        back, client, cycle = restore(engine, snapshot)
        try:
            new, cycle["new_kernel"] = new_kernel_work(framework, set(cycle["cuda_sockets"]))
            stop_kernel(new)
            got = execute(client, "print(check())", timeout=120).strip()
            cycle["restored_ok"] = got == original["check"]
        finally:
            client.stop_channels()
            procfs.kill_tree(back.pid)
        cycles.append(cycle)
        figures.update(summary(cycles, original))
    failed = [c for c in cycles if not c["new_kernel"]["ok"] or not c["restored_ok"]]
    assert not failed, failed[:3]


@pytest.mark.timeout(60 * 30)
def test_restore_next_to_a_kernel_started_after_the_save(store: SnapshotStore,
                                                         figures: dict[str, Any]):
    (engine, snapshot), original = saved_kernel("torch", store)
    saved_names = set(original["cuda_sockets"])
    cycles: list[dict[str, Any]] = []
    figures.update(summary(cycles, original))
    for _ in range(OTHER_ORDER_CYCLES):
        new, new_result = new_kernel_work("torch", saved_names)
        cycle: dict[str, Any] = {"new_kernel": new_result}
        try:
            try:
                back, client, restored = restore(engine, snapshot)
            except SnapshotError as err:
                cycle.update(restored_ok=False, error=err.message[-600:])
            else:
                cycle.update(restored)
                try:
                    got = execute(client, "print(check())", timeout=120).strip()
                    cycle["restored_ok"] = got == original["check"]
                    again = new.execute(FRAMEWORKS["torch"][1], timeout=120)
                    cycle["new_kernel_after_restore"] = again.strip()
                finally:
                    client.stop_channels()
                    procfs.kill_tree(back.pid)
        finally:
            stop_kernel(new)
        cycles.append(cycle)
        figures.update(summary(cycles, original))
    failed = [c for c in cycles if not c["new_kernel"]["ok"] or not c["restored_ok"]]
    assert not failed, failed[:3]
