"""Autosave scheduling, retention and the budgeted shutdown, with a real server, real
python3-snapshot kernels and real CRIU. Intervals are seconds here (fractions of a minute)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs

from .conftest import Api, Json, KernelConnector

SECOND = 1 / 60  # the settings are in minutes


def _policy(**settings: Any) -> dict[str, Any]:
    """Fast checks and no disk margin, unless a test class says otherwise."""
    return {
        "autosave_check_seconds": 0.2,
        "autosave_after_cell_minutes": 60.0,
        "autosave_min_free_bytes": 0,
        **settings,
    }


def _app(jp_serverapp: Any) -> Any:
    return next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]))


async def _start_scheduler(jp_serverapp: Any) -> Any:
    """What the server does once it listens (pytest-jupyter's server never gets there)."""
    app = _app(jp_serverapp)
    app.parts.autosave.start()
    return app


async def _autosaves(api: Api, notebook: str) -> list[Json]:
    return [s for s in await api.snapshots(notebook_path=notebook) if s["reason"] == "autosave"]


async def _until_autosaves(api: Api, notebook: str, count: int, timeout: float = 90) -> list[Json]:
    deadline = time.monotonic() + timeout
    while True:
        found = await _autosaves(api, notebook)
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} autosaves of {notebook}, not {count}"
        await asyncio.sleep(0.2)


async def _notebook(
    api: Api, kernel_socket: KernelConnector, path: str
) -> tuple[str, Any]:
    """A session for the notebook ``path`` and a connection to its kernel."""
    kernel_id = (await api.open_notebook(path))["kernel"]["id"]
    return kernel_id, await kernel_socket(kernel_id)


async def _until_skipped(api: Api, kernel_id: str, timeout: float = 30) -> str:
    """Until the scheduler says why it skipped the kernel; that reason."""
    deadline = time.monotonic() + timeout
    while True:
        state = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave")
        if state["last_skip"]:
            return str(state["last_skip"])
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.2)


