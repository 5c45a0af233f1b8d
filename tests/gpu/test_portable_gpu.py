"""The portable fallback on a real GPU, through the CLI a user types: a snapshot-ready kernel
holding CUDA state of one framework is saved with its portable copy
(``jupyter gpu-snapshot save --kernel-id ID --portable``) and ended; its image is then
refused, as after a move to a node of another Linux series; and its work comes back in fresh
kernels (``jupyter gpu-snapshot restore NAME --fallback ...``):

1. ``portable`` on this GPU node: every carried tensor bit for bit, on the device it was on;
2. ``portable`` with CUDA hidden from the fresh kernel (a node without a GPU): the same bits,
   on the CPU, and the report says so;
3. ``replay``: the recorded cells re-run, and the cells being deterministic, the same bits.

Scenarios as data, one row per framework. Each row's cells define ``leaves()``: the arrays
whose bytes are compared (sha256 of the raw bytes, computed inside each kernel), with their
dtype, shape and device. Figures (timings, reports, what was not carried) go to the results
file (``JGS_GPU_RESULTS``).

A last scenario writes a small copy of every framework at once and, with
``JGS_PORTABLE_COPY_OUT=DIR``, keeps its files and the digests taken on the GPU in DIR: the
CPU machine's test (``tests/core/test_portable_copy_from_gpu.py``) loads them there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_core.paths import jupyter_runtime_dir

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import Incompatible
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.node.local_engine import make_engine
from testkit.manifests import move_to_another_node

from ..conftest import KernelHandle, connect, execute, run, start_kernel, stop_kernel
from .conftest import DETERMINISTIC_TORCH

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# Sent to every kernel, original and fresh: the leaves' bytes, digested where they live.
# Underscored, so that no copy carries them.
DIGESTS = """
import hashlib as _hashlib, json as _json, sys as _sys
import numpy as _np

def _describe(value):
    torch = _sys.modules.get("torch")
    jax = _sys.modules.get("jax")
    cupy = _sys.modules.get("cupy")
    if torch is not None and isinstance(value, torch.Tensor):
        plain = value.detach()
        raw = plain.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        return [_hashlib.sha256(raw).hexdigest(), str(plain.dtype).removeprefix("torch."),
                list(plain.shape), str(plain.device), "torch"]
    if cupy is not None and isinstance(value, cupy.ndarray):
        host, device, kind = value.get(), f"cuda:{value.device.id}", "cupy"
    elif jax is not None and isinstance(value, jax.Array):
        host, kind = _np.asarray(value), "jax"
        device = ",".join(sorted(f"{d.platform}:{d.id}" for d in value.devices()))
    else:
        host, device, kind = _np.asarray(value), "cpu", "numpy"
    host = _np.ascontiguousarray(host)
    return [_hashlib.sha256(host.tobytes()).hexdigest(), host.dtype.name, list(host.shape),
            device, kind]

def _report():
    print(_json.dumps({name: _describe(value) for name, value in leaves().items()}))
"""
REPORT = "_report()"

TORCH = [
    DETERMINISTIC_TORCH,
    """
import copy, hashlib
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(32, 64, device="cuda")
loss = model(x).square().mean()
loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
""",
    """
half = torch.randn(1000, device="cuda").to(torch.bfloat16)
ids = torch.arange(10, device="cuda")
log = open(os.devnull, "w")
def leaves():
    found = {"x": x, "loss": loss, "half": half, "ids": ids}
    found.update({f"model.{k}": v for k, v in model.state_dict().items()})
    for i, state in enumerate(opt.state.values()):
        found.update({f"opt.{i}.{k}": v for k, v in state.items()})
    return found
def shared():
    return all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
def next_step():
    # One more training step on copies: the optimizer's state is whole if it matches.
    # load_state_dict keeps the very tensors it is given: copied, or the step changes opt.
    m = copy.deepcopy(model)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    batch = torch.randn(32, 64, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    m(batch).square().mean().backward(); o.step()
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in m.parameters())).hexdigest()
""",
]

JAX = [
    """
import os
import jax, jax.numpy as jnp, numpy as np
key = jax.random.PRNGKey(0)
w = jax.random.normal(key, (256, 256))
half = jnp.linspace(-1, 1, 1000, dtype=jnp.bfloat16)
@jax.jit
def layer(v):
    return jnp.tanh(v @ w)
y = layer(w)
params = {"w": w, "y": y, "ints": jnp.arange(7, dtype=jnp.int32)}
log = open(os.devnull, "w")
def leaves():
    return {"key": key, "w": w, "half": half, "y": y, "params.ints": params["ints"]}
""",
]

CUPY = [
    """
