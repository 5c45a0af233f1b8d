"""Hibernation's gpu tier through a real server: the GPU released and the process kept.

Real server, real kernels, a real holder process stopping their threads under ptrace; only
the CUDA driver is the scripted stand-in (``testkit/fake_driver.py``). Every scenario
checks that the kernel ends either awake with its state (same process, threads running, CUDA
running) or asleep with nothing lost (threads held, CUDA checkpointed).
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.procfs import thread_states
from jupyter_gpu_snapshot.gpu.driver import CUDA_ERROR_OUT_OF_MEMORY, ProcessState
from jupyter_gpu_snapshot.server.hibernation import Hibernation
from jupyter_gpu_snapshot.server.sleepers import Sleepers
from testkit.criu_wrappers import fails_writing_pages, install
from testkit.fake_driver import (
    GIB,
    RESTORE_THREAD_CODE,
    FakeCudaDriver,
    FakeGpus,
    fake_cuda_bytes,
)

from .conftest import (
    JOB_TIMEOUT,
    Api,
    Json,
    KernelConnector,
    recorded_events,
    serve_with_fake_cuda,
)
from .test_hibernation import (
    HIBERNATION_EVENT_ID,
    collect,
    execute,
    extension,
    hibernation,
    idle_past,
    kept_outputs,
    notebook_kernel,
    printed,
    root_of,
    send,
    until_idle,
    until_state,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="holding threads needs root")


@pytest.fixture
def kernel_bytes() -> int:
    return 2 * GIB


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch, kernel_bytes: int) -> FakeCudaDriver:
    """One fake GPU of 80 GiB; each of the server's kernels holds ``kernel_bytes`` on it."""
    fake = FakeCudaDriver()
    serve_with_fake_cuda(monkeypatch, FakeGpus(fake), kernel_bytes)
    return fake


@pytest.fixture
def snapshot_config(driver: FakeCudaDriver) -> Json:
    return {"autosave": False, "autosave_check_seconds": 0.2}


@pytest.fixture
def events(jp_serverapp: Any) -> list[Json]:
    return recorded_events(jp_serverapp, HIBERNATION_EVENT_ID)


def asleep_as_the_driver_wants(root: int, driver: FakeCudaDriver) -> bool:
    """Every thread of the kernel is in a ptrace stop but the driver's restore thread, and
    its CUDA state is checkpointed."""
    kernel = psutil.Process(root).children()[0].pid if _is_nsinit(root) else root
    restore_tid = driver.restore_thread_id(kernel)
    states = thread_states(kernel)
    return (driver.state(kernel) == ProcessState.CHECKPOINTED
            and all(s == "t" for tid, s in states.items() if tid != restore_tid))


def _is_nsinit(pid: int) -> bool:
    return "nsinit" in " ".join(psutil.Process(pid).cmdline())


async def sleeping_kernel(api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
                          notebook: str = "sleepy.ipynb") -> tuple[str, Any, int]:
    kernel_id, sock = await notebook_kernel(api, kernel_socket, notebook)
    await sock.execute(RESTORE_THREAD_CODE + "import os\nstate = list(range(5))")
    root = root_of(jp_serverapp, kernel_id)
    await until_idle(api, kernel_id)
    await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate",
                 body={"tier": "gpu"}, expect=202)
    found = await until_state(api, kernel_id, "hibernated")
    assert found is not None and found["tier"] == "gpu" and found["snapshot_id"] is None
    assert found["gpu_bytes_freed"] == 2 * GIB and found["host_bytes_freed"] == 0
    return kernel_id, sock, root