async def _until_idle(api: Api, kernel_id: str, timeout: float = 90) -> None:
    """Until no job holds the kernel (an autosave may be under way)."""
    deadline = time.monotonic() + timeout
    while (await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave"))["autosaving"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


class TestSchedule:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        return _policy(autosave_interval_minutes=2 * SECOND)

    async def test_idle_kernels_are_not_saved_again(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        await _start_scheduler(jp_serverapp)
        kernel_id, ws = await _notebook(api, kernel_socket, "idle.ipynb")
        # A kernel that ran nothing has nothing to lose.
        await asyncio.sleep(3)
        assert await _autosaves(api, "idle.ipynb") == []

        await ws.execute("state = 1")
        first = await _until_autosaves(api, "idle.ipynb", 1)
        assert first[0]["notebook_path"] == "idle.ipynb"
        assert first[0]["kernel"]["kernel_id"] == kernel_id
        # Several intervals of idleness: nothing new.
        await asyncio.sleep(5)
        assert [s["id"] for s in await _autosaves(api, "idle.ipynb")] == [first[0]["id"]]
        state = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave")
        assert state["unsaved_work"] is False and state["next_autosave"] is None
        assert state["last_autosave"]["snapshot_id"] == first[0]["id"]
        assert state["last_autosave"]["pause"] > 0

        await ws.execute("state = 2")
        second = await _until_autosaves(api, "idle.ipynb", 2)
        assert second[0]["id"] == first[0]["id"] and second[1]["created"] > first[0]["created"]

    async def test_a_notebook_can_turn_autosave_off_and_change_the_interval(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        app = await _start_scheduler(jp_serverapp)
        session = await api.open_notebook("quiet.ipynb")
        kernel_id = session["kernel"]["id"]
        path = ("gpu-snapshot", "kernels", kernel_id, "autosave")
        state = await api.ok("PUT", *path, body={"enabled": False})
        assert state["policy"]["enabled"] is False and state["override"] == {"enabled": False}
        ws = await kernel_socket(kernel_id)
        await ws.execute("state = 1")
        await asyncio.sleep(3)
        assert await _autosaves(api, "quiet.ipynb") == []

        for bad in ({"interval_minutes": "10"}, {"interval_minutes": 0}, {"every": 3},
                    {"enabled": 1}, {"after_cell_minutes": -1},
                    {"release_gpu_after_minutes": -1}, {"release_gpu_after_minutes": True}):
            code, error = await api.call("PUT", *path, body=bad)
            assert code == 400, (bad, error)
        # When the idle kernel gives its GPU back rides in the same policy: the server's
        # setting until the notebook chooses.
        assert state["policy"]["release_gpu_after_minutes"] == 10
        state = await api.ok("PUT", *path, body={"enabled": None, "interval_minutes": 1.0,
                                                 "release_gpu_after_minutes": 0})
        assert state["override"] == {"interval_minutes": 1.0, "release_gpu_after_minutes": 0}
        assert state["policy"]["enabled"] is True and state["next_autosave"] is not None
        assert state["policy"]["release_gpu_after_minutes"] == 0
        # The override is kept in the store for the next server.
        assert app.parts.autosave.policies.read_overrides()["quiet.ipynb"] == state["override"]
        # Not due for a minute, whatever the server's interval.
        await asyncio.sleep(3)
        assert await _autosaves(api, "quiet.ipynb") == []


    async def test_a_cell_run_as_soon_as_the_kernel_starts_is_work(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        # The scheduler is not started: it never discovers the kernel by itself, as when it
        # looks late on a busy machine. Its cells are followed from the kernel's start.
        kernel_id, ws = await _notebook(api, kernel_socket, "early.ipynb")
        await ws.execute("state = 1")
        deadline = time.monotonic() + 10
        while True:
            state = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave")
            if state["unsaved_work"]:
                break
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.1)
        assert state["next_autosave"] is not None

    @pytest.mark.parametrize("cells", [0, 1])
    async def test_cells_run_before_the_feed_listened_are_found_by_asking_the_kernel(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, cells: int
    ) -> None:
        # A feed made late, as when its subscription takes effect only after a client ran a
        # cell: the kernel's own count tells whether it ran any.
        app = _app(jp_serverapp)
        kernel_id, ws = await _notebook(api, kernel_socket, f"late-{cells}.ipynb")
        for n in range(cells):
            await ws.execute(f"state = {n}")
        app.parts.autosave._forget(kernel_id)
        start = {"action": "start", "status": "success", "kernel_id": kernel_id}
        await app.parts.autosave.on_kernel_action(None, "", start)
        probe = app.parts.autosave._watch[kernel_id].probe
        await asyncio.wait_for(asyncio.shield(probe), 60)
        assert (app.parts.autosave.work_at_risk(kernel_id) > 0) == (cells > 0)

    async def test_a_kernel_not_yet_asked_counts_as_work_at_shutdown(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        # A server stopped right after a kernel started and ran a cell: the feed may have
        # missed the cell, and the kernel's answer is still on its way.
        app = _app(jp_serverapp)
        kernel_id, _ws = await _notebook(api, kernel_socket, "unasked.ipynb")
        watch = app.parts.autosave._watch[kernel_id]
        await asyncio.wait_for(asyncio.shield(watch.probe), 60)
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watch.probe = answer  # an answer not yet in
        assert app.parts.autosave.work_at_risk(kernel_id) == float("inf")
        await app.parts.autosave.probes_settled(0.2)  # bounded: the shutdown goes on
        answer.set_result(None)
        assert app.parts.autosave.work_at_risk(kernel_id) == 0

    async def test_a_restored_kernel_is_clean_until_it_runs_a_cell(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        app = await _start_scheduler(jp_serverapp)
        await app.parts.autosave.stop()  # only what the shutdown would ask
        kernel_id = await api.start_kernel()
        ws = await kernel_socket(kernel_id)
        await ws.execute("kept = 1")
        new_id = await api.saved_and_restored(kernel_id)
        await app.parts.autosave.tick()
        await app.parts.autosave.probes_settled(60)  # until then its work is not known
        assert app.parts.autosave.work_at_risk(new_id) == 0
        ws = await kernel_socket(new_id)
        await ws.execute("kept = 2")
        await app.parts.autosave.tick()
        assert app.parts.autosave.work_at_risk(new_id) > 0

    async def test_kernels_that_are_not_snapshot_ready_are_left_alone(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        await _start_scheduler(jp_serverapp)
        kernel_id = await api.start_kernel("python3")
        ws = await kernel_socket(kernel_id)
        await ws.execute("state = 1")
        assert "not snapshot-ready" in await _until_skipped(api, kernel_id)
        await asyncio.sleep(2)
        # No job was started for it, so no failure reached anyone.
        assert (await api.ok("GET", "gpu-snapshot", "jobs"))["jobs"] == []
        assert await api.snapshots() == []


class TestLongCell:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        return _policy(autosave_interval_minutes=60.0, autosave_after_cell_minutes=2 * SECOND)

    async def test_a_long_cell_is_saved_when_it_ends(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        await _start_scheduler(jp_serverapp)
        kernel_id, ws = await _notebook(api, kernel_socket, "train.ipynb")
        await ws.execute("import time; short = 1")
        await asyncio.sleep(2)
        assert await _autosaves(api, "train.ipynb") == [], "a short cell triggered a save"

        await ws.execute("time.sleep(4); trained = 'yes'")
        ended = time.time()
        saved = await _until_autosaves(api, "train.ipynb", 1, timeout=60)
        # Taken after the cell, so it holds its result.
        assert saved[0]["created"] >= ended - 0.5
        await _until_idle(api, kernel_id)
        # The restore listens on the original's ports: the original goes first.
        await api.ok("DELETE", "api", "kernels", kernel_id, expect=204)
        restored = await api.succeeded(await api.restore(saved[0]["id"]))
        ws2 = await kernel_socket(restored["result"]["kernel_id"])
        assert (await ws2.execute("print(trained)")).strip() == "yes"


class TestRetention:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        return _policy(autosave_interval_minutes=1 * SECOND, autosave_keep=2)

    async def test_keeps_the_newest_autosaves_and_every_user_snapshot(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        await _start_scheduler(jp_serverapp)
        kernel_id, ws = await _notebook(api, kernel_socket, "kept.ipynb")
        await ws.execute("n = 0")
        await _until_autosaves(api, "kept.ipynb", 1)
        await _until_idle(api, kernel_id)
        named = (await api.succeeded(await api.save(kernel_id, name="mine")))["snapshot_id"]
        seen: list[str] = []
        for n in range(1, 4):
            await ws.execute(f"n = {n}")
            deadline = time.monotonic() + 90
            while True:
                ids = [s["id"] for s in await _autosaves(api, "kept.ipynb")]
                if ids and ids[-1] not in seen:
                    break
                assert time.monotonic() < deadline, "no new autosave"
                await asyncio.sleep(0.2)
            seen.append(ids[-1])
            # Listed once committed; the job then deletes what it made obsolete.
            await _until_idle(api, kernel_id)
            ids = [s["id"] for s in await _autosaves(api, "kept.ipynb")]
            assert len(ids) <= 2 and ids[-1] == seen[-1], ids
        assert [s["id"] for s in await _autosaves(api, "kept.ipynb")] == seen[-2:]
        listed = {s["id"]: s for s in await api.snapshots(notebook_path="kept.ipynb")}
        assert named in listed and listed[named]["reason"] == "user"


class TestDiskMargin:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        # No disk has that much.
        return _policy(autosave_interval_minutes=1 * SECOND, autosave_min_free_bytes=1 << 60)

    async def test_an_autosave_that_would_fill_the_disk_is_skipped(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        await _start_scheduler(jp_serverapp)
        kernel_id, ws = await _notebook(api, kernel_socket, "full.ipynb")
        await ws.execute("state = 1")
        assert "autosave_min_free_bytes" in await _until_skipped(api, kernel_id)
        assert await api.snapshots() == []
        # No failed job either: the skip happened before anything started.
        assert (await api.ok("GET", "gpu-snapshot", "jobs"))["jobs"] == []
        assert (await ws.execute("print(state)")).strip() == "1"


class TestBudgetedShutdown:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        # 20 MB/s makes a 400 MB kernel a 20 s save: more than the whole budget.
        return _policy(
            snapshot_on_shutdown=True,
            shutdown_budget=12.0,
            save_image_rate=20e6,
            save_fixed_seconds=1.0,
            autosave_interval_minutes=1 * SECOND,
        )

    async def test_kernels_that_fit_are_saved_and_the_big_one_keeps_its_autosave(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        app = await _start_scheduler(jp_serverapp)
        big = (await api.open_notebook("big.ipynb"))["kernel"]["id"]
        small = (await api.open_notebook("small.ipynb"))["kernel"]["id"]
        idle = (await api.open_notebook("idle.ipynb"))["kernel"]["id"]
        ws_big = await kernel_socket(big)
        ws_small = await kernel_socket(small)
        await ws_big.execute("import os; blob = os.urandom(400 << 20); step = 1")
        autosave = (await _until_autosaves(api, "big.ipynb", 1))[-1]
        await _until_idle(api, big)
        await app.parts.autosave.stop()
        await ws_big.execute("step = 2")  # work the shutdown cannot save in time
        await ws_small.execute("step = 'small'")
        roots = {k: jp_serverapp.kernel_manager.get_kernel(k).provisioner.root_pid
                 for k in (big, small)}

        await jp_serverapp.extension_manager.stop_all_extensions()
        report = app.last_shutdown
        assert list(report.saved) == [small], report
        assert "keeps its newest snapshot" in report.skipped[big], report
        assert autosave["id"] in report.skipped[big]
        # The idle kernel is not saved again. On a busy machine it may have been autosaved
        # before it could be asked whether it ran anything (it then counts as work): the
        # shutdown names that autosave.
        idle_autosaves = await _autosaves(api, "idle.ipynb")
        assert report.skipped[idle] == (
            f"nothing ran since its snapshot {idle_autosaves[-1]['id']}" if idle_autosaves
            else "it has run nothing"), report
        assert not procfs.tree_alive(roots[small])
        listed = {s["id"]: s for s in await api.snapshots()}
        assert listed[report.saved[small]]["reason"] == "shutdown"
        assert autosave["id"] in listed