import os
import cupy as cp, numpy as np
a = cp.random.default_rng(0).standard_normal((512, 512), dtype=cp.float32)
c = (a @ a.T).astype(cp.float16)
counts = cp.arange(100, dtype=cp.int64)
host = np.linspace(0, 1, 1000)
log = open(os.devnull, "w")
def leaves():
    return {"a": a, "c": c, "counts": counts, "host": host}
""",
]

TRANSFORMERS = [
    """
import os, hashlib
import torch, transformers
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2,
                                 n_head=4)
model = transformers.GPT2LMHeadModel(config).cuda().eval()
ids = torch.tensor([[1, 2, 3, 4, 5]], device="cuda")
with torch.no_grad():
    logits = model(ids).logits
log = open(os.devnull, "w")
def leaves():
    return {"ids": ids, "logits": logits,
            **{f"model.{k}": v for k, v in model.state_dict().items()}}
def shared():
    return model.lm_head.weight is model.transformer.wte.weight
def next_step():
    with torch.no_grad():
        out = model(ids).logits
    return hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()
""",
]


@dataclass(frozen=True)
class Case:
    id: str
    cells: list[str]
    # Names that must come back, beyond the leaves' own roots.
    names: set[str]
    # What the load says when CUDA is hidden from the fresh kernel.
    cpu_note: str
    # Run in the original and in the fresh kernel on the GPU: the same answer expected.
    checks: list[str] = field(default_factory=list)


CASES = [
    Case("torch", TORCH, {"model", "opt", "x", "loss", "half", "ids", "leaves", "shared",
                          "next_step", "torch", "nn"},
         "CUDA is not available here: CUDA tensors were loaded on the CPU",
         ["print(shared(), next_step())"]),
    Case("jax", JAX, {"key", "w", "half", "y", "params", "leaves", "jax", "jnp"},
         "JAX has no GPU here: JAX arrays were loaded on the CPU"),
    Case("cupy", CUPY, {"a", "c", "counts", "host", "leaves", "cp", "np"},
         "CuPy or a GPU is missing here: CuPy arrays came back as NumPy arrays"),
    Case("transformers", TRANSFORMERS, {"model", "config", "ids", "logits", "leaves",
                                        "transformers", "torch"},
         "CUDA is not available here: CUDA tensors were loaded on the CPU",
         ["print(shared(), next_step())"]),
]


# -- the CLI and the kernels it starts --------------------------------------------------------


def cli(store: Path, *args: str, env: dict[str, str] | None = None,
        check: bool = True) -> tuple[subprocess.CompletedProcess[str], float]:
    """``jupyter gpu-snapshot --store STORE ARGS``, and how long it took."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )
    seconds = round(time.monotonic() - started, 2)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done, seconds


class FreshKernels:
    """The standalone kernels that ``restore --fallback`` leaves running, ended afterwards
    whatever happened (found by the shell port their connection file names)."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.clients: list[Any] = []

    def connect(self, connection_file: Path) -> Any:
        self.files.append(connection_file)
        client = connect(connection_file, timeout=120)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.stop_channels()
        for path in self.files:
            end_kernel_of(path)


def end_kernel_of(connection_file: Path) -> None:
    """End the kernel tree listening on the shell port of ``connection_file``."""
    with contextlib.suppress(FileNotFoundError, psutil.NoSuchProcess):
        port = int(json.loads(connection_file.read_text())["shell_port"])
        for conn in psutil.net_connections(kind="tcp"):
            if conn.pid and conn.laddr and conn.laddr.port == port \
                    and conn.status == psutil.CONN_LISTEN:
                procfs.kill_tree(procfs.namespace_init(conn.pid) or conn.pid)
        connection_file.unlink()


@pytest.fixture
def snapshots(tmp_path: Path) -> Iterator[SnapshotStore]:
    """The test's store, removed when it ends: GPU images are gigabytes, the disk small."""
    store = SnapshotStore(tmp_path / "store")
    try:
        yield store
    finally:
        shutil.rmtree(store.root, ignore_errors=True)


@pytest.fixture
def fresh() -> Iterator[FreshKernels]:
    kernels = FreshKernels()
    try:
        yield kernels
    finally:
        kernels.close()


def kernel_with_id() -> tuple[str, KernelHandle]:
    """A snapshot-ready kernel whose connection file is where the CLI looks for its id."""
    kernel_id = str(uuid.uuid4())
    connection_file = Path(jupyter_runtime_dir()) / f"kernel-{kernel_id}.json"
    return kernel_id, start_kernel(connection_file=str(connection_file))


def leaves_of(client: Any) -> dict[str, list[Any]]:
    execute(client, DIGESTS)
    found: dict[str, list[Any]] = json.loads(execute(client, REPORT, timeout=300))
    return found


