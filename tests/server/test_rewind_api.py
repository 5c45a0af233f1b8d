"""``GET kernels/{id}/timeline`` and ``POST kernels/{id}/rewind`` on a real server with real
snapshot-ready kernels: a point after each cell, a value put back with the kernel's report
and an event for every client, and every refusal with its status and code, nothing changed
by it (a running cell least of all)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.server.wiring import REWIND_EVENT_ID
from testkit.criu_wrappers import gated
from testkit.loop_watch import LoopWatch

from .conftest import Api, Json, KernelConnector, recorded_events
from .test_event_loop import BLOCKING_SECONDS, Poller
from .test_kernel_credentials import _as_kernel
from .test_openapi import SPEC

KERNELS = ("gpu-snapshot", "kernels")


@pytest.fixture
def snapshot_config() -> Json:
    # The server starts its snapshot-ready kernels with a timeline (off by default).
    return {"timeline": True}


def _properties(name: str) -> set[str]:
    return set(SPEC["components"]["schemas"][name]["properties"])


async def timeline(api: Api, kernel_id: str) -> Json:
    data: Json = await api.ok("GET", *KERNELS, kernel_id, "timeline")
    return data


async def refused(api: Api, kernel_id: str, body: Json, status: int, code: str) -> Json:
    """The error a rewind is refused with, its status and code checked."""
    got, error = await api.call("POST", *KERNELS, kernel_id, "rewind", body=body)
    assert (got, error["code"]) == (status, code), (got, error)
    assert set(error) == _properties("Error"), error
    return dict(error)


async def test_rewind_puts_values_back_and_tells_every_client(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
) -> None:
    rewinds = recorded_events(jp_serverapp, REWIND_EVENT_ID)
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("weights = [0.5, 0.25]; steps = 0")
    await ws.execute("weights[0] = 99.0; steps += 1")
    await ws.execute("del steps; scratch = bytearray(1 << 20)")

    listed = await timeline(api, kernel_id)
    assert set(listed) == _properties("Timeline") and listed["running"] is False
    assert [p["count"] for p in listed["points"]] == [1, 2, 3]
    for point in listed["points"]:
        assert set(point) == _properties("TimelinePoint"), point
    second, third = listed["points"][1:]
    assert {"weights", "steps"} <= set(second["changed"])
    assert third["deleted"] == ["steps"] and "scratch" in third["changed"]
    assert third["bytes"] >= 1 << 20 and listed["bytes"] >= third["bytes"]
    assert {2, 3} <= set(listed["rewindable"])

    answer = await api.ok("POST", *KERNELS, kernel_id, "rewind", body={"before": 2})
    report = answer["report"]
    assert set(answer) == {"report"} and set(report) == _properties("RewindReport")
    assert report["before"] == 2 and report["undone"] == [2, 3]
    assert {"weights", "steps"} <= set(report["restored"]) and "scratch" in report["removed"]
    assert report["caveats"]
    assert (await ws.execute("print(weights, steps, 'scratch' in dir())")).strip() == \
        "[0.5, 0.25] 0 False"
    # The undone cells' points are gone; the cell that printed took a point of its own.
    assert [p["count"] for p in (await timeline(api, kernel_id))["points"]] == [1, 4]

    await jp_serverapp.event_logger.gather_listeners()
    assert rewinds == [{"kernel_id": kernel_id, "report": report}]


async def test_no_callback_holds_the_loop_while_a_kernel_rewinds(
    api: Api, kernel_socket: KernelConnector,
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("import numpy as np; weights = np.ones(16 << 20)")  # 128 MiB
    await ws.execute("weights *= 3")
    status = Poller(api, "api", "status")
    with LoopWatch(asyncio.get_running_loop(), BLOCKING_SECONDS) as watch:
        status.start()
        await timeline(api, kernel_id)
        report = (await api.ok("POST", *KERNELS, kernel_id, "rewind", body={"before": 2}))[
            "report"]
        answers = await status.stop()
    assert report["restored"] == ["weights"]
    assert watch.held == [], [vars(h) for h in watch.held]
    assert answers > 0
    assert (await ws.execute("print(weights.sum() == weights.size)")).strip() == "True"


async def test_a_rewind_while_a_cell_runs_is_refused_and_the_cell_goes_on(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, tmp_path: Path,
) -> None:
    rewinds = recorded_events(jp_serverapp, REWIND_EVENT_ID)
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("state = 'first'")
    await ws.execute("state = 'second'")
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    cell = asyncio.create_task(ws.execute(
        f"state = 'from the cell: ' + open({str(gate)!r}).read(); print(state)"))
    # Opening a fifo's writing end returns once the cell has opened its reading end.
    writer = await asyncio.to_thread(open, gate, "w")
    try:
        error = await refused(api, kernel_id, {"before": 2}, 409, "kernel_busy")
        assert error["message"] == ("rewind failed: a cell is running: wait for it or "
                                    "interrupt it, then rewind"), error
        assert error["details"] == {"ename": "KernelBusy"}
        assert (await timeline(api, kernel_id))["running"] is True
        assert not cell.done()
    finally:
        writer.write("undisturbed")
        writer.close()
    assert (await cell).strip() == "from the cell: undisturbed"
    assert (await ws.execute("print(state)")).strip() == "from the cell: undisturbed"
    await jp_serverapp.event_logger.gather_listeners()
    assert rewinds == []


async def test_the_cli_rewinds_a_servers_kernel_by_its_connection_file(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
) -> None:
    rewinds = recorded_events(jp_serverapp, REWIND_EVENT_ID)
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("value = 'kept'")
    await ws.execute("value = 'newer'")
    connection_file = jp_serverapp.kernel_manager.get_kernel(kernel_id).connection_file
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "rewind",
                         connection_file, "--before", "2", "--json"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["report"]["undone"] == [2]
    assert [p["count"] for p in (await timeline(api, kernel_id))["points"]] == [1]
    assert (await ws.execute("print(value)")).strip() == "kept"
    # The server did not make it: no event claims it did.
    await jp_serverapp.event_logger.gather_listeners()
    assert rewinds == []


async def test_bad_requests_unknown_kernels_and_counts_out_of_reach(
    api: Api, kernel_socket: KernelConnector,
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("value = 'kept'")
    await ws.execute("value = 'newer'")
    rewindable = (await timeline(api, kernel_id))["rewindable"]

    error = await refused(api, kernel_id, {"before": 40}, 400, "rewind_out_of_range")
    assert error["step"] == "rewind" and "cannot rewind to before cell 40" in error["cause"]
    assert error["details"] == {"ename": "RewindOutOfRange", "rewindable": rewindable}
    for body, words in (({}, "names no cell"), ({"before": "2"}, "wrong type"),
                        ({"before": True}, "execution count"), ({"before": 0}, "no cell [0]"),
                        ({"before": 2, "after": 1}, "unknown field 'after'")):
        error = await refused(api, kernel_id, body, 400, "invalid_request")
        assert words in error["message"], (body, error)

    # A kernel of another kernelspec keeps no timeline: told at once, not after a wait.
    plain = await api.start_kernel("python3")
    for method, route, body in (("GET", "timeline", None), ("POST", "rewind", {"before": 1})):
        got, error = await api.call(method, *KERNELS, plain, route, body=body)
        assert (got, error["code"]) == (409, "not_ready"), error
        assert f"kernel {plain} is not snapshot-ready" in error["message"], error

    stranger = str(uuid.uuid4())
    for method, route, body in (("GET", "timeline", None), ("POST", "rewind", {"before": 1})):
        got, error = await api.call(method, *KERNELS, stranger, route, body=body)
        assert (got, error["code"], error["step"]) == (404, "not_found", "lookup"), error
    # Nothing above changed the kernel.
    assert (await ws.execute("print(value)")).strip() == "newer"


async def test_a_kernels_credential_reaches_its_own_timeline_only(
    api: Api, jp_serverapp: Any, kernel_socket: KernelConnector,
) -> None:
    mine, theirs = await api.start_kernel(), await api.start_kernel()
    for kernel_id in (mine, theirs):
        await (await kernel_socket(kernel_id)).execute("marker = 1")
    as_mine = _as_kernel(api, jp_serverapp, mine)
    assert [p["count"] for p in (await timeline(as_mine, mine))["points"]] == [1]
    for method, route, body in (("GET", "timeline", None), ("POST", "rewind", {"before": 1})):
        got, error = await as_mine.call(method, *KERNELS, theirs, route, body=body)
        assert (got, error["code"]) == (403, "forbidden"), error
    assert [p["count"] for p in (await timeline(api, theirs))["points"]] == [1]


class TestWhileTheServerWorksOnTheKernel:
    """criu waits at its dump until the test opens the gate: a save, and a hibernation's
    save, hold their kernels meanwhile."""

    @pytest.fixture
    def criu_path(self, tmp_path: Path) -> str:
        return gated(tmp_path, "dump")[0]

    async def test_a_save_or_a_hibernation_holds_the_rewind_off(
        self, api: Api, kernel_socket: KernelConnector, tmp_path: Path,
    ) -> None:
        saved, sleeping = await api.start_kernel(), await api.start_kernel()
        for kernel_id in (saved, sleeping):
            ws = await kernel_socket(kernel_id)
            await ws.execute("value = 'kept'")
            await ws.execute("value = 'newer'")
        save = await api.save(saved)
        hibernation = await api.ok("POST", *KERNELS, sleeping, "hibernate", expect=202)
        try:
            error = await refused(api, saved, {"before": 2}, 409, "busy")
            assert error["details"] == {"in_use_by": "save", "job_id": save["id"]}, error
            assert f"a save job ({save['id']})" in error["message"]
            error = await refused(api, sleeping, {"before": 2}, 409, "not_ready")
            assert f"kernel {sleeping} is hibernating" in error["message"], error
            got, error = await api.call("GET", *KERNELS, sleeping, "timeline")
            assert (got, error["code"]) == (409, "not_ready"), error
        finally:
            (tmp_path / "dump-may-start").touch()
        await api.succeeded(save)
        await api.succeeded(await api.ok("GET", "gpu-snapshot", "jobs", hibernation["job_id"]))
        # Once the save is done, the kernel is its own again.
        report = (await api.ok("POST", *KERNELS, saved, "rewind", body={"before": 2}))["report"]
        assert report["undone"] == [2] and report["restored"] == ["value"]
