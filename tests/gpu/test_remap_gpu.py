"""Restoring a GPU kernel onto other GPUs, for real, on a machine with two GPUs of one model.

(a) A kernel saved on GPU 0 comes back on GPU 1 by itself when another process has filled
    GPU 0; NVML shows the restored process on GPU 1 only, and its tensor is intact.
(b) A kernel with tensors on both GPUs comes back with the GPUs swapped (``--gpus 1,0``);
    NVML shows each device's memory on the other GPU, and both tensors are intact.
(c) A snapshot whose signed manifest claims another GPU model is refused before anything
    runs (the manifest is altered and re-signed with the test's key: this machine has one
    model), whether the GPUs are chosen automatically or by ``--gpus``.

Each scenario checks the process that NVML reports, not only what the kernel says: the
restored kernel still calls its devices cuda:0 and cuda:1 whatever GPU they are on.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.gpu.inventory import GpuInventory, read_inventory
from testkit.gpu_check import fewer_gpus_reason

from ..conftest import RestoredTrees, execute, start_kernel, stop_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),  # torch's first import, a 138 GiB filler and gigabyte images
    pytest.mark.skipif(fewer_gpus_reason(2) is not None,
                       reason=f"GPU remap test: {fewer_gpus_reason(2)}"),
]

GIB = 1 << 30

# Exact checksums (integer sums of the bits), so "intact" means every byte.
ONE_GPU_KERNEL = """
import torch
x = torch.full((2**29,), 7, dtype=torch.int32, device="cuda:0")  # 2 GiB
g = torch.Generator(device="cuda:0").manual_seed(11)
r = torch.randn(4096, 4096, device="cuda:0", generator=g)
def checksums():
    return [int(x.sum(dtype=torch.int64)), int(r.view(torch.int32).sum(dtype=torch.int64)),
            str(x.device), str(r.device)]
before = checksums()
print(before)
"""

TWO_GPU_KERNEL = """
import torch
a = torch.full((3 * 2**28,), 3, dtype=torch.int32, device="cuda:0")  # 3 GiB
b = torch.full((2**28,), 5, dtype=torch.int32, device="cuda:1")  # 1 GiB
ga = torch.Generator(device="cuda:0").manual_seed(1)
gb = torch.Generator(device="cuda:1").manual_seed(2)
ra = torch.randn(2048, 2048, device="cuda:0", generator=ga)
rb = torch.randn(2048, 2048, device="cuda:1", generator=gb)
def bits(t):
    return int(t.view(torch.int32).sum(dtype=torch.int64))
def checksums():
    return [int(a.sum(dtype=torch.int64)), int(b.sum(dtype=torch.int64)), bits(ra), bits(rb),
            str(a.device), str(b.device)]
before = checksums()
print(before)
"""

# Fills GPU 0 (the only GPU it sees) and waits for its stdin to close.
HOG = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
hog = torch.empty(free - 768 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()
"""


def gpu_snapshot(store: SnapshotStore, *args: str, check: bool = True
                 ) -> subprocess.CompletedProcess[str]:
    """``jupyter gpu-snapshot`` as a user runs it."""
    env = {**os.environ, "COLUMNS": "100000"}
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store.root), *args],
        capture_output=True, text=True, timeout=600, env=env, check=False)
    if check:
        assert out.returncode == 0, f"gpu-snapshot {args[0]} failed: {out.stderr}"
    return out


def as_json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def inventory() -> GpuInventory:
    found = read_inventory()
    assert found is not None and len(found.devices) >= 2
    return found


def gpus_of(pid: int) -> dict[str, int]:
    """The GPUs NVML (or nvidia-smi) shows the process on, by UUID, with its bytes there."""
    deadline = time.monotonic() + 15
    while True:  # a process that just got its GPU memory back may be listed a moment later
        found = dict(inventory().process_memory.get(pid, {}))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def last_line(text: str) -> str:
    """What the cell printed last (libraries may warn on stderr before it)."""
    return text.strip().splitlines()[-1]


def one_model(inv: GpuInventory) -> tuple[str, str]:
    first, second = sorted(inv.devices, key=lambda d: d.index)[:2]
    assert first.name == second.name, "the remap tests need two GPUs of one model"
    return first.uuid, second.uuid


def start_hog(uuid: str) -> subprocess.Popen[str]:
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid})
    assert hog.stdout is not None
    ready, _, _ = select.select([hog.stdout], [], [], 300)
    line = hog.stdout.readline() if ready else ""
    if not line.startswith("ready"):
        hog.kill()
        _, err = hog.communicate(timeout=30)
        raise AssertionError(f"the process filling GPU 0 did not start: {err[-2000:]}")
    return hog


def stop_hog(hog: subprocess.Popen[str]) -> None:
    hog.kill()
    hog.communicate(timeout=60)