def fall_back(store: Path, name: str, mode: str, fresh: FreshKernels,
              env: dict[str, str] | None = None) -> tuple[dict[str, Any], Any, float]:
    """``restore NAME --fallback MODE``: its report, a client of its kernel, its seconds."""
    done, seconds = cli(store, "restore", name, "--fallback", mode, "--json", env=env)
    answer = json.loads(done.stdout)
    client = fresh.connect(Path(answer["connection_file"]))
    return answer["fallback"], client, seconds


def same_bits(before: dict[str, list[Any]], after: dict[str, list[Any]]) -> dict[str, bool]:
    """Per leaf: the same digest, dtype and shape (the device is checked apart)."""
    return {name: name in after and after[name][:3] == before[name][:3] for name in before}


# -- the scenario ------------------------------------------------------------------------


def saved_and_refused(case: Case, store: SnapshotStore,
                      figures: dict[str, Any]) -> tuple[str, dict[str, list[Any]], list[str]]:
    """The case's kernel, saved with its portable copy and ended, its image then refused:
    the snapshot's name, the leaves as the kernel had them, and the checks' answers."""
    kernel_id, k = kernel_with_id()
    try:
        for cell in case.cells:
            k.execute(cell, timeout=600)
        before = leaves_of(k.client)
        checks = [k.execute(check, timeout=300) for check in case.checks]
        done, seconds = cli(store.root, "save", "--kernel-id", kernel_id, "--name", case.id,
                            "--portable", "--stop", "--json")
    finally:
        stop_kernel(k)
    summary = json.loads(done.stdout)
    assert summary["fallback"] == ["portable", "replay", "both"], summary
    assert not summary["warnings"], summary["warnings"]
    manifest = store.get(summary["id"]).manifest
    portable = manifest["portable"]
    not_carried = {entry["name"]: entry["reason"] for entry in portable["not_carried"]}
    assert not_carried.get("log") == "an open file", not_carried
    figures.update(
        save_cli_s=seconds, save_timings=summary["timings"], size_bytes=summary["size_bytes"],
        portable_bytes=portable["bytes"], portable_seconds=portable["seconds"],
        carried=[[e["name"], e["kind"], e["devices"]] for e in portable["carried"]],
        not_carried=portable["not_carried"], cells_recorded=summary["cells_recorded"],
        leaves=len(before),
        devices=sorted({leaf[3] for leaf in before.values()}),
    )

    move_to_another_node(store, summary["id"])
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    with pytest.raises(Incompatible) as refused:
        run(engine.restore(summary["id"]))
    assert refused.value.step == "compatibility", refused.value
    said, _ = cli(store.root, "restore", case.id, check=False)
    assert said.returncode == 2, said.stdout + said.stderr
    figures["refused"] = {"step": refused.value.step, "message": refused.value.message,
                          "cli": said.stderr.strip()[-600:]}
    return case.id, before, checks


