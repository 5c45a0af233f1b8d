"""Hibernation's gpu tier through a real server: the GPU released and the process kept.

Real server, real kernels, a real holder process stopping their threads under ptrace; only
the CUDA driver is the scripted stand-in (``tests/gpu/fake_driver.py``). Every scenario
checks that the kernel ends either awake with its state (same process, threads running, CUDA
running) or asleep with nothing lost (threads held, CUDA checkpointed).
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.procfs import thread_states
from jupyter_gpu_snapshot.gpu.driver import CUDA_ERROR_OUT_OF_MEMORY, ProcessState
from jupyter_gpu_snapshot.server.hibernation import Hibernation

from ..gpu.fake_driver import (
    GIB,
    RESTORE_THREAD_CODE,
    FakeCudaDriver,
    FakeGpus,
)
from .conftest import Api, Json, KernelConnector, recorded_events, serve_with_fake_cuda
from .test_hibernation import (
    HIBERNATION_EVENT_ID,
    collect,
    execute,
    extension,
    hibernation,
    kept_outputs,
    notebook_kernel,
    printed,
    root_of,
    send,
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


async def sleeping_kernel(api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
                          ) -> tuple[str, Any, int]:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute(RESTORE_THREAD_CODE + "import os\nstate = list(range(5))")
    root = root_of(jp_serverapp, kernel_id)
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
    later = Hibernation(ours.service, ours.gpu_settings)
    assert await later.find_sleepers() == [kernel_id]
    found = later.describe(kernel_id)
    assert found is not None and found["tier"] == "gpu" and found["state"] == "hibernated"
    assert found["gpu_bytes"] == 2 * GIB
    await later.wake(kernel_id)
    await until_woken(later, kernel_id)
    ours.hibernation.forget(kernel_id)
    assert await sock.execute("print(sum(state))") == "10\n"
    assert root_of(jp_serverapp, kernel_id) == root
    assert driver.protocol_breaches() == []


async def until_woken(hibernation_: Hibernation, kernel_id: str) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + 30
    while hibernation_.state(kernel_id) is not None:
        assert time.monotonic() < deadline, hibernation_.describe(kernel_id)
        await asyncio.sleep(0.05)


class TestTakingTurns:
    """Three kernels of 30 GiB on one 80 GiB GPU: two fit awake, each cell wakes its own."""

    @pytest.fixture
    def kernel_bytes(self) -> int:
        return 30 * GIB

    async def test_three_kernels_answer_their_cells_in_turn_and_a_full_gpu_is_named(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
        driver: FakeCudaDriver,
    ) -> None:
        sockets: dict[str, Any] = {}
        names: dict[str, str] = {}

        async def start(name: str) -> str:
            kernel_id, sock = await notebook_kernel(api, kernel_socket, f"{name}.ipynb")
            await sock.execute(f"name = {name!r}")
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
            assert printed(await cell(kernel_id)) == f"{names[kernel_id]}\n"
            asleep = await hibernation(api)
            assert set(asleep) == {gives_way}, asleep
            assert asleep[gives_way]["tier"] == "gpu"
        # With both awake kernels running cells, no idle kernel can make room: the cell
        # gets one error naming who holds the GPU, and its kernel sleeps on.
        running = (second, third)
        busy_ids = [(await send(sockets[k], execute(
            sockets[k].session, "import time; time.sleep(4); print('done')")))[0]
            for k in running]
        await until_busy(jp_serverapp, list(running))
        errors = [m for m in await cell(first) if m["msg_type"] == "error"]
        assert errors, "the cell of a kernel that cannot wake got no error"
        text = errors[0]["content"]["evalue"]
        assert "no idle kernel can give its memory back" in text
        assert f"kernel {second} (busy)" in text and f"kernel {third} (busy)" in text
        assert (await hibernation(api))[first]["state"] == "hibernated"
        for k, msg_id in zip(running, busy_ids, strict=True):
            assert printed((await collect(sockets[k], [msg_id]))[msg_id]) == "done\n"
        # Once they are idle, the same cell wakes it.
        assert printed(await cell(first)) == "k1\n"
        assert driver.protocol_breaches() == []


async def until_busy(jp_serverapp: Any, kernel_ids: list[str]) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + 30
    km = jp_serverapp.kernel_manager
    while any(km.get_kernel(k).execution_state != "busy" for k in kernel_ids):
        assert time.monotonic() < deadline, "the cells never started"
        await asyncio.sleep(0.05)


async def test_the_magic_and_the_cli_ask_for_the_gpu_tier(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, driver: FakeCudaDriver,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import asyncio

    from jupyter_gpu_snapshot.cli.main import main as cli

    extension(jp_serverapp).hibernation.start()
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
        assert app.hibernation.state(kernel_id) is None
        assert driver.protocol_breaches() == []