def test_a_kernel_saved_on_gpu0_comes_back_on_gpu1_when_gpu0_is_full(
        store: SnapshotStore, restored: RestoredTrees, figures: dict[str, Any]) -> None:
    uuid0, uuid1 = one_model(inventory())
    k = start_kernel()
    try:
        before = last_line(execute(k.client, ONE_GPU_KERNEL, timeout=300))
        assert set(gpus_of(k.kernel_pid)) == {uuid0}, "the kernel should use GPU 0 only"
        saved = as_json(gpu_snapshot(store, "save", "--pid", str(k.root_pid), "--name", "on0",
                                     "--stop", "--json"))
    finally:
        stop_kernel(k)
    gpu = saved["gpu"]
    assert gpu["visible"][:2] == [uuid0, uuid1]
    assert set(gpu["processes"][0]["devices"]) == {uuid0}
    hog = start_hog(uuid0)
    try:
        free0 = next(d for d in inventory().devices if d.uuid == uuid0).memory_free
        assert free0 < 2 * GIB, f"GPU 0 should be full, has {free0} bytes free"
        # Asked to go back onto the full GPU 0, it is refused before anything runs.
        refused = gpu_snapshot(store, "restore", "on0", "--gpus", "0,1", check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "GPU 0 chosen for cuda:0 has" in refused.stderr, refused.stderr
        started = time.monotonic()
        back = as_json(gpu_snapshot(store, "restore", "on0", "--json"))
        seconds = time.monotonic() - started
        client = restored.connect(Path(back["connection_file"]), back["pid"])
        remap = back["gpu_remap"]
        assert remap["remapped"] and not remap["chosen"], remap
        assert [(d["device"], d["to"]["uuid"]) for d in remap["devices"][:2]] == [
            ("cuda:0", uuid1), ("cuda:1", uuid0)]
        on = gpus_of(back["kernel_pid"])
        assert set(on) == {uuid1}, f"NVML shows the restored kernel on {on}"
        after = last_line(execute(client, "print(checksums())", timeout=300))
        assert after == before and "'cuda:0'" in after
        # And it computes there.
        assert last_line(execute(client, "print(int((x[:1000] + 1).sum()))")) == "8000"
        figures["automatic"] = {
            "restore_s": round(seconds, 3), "timings": back["timings"], "nvml": on,
            "gpu0_free_bytes": free0, "refusal": refused.stderr.strip()[-400:],
            "torch_uuid_of_cuda0_after": execute(
                client, "print(getattr(torch.cuda.get_device_properties(0), 'uuid', None))"
            ).strip(),
        }
    finally:
        stop_hog(hog)


def test_a_kernel_on_both_gpus_comes_back_with_them_swapped(
        store: SnapshotStore, restored: RestoredTrees, figures: dict[str, Any]) -> None:
    uuid0, uuid1 = one_model(inventory())
    k = start_kernel()
    try:
        before = last_line(execute(k.client, TWO_GPU_KERNEL, timeout=300))
        mem_before = gpus_of(k.kernel_pid)
        assert set(mem_before) == {uuid0, uuid1}
        # NVML must tell the two apart for the check after the swap to mean anything.
        assert mem_before[uuid0] > mem_before[uuid1] + GIB, mem_before
        gpu_snapshot(store, "save", "--pid", str(k.root_pid), "--name", "both", "--stop")
    finally:
        stop_kernel(k)
    back = as_json(gpu_snapshot(store, "restore", "both", "--gpus", "1,0", "--json"))
    client = restored.connect(Path(back["connection_file"]), back["pid"])
    remap = back["gpu_remap"]
    assert remap["remapped"] and remap["chosen"], remap
    assert [(d["device"], d["from"]["uuid"], d["to"]["uuid"]) for d in remap["devices"][:2]] \
        == [("cuda:0", uuid0, uuid1), ("cuda:1", uuid1, uuid0)]
    mem_after = gpus_of(back["kernel_pid"])
    assert set(mem_after) == {uuid0, uuid1}
    # The 3 GiB of cuda:0 now sit on GPU 1, the 1 GiB of cuda:1 on GPU 0.
    assert mem_after[uuid1] > mem_after[uuid0] + GIB, mem_after
    after = last_line(execute(client, "print(checksums())", timeout=300))
    assert after == before and "'cuda:0', 'cuda:1'" in after
    assert last_line(execute(client, "print(int((a[:10] * 2).sum()) + int((b[:10] * 2).sum()))")
                     ) == "160"
    figures["swapped"] = {"timings": back["timings"], "nvml_before": mem_before,
                          "nvml_after": mem_after}


def test_a_snapshot_claiming_another_gpu_model_is_refused(
        store: SnapshotStore, restored: RestoredTrees, figures: dict[str, Any]) -> None:
    k = start_kernel()
    try:
        execute(k.client, "import torch; x = torch.ones(2**20, device='cuda')", timeout=300)
        saved = as_json(gpu_snapshot(store, "save", "--pid", str(k.root_pid), "--name",
                                     "model", "--stop", "--json"))
    finally:
        stop_kernel(k)
    path = store.root / saved["id"] / "manifest.json"
    original = path.read_text()
    manifest = json.loads(original)
    here = manifest["gpu"]["devices"][0]["name"]
    other = "NVIDIA A100-SXM4-80GB" if "A100" not in here else "NVIDIA H100 80GB HBM3"
    for device in manifest["gpu"]["devices"]:
        device["name"] = other
    manifest.pop("signature", None)
    manifest["signature"] = store.key.sign(manifest)  # the node's key: the manifest is trusted
    path.write_text(json.dumps(manifest))
    info = manifest["kernel"]["connection_info"]
    refusals = {}
    for args in [(), ("--gpus", "1,0")]:
        out = gpu_snapshot(store, "restore", "model", *args, check=False)
        assert out.returncode == 2, out.stdout + out.stderr
        assert other in out.stderr and here in out.stderr, out.stderr
        assert procfs.ports_in_use(info) == []  # nothing of the image runs
        refusals[" ".join(args) or "automatic"] = out.stderr.strip()[-400:]
    # The same snapshot with its true manifest restores: the model was the only difference.
    path.write_text(original)
    back = as_json(gpu_snapshot(store, "restore", "model", "--json"))
    client = restored.connect(Path(back["connection_file"]), back["pid"])
    assert last_line(execute(client, "print(int(x.sum()))")) == str(2**20)
    figures["refusals"] = refusals