def loaded_names(report: dict[str, Any]) -> dict[str, str]:
    return {str(entry["name"]): str(entry["device"]) for entry in report["loaded"]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_refused_gpu_kernel_comes_back_by_its_portable_copy_and_its_cells(
    case: Case, snapshots: SnapshotStore, fresh: FreshKernels, figures: dict[str, Any]
) -> None:
    store = snapshots
    name, before, checks = saved_and_refused(case, store, figures)
    # The state was on the GPU (PyTorch keeps an optimizer's step counts on the CPU).
    assert any(leaf[3].startswith(("cuda", "gpu")) for leaf in before.values()), before

    # 1. On this GPU node: every leaf bit for bit, on the device it was on.
    report, client, seconds = fall_back(store.root, name, "portable", fresh)
    back = loaded_names(report)
    assert case.names <= set(back), report
    assert {entry["name"] for entry in report["not_loaded"]} == {
        entry["name"] for entry in figures["not_carried"]}, report
    assert report["replayed"] == []
    on_gpu = leaves_of(client)
    equal = same_bits(before, on_gpu)
    assert all(equal.values()), {n: (before[n], on_gpu.get(n)) for n, ok in equal.items()
                                 if not ok}
    assert {n: leaf[3] for n, leaf in on_gpu.items()} == {
        n: leaf[3] for n, leaf in before.items()}
    # Settings of the process, not of the namespace: the fresh one needs them again for the
    # checks' next step to compute the same bits.
    execute(client, DETERMINISTIC_TORCH if "torch" in back else "pass")
    again = [execute(client, check, timeout=300) for check in case.checks]
    assert again == checks
    figures["portable_gpu"] = {"cli_s": seconds, "loaded": report["loaded"],
                               "not_loaded": report["not_loaded"], "notes": report["notes"],
                               "bitwise_equal": all(equal.values()), "checks_equal": True}

    # 2. As on a node without a GPU: the same bits, on the CPU, and the report says so.
    report, client, seconds = fall_back(store.root, name, "portable", fresh,
                                        env={"CUDA_VISIBLE_DEVICES": ""})
    assert case.names <= set(loaded_names(report)), report
    assert not case.cpu_note or any(note.startswith(case.cpu_note)
                                    for note in report["notes"]), report["notes"]
    on_cpu = leaves_of(client)
    equal = same_bits(before, on_cpu)
    assert all(equal.values()), {n: (before[n], on_cpu.get(n)) for n, ok in equal.items()
                                 if not ok}
    assert all(leaf[3].startswith("cpu") for leaf in on_cpu.values()), on_cpu
    figures["portable_cpu"] = {"cli_s": seconds, "loaded": report["loaded"],
                               "notes": report["notes"], "bitwise_equal": all(equal.values()),
                               "devices": sorted({leaf[3] for leaf in on_cpu.values()}),
                               "kinds": sorted({leaf[4] for leaf in on_cpu.values()})}

    # 3. By its cells: re-run in order, deterministic, so the same bits again.
    report, client, seconds = fall_back(store.root, name, "replay", fresh)
    assert [entry["status"] for entry in report["replayed"]] == ["ok"] * len(
        report["replayed"]), report["replayed"]
    assert len(report["replayed"]) >= len(case.cells)
    replayed = leaves_of(client)
    equal = same_bits(before, replayed)
    assert all(equal.values()), {n: (before[n], replayed.get(n)) for n, ok in equal.items()
                                 if not ok}
    figures["replay"] = {"cli_s": seconds, "cells": len(report["replayed"]),
                         "bitwise_equal": all(equal.values())}

    # Nothing was lost: the snapshot is still listed.
    assert [s.name for s in store.list()] == [name]


# -- a small copy for the CPU machine -----------------------------------------------------

EVERY_FRAMEWORK = """
import os
import numpy as np, torch, cupy as cp, jax, jax.numpy as jnp
torch.manual_seed(0)
weights = torch.randn(256, 128, device="cuda")
half = torch.randn(512, device="cuda").to(torch.bfloat16)
f16 = torch.randn(64, 8, device="cuda", dtype=torch.float16)
ids = torch.arange(100, device="cuda")
mask = torch.rand(50, device="cuda") > 0.5
batch = {"inputs": weights[:4].clone(), "targets": ids[:4].clone(), "label": "first"}
layer = torch.nn.Linear(128, 8).cuda()
grid = cp.arange(60, dtype=cp.float32).reshape(6, 10) / 7
noise = jax.random.normal(jax.random.PRNGKey(0), (16, 16))
ramp = jnp.linspace(0, 1, 33, dtype=jnp.bfloat16)
host = np.arange(12, dtype=np.int32).reshape(3, 4)
note = "written on the GPU"
log = open(os.devnull, "w")
def leaves():
    return {"weights": weights, "half": half, "f16": f16, "ids": ids, "mask": mask,
            "batch.inputs": batch["inputs"], "batch.targets": batch["targets"],
            "layer.weight": layer.weight, "layer.bias": layer.bias, "grid": grid,
            "noise": noise, "ramp": ramp, "host": host}
"""


def test_a_small_copy_of_every_framework_for_the_cpu_machine(
    snapshots: SnapshotStore, tmp_path: Path, figures: dict[str, Any]
) -> None:
    store = snapshots
    kernel_id, k = kernel_with_id()
    try:
        k.execute(EVERY_FRAMEWORK, timeout=600)
        before = leaves_of(k.client)
        done, seconds = cli(store.root, "save", "--kernel-id", kernel_id, "--name", "every",
                            "--portable", "--stop", "--json")
    finally:
        stop_kernel(k)
    summary = json.loads(done.stdout)
    snapshot = store.get(summary["id"])
    portable = snapshot.manifest["portable"]
    assert [e["name"] for e in portable["not_carried"]] == ["log"], portable
    out = Path(os.environ.get("JGS_PORTABLE_COPY_OUT") or tmp_path / "copy")
    out.mkdir(parents=True, exist_ok=True)
    engine = make_engine(GPUSnapshot(store_dir=str(store.root)))
    # The files as a fallback hands them to a kernel: assembled and checked.
    with engine.portable_files(snapshot) as directory:
        for file in portable["files"]:
            shutil.copyfile(directory / file, out / file)
    (out / "digests.json").write_text(json.dumps(
        {"written_on": "GPU", "leaves": before}, indent=1, sort_keys=True) + "\n")
    assert sorted(p.name for p in out.glob("portable.*")) == sorted(portable["files"])
    figures.update(save_cli_s=seconds, portable_bytes=portable["bytes"],
                   files=portable["files"], leaves=before)
