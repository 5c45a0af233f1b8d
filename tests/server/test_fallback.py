"""When the image cannot come back, the work still does: through the REST API, a kernel
saved with a portable copy, its image then refused (another node's Linux) or its restore
failing (criu), comes back in a fresh kernel by its portable copy, by replaying its cells,
or both; and nothing is lost when the fallback fails too.

Scenarios as data, as CRIU's zdtm writes them: each names how the image is made
unrestorable, and every run checks that the snapshot is still listed (and, where the kernel
it was saved from still runs, that it answers).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.criu_wrappers import fails_restoring_while, install
from testkit.manifests import move_to_another_node

from .conftest import Api, KernelConnector

pytestmark = pytest.mark.timeout(240)

STATE = [
    "import numpy as np, hashlib",
    "weights = np.arange(300_000, dtype=np.float32).reshape(600, 500) / 7",
    "table = {'ids': np.arange(1000, dtype=np.int64), 'label': 'run-7'}",
    "def scaled(k):\n    return weights * k",
    "weights = weights + 1",  # a rebinding: the last value is the one to come back
    "log = open(__import__('os').devnull, 'w')",
    "numbers = (i * i for i in range(10))",
]
DIGEST = ("print(hashlib.sha256(weights.tobytes()).hexdigest(), "
          "hashlib.sha256(table['ids'].tobytes()).hexdigest(), table['label'], "
          "float(scaled(2).sum()))")


def _expected() -> str:
    weights = np.arange(300_000, dtype=np.float32).reshape(600, 500) / 7 + 1
    ids = np.arange(1000, dtype=np.int64)
    return (f"{hashlib.sha256(weights.tobytes()).hexdigest()} "
            f"{hashlib.sha256(ids.tobytes()).hexdigest()} run-7 {float((weights * 2).sum())}")


@dataclass(frozen=True)
class Refusal:
    """How a snapshot's image is made unable to come back on this node."""

    id: str
    make: Callable[[SnapshotStore, str, Path], None]
    failed_step: str


def _another_node(store: SnapshotStore, snapshot_id: str, marker: Path) -> None:
    move_to_another_node(store, snapshot_id)


def _criu_fails(store: SnapshotStore, snapshot_id: str, marker: Path) -> None:
    marker.touch()


REFUSALS = [
    Refusal("another-node", _another_node, "compatibility"),
    Refusal("criu-fails", _criu_fails, "restore"),
]


@pytest.fixture
def refuse_marker(tmp_path: Path) -> Path:
    return tmp_path / "refuse-restores"


@pytest.fixture
def criu_path(tmp_path: Path, refuse_marker: Path) -> str:
    return install(tmp_path, fails_restoring_while(refuse_marker))


def _store(store_dir: Path, jp_serverapp: Any) -> SnapshotStore:
    return SnapshotStore(store_dir)  # the server's key: the same Jupyter data dir


async def _saved_with_state(api: Api, kernel_socket: KernelConnector) -> str:
    """A kernel with state, saved with its portable copy and ended, as before a node's
    maintenance: the snapshot's id."""
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    for cell in STATE:
        await ws.execute(cell)
    assert (await ws.execute(DIGEST)).strip() == _expected()
    job = await api.succeeded(
        await api.save(kernel_id, name="before-upgrade", portable=True, stop=True))
    summary = job["result"]
    assert summary["fallback"] == ["portable", "replay", "both"]
    assert summary["cells_recorded"] >= len(STATE) + 1
    return str(summary["id"])


async def _told_what_came_back(ws: Any, mode: str) -> str:
    """The fresh kernel's first cell shows the notebook what came back; the notice."""
    notice = await ws.execute("pass")
    assert notice.startswith("Note: This kernel is a fresh one: snapshot before-upgrade's "
                             f"image could not come back, its work did ({mode}):"), notice
    return notice


