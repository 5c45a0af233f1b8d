"""A snapshot-ready kernel that dies is never silently replaced by a blank one.

The server's restarter starts a blank kernel in the slot of one that died; the kernel's
status then says that it died, what killed it (from nsinit's line in the kernel's log),
and which snapshot brings it back, until the user dismisses it. Real kernels, killed with
real signals; a kernel shut down or restarted on purpose records nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.server.wiring import DEATH_EVENT_ID

from .conftest import Api, Json, KernelConnector, recorded_events

# Deaths are noticed by the restarter's poll, then the blank kernel must start: slow on a
# busy two-core machine.
DEATH_SECONDS = 90.0


@pytest.fixture
def server_config() -> Json:
    # The restarter looks every half second instead of every 3 s.
    return {"KernelRestarter": {"time_to_dead": 0.5}}


@pytest.fixture
def death_events(jp_serverapp: Any) -> list[Json]:
    """Every kernel-death event the server emits during the test."""
    return recorded_events(jp_serverapp, DEATH_EVENT_ID)


async def status(api: Api, kernel_id: str) -> Json:
    data: Json = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    return data


async def wait_death(api: Api, kernel_id: str) -> Json:
    """The kernel's status once it carries a death."""
    deadline = time.monotonic() + DEATH_SECONDS
    while True:
        current = await status(api, kernel_id)
        if current["death"] is not None:
            return current
        assert time.monotonic() < deadline, f"no death in {DEATH_SECONDS}s: {current}"
        await asyncio.sleep(0.2)


async def until_restarted(kernel_socket: KernelConnector, kernel_id: str) -> None:
    """Until the blank kernel the restarter started answers a cell: a test that ended while
    it still started would leave the server's shutdown a kernel in the middle of a restart."""
    ws = await kernel_socket(kernel_id)
    await ws.execute("pass", timeout=DEATH_SECONDS)


def kill_kernel(jp_serverapp: Any, kernel_id: str, signum: int) -> int:
    """Send ``signum`` to the kernel process (not its namespace init); its pid."""
    root = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid
    kernel = procfs.kernel_of(root)
    assert kernel is not None and kernel.pid != root
    os.kill(kernel.pid, signum)
    return int(kernel.pid)


async def test_a_dead_kernel_is_reported_with_its_cause_and_newest_snapshot(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, death_events: list[Json]
) -> None:
    saved = (await api.open_notebook("work/saved.ipynb"))["kernel"]["id"]
    bare = (await api.open_notebook("work/bare.ipynb"))["kernel"]["id"]
    ws = await kernel_socket(saved)
    await ws.execute("weights = [1, 2, 3]")
    await api.succeeded(await api.save(saved, name="older"))
    newest = (await api.succeeded(await api.save(saved, name="before-crash")))["result"]
    await (await kernel_socket(bare)).execute("x = 1")
    assert (await status(api, saved))["death"] is None

    killed_at = time.time()
    kill_kernel(jp_serverapp, saved, signal.SIGSEGV)
    kill_kernel(jp_serverapp, bare, signal.SIGSEGV)

    death = (await wait_death(api, saved))["death"]
    assert death == {
        "at": death["at"],
        "code": "signal",
        "cause": "killed by signal 11 (SIGSEGV)",
        "signal": 11,
        "signal_name": "SIGSEGV",
        "exit_status": None,
        "restarted": True,
        "notebook_path": "work/saved.ipynb",
        "snapshot": {"id": newest["id"], "name": "before-crash", "created": newest["created"]},
    }
    assert killed_at <= death["at"] <= time.time()
    # A notebook without a snapshot is told of the death, and that there is none.
    bare_death = (await wait_death(api, bare))["death"]
    assert (bare_death["code"], bare_death["signal"], bare_death["snapshot"]) == (
        "signal", 11, None)
    await until_restarted(kernel_socket, bare)

    # The slot holds a blank kernel under the same id: the variable is gone.
    assert saved in await api.kernel_ids()
    ws = await kernel_socket(saved)
    assert (await ws.execute("print('weights' in globals())", timeout=DEATH_SECONDS)).strip() \
        == "False"
    assert {e["kernel_id"] for e in death_events} == {saved, bare}
    event = next(e for e in death_events if e["kernel_id"] == saved)
    assert {k: v for k, v in event.items() if k != "kernel_id"} == death

    # Dismissed, it is gone from this kernel's status only.
    await api.ok("DELETE", "gpu-snapshot", "kernels", saved, "death", expect=204)
    assert (await status(api, saved))["death"] is None
    assert (await status(api, bare))["death"] == bare_death
    await api.ok("DELETE", "gpu-snapshot", "kernels", saved, "death", expect=204)
    code, _ = await api.call(
        "DELETE", "gpu-snapshot", "kernels", "00000000-0000-0000-0000-000000000000", "death"
    )
    assert code == 404


async def test_restarts_and_shutdowns_on_purpose_are_no_death(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, death_events: list[Json]
) -> None:
    kernel_id = (await api.open_notebook("work/restarted.ipynb"))["kernel"]["id"]
    other = (await api.open_notebook("work/shut.ipynb"))["kernel"]["id"]
    ws = await kernel_socket(kernel_id)
    await ws.execute("state = 1")
    await (await kernel_socket(other)).execute("state = 2")

    await api.ok("POST", "api", "kernels", kernel_id, "restart")
    await api.ok("DELETE", "api", "kernels", other, expect=204)
    app = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]))
    await app.parts.deaths.settled()
    assert (await status(api, kernel_id))["death"] is None
    assert death_events == []

    # The restarted kernel is still watched: its own death is reported, as an exit.
    ws = await kernel_socket(kernel_id)
    # The cell ends first; the kernel exits half a second later.
    await ws.execute("import os, threading; threading.Timer(0.5, os._exit, (3,)).start()")
    death = (await wait_death(api, kernel_id))["death"]
    assert (death["code"], death["exit_status"], death["cause"]) == (
        "exit", 3, "exited with status 3")
    assert death["snapshot"] is None
    assert [e["kernel_id"] for e in death_events] == [kernel_id]
    await until_restarted(kernel_socket, kernel_id)


async def test_a_restored_kernel_that_dies_is_reported_from_its_own_log(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
) -> None:
    # A restored kernel is adopted, no child of the server, and writes the log of the
    # kernel it was saved from: only nsinit's line there says what killed it.
    original = (await api.open_notebook("work/restored.ipynb"))["kernel"]["id"]
    await (await kernel_socket(original)).execute("epoch = 7")
    saved = (await api.succeeded(await api.save(original, stop=True)))["result"]
    restored = (await api.succeeded(
        await api.restore(saved["id"], path="work/restored.ipynb")
    ))["result"]["kernel_id"]
    ws = await kernel_socket(restored)
    assert (await ws.execute("print(epoch)")).strip() == "7"

    kill_kernel(jp_serverapp, restored, signal.SIGBUS)
    death = (await wait_death(api, restored))["death"]
    assert (death["code"], death["cause"]) == ("signal", "killed by signal 7 (SIGBUS)")
    assert death["snapshot"] == {
        "id": saved["id"], "name": saved["name"], "created": saved["created"]}
    assert death["notebook_path"] == "work/restored.ipynb"
    # A blank kernel took the slot, as JupyterLab users expect.
    ws = await kernel_socket(restored)
    assert (await ws.execute("print('epoch' in globals())", timeout=DEATH_SECONDS)).strip() \
        == "False"
