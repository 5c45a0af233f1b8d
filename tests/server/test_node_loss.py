"""A node that goes away without warning: real server processes, real kernels, real CRIU.

The server and every kernel process are SIGKILLed at once, as a power loss or a kernel
panic ends them, and the page cache is dropped where this machine allows it. The next
server must offer each notebook its newest autosave, restore it with the state it had
then, and list nothing partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from jupyter_gpu_snapshot.core.store import PARTIAL_PREFIX
from testkit.processes import kernel_processes, power_loss

from .conftest import NOTEBOOK, Json, KernelSocket, ServerProcess, ServerProcesses


@pytest.fixture
def snapshot_config() -> Json:
    """An autosave every two seconds, whatever the free disk."""
    return {
        "autosave_interval_minutes": 2 / 60,
        "autosave_check_seconds": 0.2,
        "autosave_min_free_bytes": 0,
    }


def _power_loss(server: ServerProcess, kernel_ids: list[str]) -> None:
    """The server, its children (criu included) and every kernel process end at once."""
    power_loss(server.proc.pid, kernel_ids)
    server.proc.wait()
    for kernel_id in kernel_ids:
        deadline = time.monotonic() + 60
        while kernel_processes(kernel_id):
            assert time.monotonic() < deadline, "a kernel process survived SIGKILL"
            time.sleep(0.05)
    os.sync()
    # What a reboot does to the page cache; not every container may do it.
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _partials(store_dir: Path) -> dict[Path, int]:
    """The store's working directories and the bytes written into each."""
    return {
        entry: sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        for entry in store_dir.iterdir() if entry.name.startswith(PARTIAL_PREFIX)
    }


async def _until_autosaved(server: ServerProcess, kernel_id: str, timeout: float = 90) -> Json:
    """The notebook's first autosave, once its job has ended."""
    deadline = time.monotonic() + timeout
    found: list[Json] = []
    while not found:
        assert time.monotonic() < deadline, f"no autosave:\n{server.log}"
        await asyncio.sleep(0.1)
        found = [
            s for s in await server.api.snapshots(notebook_path=NOTEBOOK)
            if s["reason"] == "autosave"
        ]
    path = ("gpu-snapshot", "kernels", kernel_id, "autosave")
    deadline = time.monotonic() + timeout
    while (await server.api.ok("GET", *path))["autosaving"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    return found[-1]


async def _autosaved_notebook(
    node: ServerProcesses, code: str
) -> tuple[ServerProcess, str, KernelSocket, Json]:
    """A first server whose notebook ran ``code``, and that notebook's autosave since."""
    server = await node.start("before")
    kernel_id, ws = await server.open_notebook_kernel(node.kernel_ids)
    await ws.execute(code)
    return server, kernel_id, ws, await _until_autosaved(server, kernel_id)


async def test_after_a_hard_kill_the_newest_autosave_comes_back(
    server_processes: ServerProcesses,
) -> None:
    node = server_processes
    first, kernel_id, ws, autosave = await _autosaved_notebook(
        node, "import random; random.seed(7); state = {'step': 1}"
    )
    # Work after the autosave that the power loss takes away (no later autosave).
    await first.api.ok(
        "PUT", "gpu-snapshot", "kernels", kernel_id, "autosave", body={"enabled": False}
    )
    expected = (await ws.execute("print(random.random())")).strip()
    await ws.execute("state['step'] = 2; lost = True")
    ws.close()

    _power_loss(first, node.kernel_ids)

    second = await node.start("after")
    # The offer: the notebook's newest snapshot, an autosave, and nothing partial.
    latest = await second.api.snapshots(notebook_path=NOTEBOOK, latest="true")
    assert [s["id"] for s in latest] == [autosave["id"]], latest
    assert latest[0]["reason"] == "autosave" and latest[0]["notebook_path"] == NOTEBOOK
    assert [s["id"] for s in await second.api.snapshots()] == [autosave["id"]]
    assert _partials(node.store_dir) == {}

    new_id = await second.restore_into_notebook(autosave["id"], node.kernel_ids)
    ws = await second.kernel(new_id)
    # The state at the autosave, its RNG included; the later cells are gone.
    assert (await ws.execute("print(state['step'], 'lost' in dir())")).split() == [
        "1", "False",
    ]
    assert (await ws.execute("print(random.random())")).strip() == expected
    ws.close()


async def test_a_kill_during_an_autosave_keeps_the_previous_one(
    server_processes: ServerProcesses,
) -> None:
    node = server_processes
    # Big enough that the next dump takes a while to write.
    first, _, ws, previous = await _autosaved_notebook(
        node, "import os; blob = os.urandom(300 << 20); state = 1"
    )
    await ws.execute("state = 2")

    # The next autosave starts within an interval; kill once its images are on disk.
    deadline = time.monotonic() + 60
    half: Path | None = None
    while half is None:
        assert time.monotonic() < deadline, f"no autosave started:\n{first.log}"
        for entry, written in _partials(node.store_dir).items():
            if written > 16 << 20:
                half = entry
        await asyncio.sleep(0.01)
    ws.close()
    _power_loss(first, node.kernel_ids)
    assert half.exists(), "the save committed before the kill"

    second = await node.start("after")
    assert not half.exists(), "the half-written autosave was not cleaned up"
    listed = await second.api.snapshots()
    assert [s["id"] for s in listed] == [previous["id"]], listed
    latest = await second.api.snapshots(notebook_path=NOTEBOOK, latest="true")
    assert [s["id"] for s in latest] == [previous["id"]]
    store = node.store()
    store.verify(store.get(previous["id"]))

    new_id = await second.restore_into_notebook(previous["id"], node.kernel_ids)
    ws = await second.kernel(new_id)
    assert (await ws.execute("print(state, len(blob))")).split() == ["1", str(300 << 20)]
    ws.close()