async def test_the_gpu_tier_keeps_the_process_and_the_next_cell_wakes_it_in_place(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
    events: list[Json],
) -> None:
    kernel_id, sock, root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
    assert asleep_as_the_driver_wants(root, driver)
    listed = {k["id"]: k for k in await api.ok("GET", "api", "kernels")}
    assert listed[kernel_id]["execution_state"] == "hibernated"
    # A save would need criu to seize threads that the holder holds: refused, clearly.
    code, error = await api.call("POST", "gpu-snapshot", "kernels", kernel_id, "snapshots",
                                 body={})
    assert code == 409 and "sleeps with its GPU released" in error["message"]

    (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
    answers = (await collect(sock, [msg_id]))[msg_id]
    assert printed(answers) == "10\n"
    waking = [m for m in answers if m["msg_type"] in ("display_data", "update_display_data")]
    assert "bringing back 2.0 GiB of GPU memory" in waking[0]["content"]["data"]["text/plain"]
    assert kept_outputs(answers) == ["10\n"]
    assert root_of(jp_serverapp, kernel_id) == root  # the same process, never restored
    assert await hibernation(api) == {}
    kernel = psutil.Process(root).children()[0].pid if _is_nsinit(root) else root
    assert driver.state(kernel) == ProcessState.RUNNING
    assert driver.ops(kernel) == ["lock", "checkpoint", "restore", "unlock"]
    assert driver.protocol_breaches() == []
    assert [e["action"] for e in events][:4] == ["hibernating", "hibernated", "waking", "woken"]


async def test_a_wake_without_gpu_memory_answers_the_cell_and_sleeps_on(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
) -> None:
    kernel_id, sock, root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
    driver.fail("restore", CUDA_ERROR_OUT_OF_MEMORY, times=3)
    (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
    answers = (await collect(sock, [msg_id]))[msg_id]
    errors = [m for m in answers if m["msg_type"] == "error"]
    assert errors and "sleeps on with nothing lost" in errors[0]["content"]["evalue"]
    assert "not enough free memory" in errors[0]["content"]["evalue"]
    found = (await hibernation(api))[kernel_id]
    assert found["state"] == "hibernated" and found["last_wake_error"]["step"] == "resume"
    assert asleep_as_the_driver_wants(root, driver)
    # Once the memory is there, the next cell wakes it with its state.
    (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
    assert printed((await collect(sock, [msg_id]))[msg_id]) == "10\n"
    assert driver.protocol_breaches() == []


async def test_a_restarted_server_finds_the_kernel_asleep_and_wakes_it(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
) -> None:
    kernel_id, sock, root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
    ours = extension(jp_serverapp)
    # What a server started after this one does with the kernels it adopted: the holder,
    # which outlived the server that asked, is found by the kernel's process.
    later = Hibernation(ours.parts.service, Sleepers(ours.parts.jobs), ours.parts.settings)
    assert await later.find_sleepers() == [kernel_id]
    found = later.sleepers.describe(kernel_id)
    assert found is not None and found["tier"] == "gpu" and found["state"] == "hibernated"
    assert found["gpu_bytes"] == 2 * GIB
    await later.wake(kernel_id)
    await until_woken(later, kernel_id)
    ours.parts.hibernation.forget(kernel_id)
    assert await sock.execute("print(sum(state))") == "10\n"
    assert root_of(jp_serverapp, kernel_id) == root
    assert driver.protocol_breaches() == []


async def until_woken(hibernation_: Hibernation, kernel_id: str) -> None:
    deadline = time.monotonic() + 30
    while hibernation_.sleepers.state(kernel_id) is not None:
        assert time.monotonic() < deadline, hibernation_.sleepers.describe(kernel_id)
        await asyncio.sleep(0.05)


async def until_heard_ending(api: Api, kernel_id: str, since: float) -> None:
    """Until the server has heard the kernel go idle after ``since``: it hears a kernel on
    a channel of its own, so it may relay a cell's output to the client before it has
    counted the cell as the kernel's last activity, or heard the cell end."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        model = await api.ok("GET", "api", "kernels", kernel_id)
        heard = datetime.fromisoformat(model["last_activity"].replace("Z", "+00:00"))
        if heard.timestamp() > since and model["execution_state"] == "idle":
            return
        assert time.monotonic() < deadline, f"the server never heard kernel {kernel_id} end"
        await asyncio.sleep(0.05)


class TestTakingTurns:
    """Three kernels of 30 GiB on one 80 GiB GPU: two fit awake, each cell wakes its own."""

    @pytest.fixture
    def kernel_bytes(self) -> int:
        return 30 * GIB

    async def test_three_kernels_answer_their_cells_in_turn_and_a_full_gpu_is_named(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
        driver: FakeCudaDriver, tmp_path: Path,
    ) -> None:
        sockets: dict[str, Any] = {}
        names: dict[str, str] = {}

        async def start(name: str) -> str:
            kernel_id, sock = await notebook_kernel(api, kernel_socket, f"{name}.ipynb")
            await sock.execute(f"name = {name!r}")
            await until_idle(api, kernel_id)  # as the server sees it: a wake's choice
            kernel = procfs.kernel_of(root_of(jp_serverapp, kernel_id))
            assert kernel is not None
            driver.state(kernel.pid)  # the fake's GPU shows the processes it has seen
            sockets[kernel_id], names[kernel_id] = sock, name
            return kernel_id

        async def cell(kernel_id: str, code: str = "print(name)") -> list[Json]:
            sock = sockets[kernel_id]
            (msg_id,) = await send(sock, execute(sock.session, code))
            return (await collect(sock, [msg_id]))[msg_id]

        # The fake driver knows a process by its environment, which the server's kernels
        # share: all three start before the first checkpoint, or the later ones would
        # read as restored from it.
        first, second, third = await start("k1"), await start("k2"), await start("k3")
        await api.ok("POST", "gpu-snapshot", "kernels", first, "hibernate",
                     body={"tier": "gpu"}, expect=202)
        await until_state(api, first, "hibernated")  # 60 GiB of 80 in use now
        # Each cell wakes its kernel; the least recently used idle one gives its GPU back.
        for kernel_id, gives_way in ((first, second), (second, third), (third, first)):
            sent = time.time()
            assert printed(await cell(kernel_id)) == f"{names[kernel_id]}\n"
            # The next wake must find this kernel idle and the most recently used one.
            await until_heard_ending(api, kernel_id, sent)
            asleep = await hibernation(api)
            assert set(asleep) == {gives_way}, asleep
            assert asleep[gives_way]["tier"] == "gpu"
        # With both awake kernels running cells, no idle kernel can make room: the cell
        # gets one error naming who holds the GPU, and its kernel sleeps on. Their cells run
        # until that error has come.
        running = (second, third)
        released = tmp_path / "released"
        busy = (f"import os, time\nwhile not os.path.exists({str(released)!r}): "
                "time.sleep(0.01)\nprint('done')")
        busy_ids = [(await send(sockets[k], execute(sockets[k].session, busy)))[0]
                    for k in running]
        await until_busy(jp_serverapp, list(running))
        errors = [m for m in await cell(first) if m["msg_type"] == "error"]
        assert errors, "the cell of a kernel that cannot wake got no error"
        text = errors[0]["content"]["evalue"]
        assert "no idle kernel can give its memory back" in text
        assert f"kernel {second} (busy)" in text and f"kernel {third} (busy)" in text
        assert (await hibernation(api))[first]["state"] == "hibernated"
        released.touch()
        for k, msg_id in zip(running, busy_ids, strict=True):
            assert printed((await collect(sockets[k], [msg_id]))[msg_id]) == "done\n"
        # Once they are idle, the same cell wakes it.
        assert printed(await cell(first)) == "k1\n"
        assert driver.protocol_breaches() == []


async def until_busy(jp_serverapp: Any, kernel_ids: list[str]) -> None:
    deadline = time.monotonic() + 30
    km = jp_serverapp.kernel_manager
    while any(km.get_kernel(k).execution_state != "busy" for k in kernel_ids):
        assert time.monotonic() < deadline, "the cells never started"
        await asyncio.sleep(0.05)


async def test_the_magic_and_the_cli_ask_for_the_gpu_tier(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from jupyter_gpu_snapshot.cli.main import main as cli

    extension(jp_serverapp).parts.hibernation.start()
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    root = root_of(jp_serverapp, kernel_id)
    out = await sock.execute("%gpu_snapshot hibernate gpu\nm = 'kept'")
    assert "gives its GPU back once this cell ends" in out
    found = await until_state(api, kernel_id, "hibernated")
    assert found is not None and found["tier"] == "gpu"
    assert await sock.execute("print(m)") == "kept\n"
    assert root_of(jp_serverapp, kernel_id) == root
    server = ["--url", jp_serverapp.connection_url,
              "--token", jp_serverapp.identity_provider.token]
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["hibernate", kernel_id, "--tier", "gpu", *server]) == 0
    await until_state(api, kernel_id, "hibernated")
    assert await asyncio.to_thread(cli, ["hibernation", *server]) == 0
    table = capsys.readouterr().out
    assert "TIER" in table and " gpu " in table
    assert await sock.execute("print(m)") == "kept\n"
    assert driver.protocol_breaches() == []


class TestStoppingTheServer:
    @pytest.fixture
    def snapshot_config(self, driver: FakeCudaDriver) -> Json:
        return {"autosave": False, "autosave_check_seconds": 0.2,
                "snapshot_on_shutdown": True, "shutdown_budget": 60}

    async def test_a_kernel_asleep_in_the_gpu_tier_is_woken_and_saved_as_the_server_stops(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
        driver: FakeCudaDriver,
    ) -> None:
        kernel_id, _sock, _root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
        app = extension(jp_serverapp)
        await app.stop_extension()
        assert kernel_id in app.last_shutdown.saved, app.last_shutdown
        assert app.parts.sleepers.state(kernel_id) is None
        assert driver.protocol_breaches() == []


class TestANotebooksOwnReleaseTime:
    """A server that releases no GPU by itself; one notebook asks for its kernel's."""

    @pytest.fixture
    def snapshot_config(self, driver: FakeCudaDriver) -> Json:
        return {"autosave": False, "autosave_check_seconds": 0.2,
                "release_gpu_after_minutes": 0}

    async def test_the_notebooks_time_is_the_one_its_idle_kernel_is_released_after(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
        driver: FakeCudaDriver, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        app = extension(jp_serverapp)

        # Which kernels hold GPU memory, the server asks libcuda and NVML, which the fake
        # driver does not stand in for: its GPU answers instead.
        async def cuda_state_on_the_fake_gpu(root: int | None) -> Json | None:
            kernel = procfs.kernel_of(root) if root else None
            running = kernel is not None and driver.state(kernel.pid) == ProcessState.RUNNING
            held = (fake_cuda_bytes(kernel.pid) or 0) if kernel and running else 0
            return {"state": "running" if held else "none", "memory_bytes": held}

        monkeypatch.setattr(app.parts.service, "cuda_state", cuda_state_on_the_fake_gpu)
        app.parts.hibernation.start()
        # Both start before the first checkpoint: the fake driver knows a process by its
        # environment, which the server's kernels share (a later one would read as restored).
        kernel_id, sock = await notebook_kernel(api, kernel_socket, "mine.ipynb")
        other_id, other = await notebook_kernel(api, kernel_socket, "other.ipynb")
        for each in (sock, other):
            await each.execute(RESTORE_THREAD_CODE + "state = 'kept'")
        out = await sock.execute("%gpu_snapshot hibernate gpu after 1s")
        assert out == "This notebook's kernel gives its GPU back after 1 s idle.\n"
        found = await until_state(api, kernel_id, "hibernated")
        assert found is not None and found["tier"] == "gpu"
        assert asleep_as_the_driver_wants(root_of(jp_serverapp, kernel_id), driver)
        assert set(await hibernation(api)) == {kernel_id}
        for each_id, minutes in ((kernel_id, 1 / 60), (other_id, 0)):  # the server's: never
            state = await api.ok("GET", "gpu-snapshot", "kernels", each_id, "autosave")
            assert state["policy"]["release_gpu_after_minutes"] == pytest.approx(minutes)

        out = await sock.execute("%gpu_snapshot hibernate gpu default")  # this cell wakes it
        assert out == "This notebook's kernel never gives its GPU back by itself.\n"
        await idle_past(jp_serverapp, kernel_id, 1)
        await extension(jp_serverapp).parts.hibernation.tick()
        assert await hibernation(api) == {}
        assert await sock.execute("print(state)") == "kept\n"
        assert driver.protocol_breaches() == []


# -- the move from the gpu tier to the process tier, the GPU untouched -------------------------
MOVE_TIMEOUT = 120.0


def kernel_of(root: int) -> int:
    found = procfs.kernel_of(root)
    assert found is not None
    return found.pid


async def until_tier(api: Api, kernel_id: str, tier: str, state: str = "hibernated") -> Json:
    deadline = time.monotonic() + MOVE_TIMEOUT
    while True:
        found = (await hibernation(api)).get(kernel_id) or {}
        if found.get("tier") == tier and found.get("state") == state:
            return found
        assert time.monotonic() < deadline, f"kernel {kernel_id} never {state} in {tier}: {found}"
        await asyncio.sleep(0.1)


async def test_a_sleeping_kernel_moves_to_the_process_tier_and_its_next_cell_restores_it(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
) -> None:
    kernel_id, sock, root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
    old_kernel = kernel_of(root)
    await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate",
                 body={"tier": "process"}, expect=202)
    moved = await until_tier(api, kernel_id, "process")
    assert moved["snapshot_id"] and moved["host_bytes_freed"] > 0
    assert moved["gpu_bytes_freed"] == 2 * GIB
    assert not psutil.pid_exists(root)
    # The move wrote what the release had put in host memory: the GPU was not touched again.
    assert driver.ops(old_kernel) == ["lock", "checkpoint"]
    listed = {k["id"]: k for k in await api.ok("GET", "api", "kernels")}
    assert listed[kernel_id]["execution_state"] == "hibernated"

    (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
    assert printed((await collect(sock, [msg_id]))[msg_id]) == "10\n"
    new_root = root_of(jp_serverapp, kernel_id)
    assert new_root != root
    assert driver.ops(kernel_of(new_root)) == ["restore", "unlock"]
    assert driver.state(kernel_of(new_root)) == ProcessState.RUNNING
    assert driver.protocol_breaches() == []
    assert await hibernation(api) == {}


async def test_low_host_memory_moves_the_least_recently_used_sleeper_first(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
    events: list[Json],
) -> None:
    started, _ = await notebook_kernel(api, kernel_socket, "newer.ipynb")
    # The fake driver tells the kernels apart by what it has seen before a checkpoint.
    driver.state(kernel_of(root_of(jp_serverapp, started)))
    older, _, older_root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
    newer, newer_sock, newer_root = await sleeping_kernel(api, kernel_socket, jp_serverapp,
                                                          "newer.ipynb")
    assert newer == started
    # Below any share of the node's memory: the server sees its host memory as low.
    extension(jp_serverapp).parts.settings.host_memory_low_percent = 100.0
    # A server in the test's process is not started as a listening one would be.
    extension(jp_serverapp).parts.hibernation.start()
    await until_tier(api, older, "process")
    # One move per round while memory stays low: the newer one follows, never first.
    await until_tier(api, newer, "process")
    assert not psutil.pid_exists(older_root) and not psutil.pid_exists(newer_root)
    moves = [e["kernel_id"] for e in events if e["action"] == "hibernating"
             and e["tier"] == "process"]
    assert moves == [older, newer]
    extension(jp_serverapp).parts.settings.host_memory_low_percent = 0.0
    (msg_id,) = await send(newer_sock, execute(newer_sock.session, "print(sum(state))"))
    assert printed((await collect(newer_sock, [msg_id]))[msg_id]) == "10\n"
    assert driver.protocol_breaches() == []


class TestAMoveThatFails:
    """criu fails writing the kernel's pages: the kernel sleeps on in the gpu tier."""

    @pytest.fixture
    def criu_path(self, tmp_path: Path) -> str:
        return install(tmp_path, fails_writing_pages())

    async def test_the_kernel_sleeps_on_in_place_and_wakes_with_its_state(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
        driver: FakeCudaDriver, events: list[Json],
    ) -> None:
        kernel_id, sock, root = await sleeping_kernel(api, kernel_socket, jp_serverapp)
        await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate",
                     body={"tier": "process"}, expect=202)
        deadline = time.monotonic() + MOVE_TIMEOUT
        while not any(e["action"] == "failed" for e in events):
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.1)
        failed = next(e for e in events if e["action"] == "failed")
        assert "File too large" in failed["message"]
        back = (await hibernation(api))[kernel_id]
        assert back["tier"] == "gpu" and back["state"] == "hibernated"
        assert back["snapshot_id"] is None
        assert asleep_as_the_driver_wants(root, driver)
        assert extension(jp_serverapp).parts.service.engine.list() == []
        (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
        assert printed((await collect(sock, [msg_id]))[msg_id]) == "10\n"
        assert root_of(jp_serverapp, kernel_id) == root
        assert driver.protocol_breaches() == []