def _names(entries: list[dict[str, Any]]) -> set[str]:
    return {str(entry["name"]) for entry in entries}


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.id)
async def test_a_refused_image_comes_back_by_its_portable_copy_and_its_cells(
    refusal: Refusal, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
    store_dir: Path, refuse_marker: Path,
) -> None:
    snapshot_id = await _saved_with_state(api, kernel_socket)
    refusal.make(_store(store_dir, jp_serverapp), snapshot_id, refuse_marker)

    failed = await api.wait(await api.restore(snapshot_id))
    assert failed["status"] == "failed"
    assert failed["error"]["step"] == refusal.failed_step, failed["error"]
    assert failed["error"]["details"]["fallback"] == ["portable", "replay", "both"]

    # By the portable copy: every array bitwise equal; what no copy carries is named.
    fresh_kernels: list[str] = []
    job = await api.succeeded(await api.restore(snapshot_id, fallback="portable"))
    report = job["result"]["fallback"]
    assert {"weights", "table", "scaled", "np", "hashlib"} <= _names(report["loaded"])
    not_back = {entry["name"]: entry["reason"] for entry in report["not_loaded"]}
    assert set(not_back) == {"log", "numbers"}, report
    assert all(not_back.values())
    assert report["replayed"] == []
    fresh_kernels.append(job["result"]["kernel_id"])
    portable = await kernel_socket(job["result"]["kernel_id"])
    assert "Not back: log: not carried: an open file" in await _told_what_came_back(
        portable, "portable")
    assert (await portable.execute(DIGEST)).strip() == _expected()

    # By its cells: the same state, rebuilt; the file and the generator too.
    job = await api.succeeded(await api.restore(snapshot_id, fallback="replay"))
    report = job["result"]["fallback"]
    assert [entry["status"] for entry in report["replayed"]] == ["ok"] * len(report["replayed"])
    assert len(report["replayed"]) >= len(STATE)
    fresh_kernels.append(job["result"]["kernel_id"])
    replayed = await kernel_socket(job["result"]["kernel_id"])
    assert "Re-ran" in await _told_what_came_back(replayed, "replay")
    assert (await replayed.execute(DIGEST)).strip() == _expected()
    assert (await replayed.execute("print(next(numbers), log.closed)")).split() == ["0", "False"]

    # Both: the copy loaded, and only the cells that built what it lacks re-run.
    job = await api.succeeded(await api.restore(snapshot_id, fallback="both"))
    report = job["result"]["fallback"]
    assert report["not_loaded"] == [], report
    rerun = [entry["count"] for entry in report["replayed"]]
    assert len(rerun) == 2, report  # the open file's cell and the generator's
    fresh_kernels.append(job["result"]["kernel_id"])
    both = await kernel_socket(job["result"]["kernel_id"])
    await _told_what_came_back(both, "both")
    assert (await both.execute(DIGEST)).strip() == _expected()
    assert (await both.execute("print(next(numbers))")).strip() == "0"

    # Nothing was lost: the snapshot is listed, and its image restores once it can.
    assert snapshot_id in [s["id"] for s in await api.snapshots()]
    if refusal.id == "criu-fails":
        await asyncio.to_thread(refuse_marker.unlink)
        # The image listens on its kernel's ports again. The fresh kernels took random
        # ones, which may include one of those (freed when that kernel ended): they go
        # first, as the refusal of a taken port would ask.
        for fresh in fresh_kernels:
            await api.ok("DELETE", "api", "kernels", fresh, expect=204)
        job = await api.succeeded(await api.restore(snapshot_id))
        image = await kernel_socket(job["result"]["kernel_id"])
        assert (await image.execute(DIGEST)).strip() == _expected()


async def test_a_fallback_that_fails_too_loses_nothing(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, store_dir: Path,
    tmp_path: Path,
) -> None:
    marker = tmp_path / "kill-on-replay"
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("value = 42")
    # A cell that ends its kernel when re-run after the save (the marker appears later).
    await ws.execute(f"import os\nif os.path.exists({str(marker)!r}): os._exit(3)")
    job = await api.succeeded(await api.save(kernel_id, name="replay-dies"))
    snapshot_id = job["snapshot_id"]
    assert job["result"]["fallback"] == ["replay"]  # no portable copy was asked for
    marker.touch()
    kernels_before = set(await api.kernel_ids())

    # Not offered: the copy was never written.
    code, refused = await api.call("POST", "gpu-snapshot", "snapshots", snapshot_id, "restore",
                                   body={"fallback": "portable"})
    assert code == 400 and "offers replay" in refused["message"], refused

    failed = await api.wait(await api.restore(snapshot_id, fallback="replay"))
    assert failed["status"] == "failed", failed
    assert failed["error"]["step"] == "replay", failed["error"]
    # The fresh kernel is gone, the snapshot listed, the saved kernel still answers.
    assert set(await api.kernel_ids()) == kernels_before
    assert snapshot_id in [s["id"] for s in await api.snapshots()]
    assert (await ws.execute("print(value)")).strip() == "42"


async def test_both_names_what_a_cell_that_fails_again_did_not_bring_back(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, store_dir: Path,
    tmp_path: Path,
) -> None:
    """An open file is in no portable copy; its cell re-runs, and when that fails (the file
    is gone) the report says the name did not come back, rather than leaving it out."""
    data = tmp_path / "data.txt"
    data.write_text("rows")
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("import numpy as np")
    await ws.execute(f"log = open({str(data)!r})")
    await ws.execute("weights = np.ones(10)")
    job = await api.succeeded(
        await api.save(kernel_id, name="with-a-file", portable=True, stop=True))
    snapshot_id = job["result"]["id"]
    data.unlink()
    move_to_another_node(_store(store_dir, jp_serverapp), snapshot_id)

    job = await api.succeeded(await api.restore(snapshot_id, fallback="both"))
    report = job["result"]["fallback"]
    assert [entry["status"] for entry in report["replayed"]] == ["error"], report
    assert _names(report["not_loaded"]) == {"log"}, report
    assert {"weights", "np"} <= _names(report["loaded"])
    assert snapshot_id in [s["id"] for s in await api.snapshots()]
