"""Hibernation: an idle kernel's process ends and its slot stays; the next message that
needs it wakes it under the same kernel id, with its state, and nothing sent meanwhile is
lost, duplicated or reordered. Real server, real kernels, real CRIU, real websockets."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpu_snapshot.server.hibernation_policy import idle_seconds

from .conftest import JOB_TIMEOUT, Api, Json, KernelConnector, KernelSocket, recorded_events

NOTEBOOK = "sleepy.ipynb"
HIBERNATION_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/v1"


@pytest.fixture
def snapshot_config() -> Json:
    # Kernels hibernate on request only, unless a test says otherwise; the loop looks often.
    return {"autosave": False, "autosave_check_seconds": 0.2}


@pytest.fixture
def events(jp_serverapp: Any) -> list[Json]:
    return recorded_events(jp_serverapp, HIBERNATION_EVENT_ID)


# -- a client that sends several requests before reading ------------------------------------
def request(session: str, msg_type: str, content: Json, channel: str = "shell") -> Json:
    header = {
        "msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "test",
        "session": session, "version": "5.3",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    return {"header": header, "parent_header": {}, "metadata": {}, "content": content,
            "channel": channel, "buffers": []}


def execute(session: str, code: str) -> Json:
    return request(session, "execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True,
    })


async def send(sock: KernelSocket, *messages: Json) -> list[str]:
    for message in messages:
        await sock.ws.write_message(json.dumps(message))
    return [m["header"]["msg_id"] for m in messages]


async def collect(sock: KernelSocket, msg_ids: list[str], timeout: float = JOB_TIMEOUT
                  ) -> dict[str, list[Json]]:
    """Every message answering ``msg_ids``, until each has its reply and, but for a
    kernel_info request (which a hibernated kernel's server answers), its idle status."""
    got: dict[str, list[Json]] = {i: [] for i in msg_ids}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(msg_ids):
        left = deadline - time.monotonic()
        assert left > 0, f"answers missing: {set(msg_ids) - done}: {got}"
        raw = await asyncio.wait_for(sock.ws.read_message(), left)
        assert raw is not None, "the kernel's websocket closed"
        msg = json.loads(raw)
        parent = (msg.get("parent_header") or {}).get("msg_id")
        if parent not in got:
            continue
        got[parent].append(msg)
        kinds = [m["msg_type"] for m in got[parent]]
        idle = any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                   for m in got[parent])
        if any(k.endswith("_reply") for k in kinds) and (idle or "kernel_info_reply" in kinds):
            done.add(parent)
    return got


def kept_outputs(messages: list[Json]) -> list[str]:
    """The cell's outputs as a notebook's output area keeps (and saves) them."""
    kept: list[str] = []
    for m in messages:
        kind, content = m["msg_type"], m["content"]
        if kind == "clear_output" and not content.get("wait"):
            kept = []
        elif kind == "stream":
            kept.append(content["text"])
        elif kind in ("display_data", "execute_result"):
            kept.append(content["data"].get("text/plain", ""))
    return kept


def printed(messages: list[Json]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


# -- helpers ----------------------------------------------------------------------------------
async def hibernation(api: Api) -> dict[str, Json]:
    data = await api.ok("GET", "gpu-snapshot", "hibernation")
    return {k["kernel_id"]: k for k in data["kernels"]}


async def until_state(api: Api, kernel_id: str, state: str | None,
                      timeout: float = JOB_TIMEOUT) -> Json | None:
    deadline = time.monotonic() + timeout
    while True:
        found = (await hibernation(api)).get(kernel_id)
        if (found or {}).get("state") == state or (state is None and found is None):
            return found
        assert time.monotonic() < deadline, f"kernel {kernel_id} never {state}: {found}"
        await asyncio.sleep(0.1)


async def until_idle(api: Api, kernel_id: str, timeout: float = JOB_TIMEOUT) -> None:
    """The server hears a cell's end a moment after the client does: a request made before
    would find the kernel busy."""
    deadline = time.monotonic() + timeout
    while (await api.ok("GET", "api", "kernels", kernel_id))["execution_state"] != "idle":
        assert time.monotonic() < deadline, f"kernel {kernel_id} never idle"
        await asyncio.sleep(0.05)


async def hibernated(api: Api, kernel_id: str) -> Json:
    await until_idle(api, kernel_id)
    await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate", expect=202)
    found = await until_state(api, kernel_id, "hibernated")
    assert found is not None
    return found


def root_of(jp_serverapp: Any, kernel_id: str) -> int:
    root = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid
    assert root, "the kernel has no process"
    return int(root)


async def notebook_kernel(api: Api, kernel_socket: KernelConnector, path: str = NOTEBOOK
                          ) -> tuple[str, KernelSocket]:
    session = await api.open_notebook(path)
    kernel_id = str(session["kernel"]["id"])
    return kernel_id, await kernel_socket(kernel_id)


async def idle_past(jp_serverapp: Any, kernel_id: str, seconds: float) -> None:
    """Until the kernel has been idle longer than ``seconds``, on the clock hibernation reads."""
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    deadline = time.monotonic() + JOB_TIMEOUT
    while (idle_seconds(km) or 0.0) <= seconds:
        assert time.monotonic() < deadline, f"kernel {kernel_id} never idle for {seconds} s"
        await asyncio.sleep(0.1)


def extension(jp_serverapp: Any) -> Any:
    return next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]))


def wake_jobs(jp_serverapp: Any, kernel_id: str) -> list[Any]:
    jobs = extension(jp_serverapp).parts.service.jobs.recent(kernel_id)
    return [j for j in jobs if j.kind == "wake"]


# -- the scenarios ----------------------------------------------------------------------------
class TestIdleKernels:
    @pytest.fixture
    def snapshot_config(self) -> Json:
        return {"autosave": False, "autosave_check_seconds": 0.2,
                "hibernate_after_minutes": 0.05}

    async def test_an_idle_kernel_hibernates_stays_listed_and_the_next_cell_wakes_it(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, events: list[Json]
    ) -> None:
        # A server in the test's process is not started as a listening one would be.
        extension(jp_serverapp).parts.hibernation.start()
        kernel_id, sock = await notebook_kernel(api, kernel_socket)
        await sock.execute("import os; state = list(range(5)); pid = os.getpid()")
        root = root_of(jp_serverapp, kernel_id)
        found = await until_state(api, kernel_id, "hibernated")
        assert found is not None and found["snapshot_id"] and found["since"]
        assert not psutil.pid_exists(root) or psutil.Process(root).status() == "zombie"
        listed = {k["id"]: k for k in await api.ok("GET", "api", "kernels")}
        assert listed[kernel_id]["execution_state"] == "hibernated"
        sessions = await api.ok("GET", "api", "sessions")
        assert [s["kernel"]["id"] for s in sessions if s["path"] == NOTEBOOK] == [kernel_id]

        (msg_id,) = await send(sock, execute(sock.session, "print(sum(state))"))
        answers = (await collect(sock, [msg_id]))[msg_id]
        assert printed(answers) == "10\n"
        kinds = [m["msg_type"] for m in answers]
        assert kinds[:2] == ["status", "display_data"], kinds  # "Waking the kernel…"
        assert "Waking the kernel" in answers[1]["content"]["data"]["text/plain"]
        # Shown while it mattered, gone from what the notebook keeps.
        assert kept_outputs(answers) == ["10\n"]
        assert answers[-1]["msg_type"] in ("status", "execute_reply")
        assert [e["action"] for e in events][:4] == [
            "hibernating", "hibernated", "waking", "woken"]
        assert len(wake_jobs(jp_serverapp, kernel_id)) == 1


async def test_messages_sent_while_it_wakes_arrive_once_in_order(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("seen = []")
    await hibernated(api, kernel_id)
    cells = [execute(sock.session, f"seen.append({i}); print({i})") for i in range(6)]
    info = request(sock.session, "kernel_info_request", {})
    ids = await send(sock, cells[0], info, *cells[1:])
    answers = await collect(sock, ids)
    assert [printed(answers[i]) for i in ids if i != info["header"]["msg_id"]] == [
        f"{i}\n" for i in range(6)]
    replies = [m for m in answers[info["header"]["msg_id"]] if m["msg_type"] == "kernel_info_reply"]
    assert len(replies) == 1 and replies[0]["content"]["protocol_version"]
    assert await sock.execute("print(seen)") == f"{list(range(6))}\n"


async def test_a_widget_comm_wakes_the_kernel_and_works_after(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    model_id = (await sock.execute(
        "import ipywidgets; w = ipywidgets.IntSlider(value=3); print(w.model_id)")).strip()
    await hibernated(api, kernel_id)
    update = request(sock.session, "comm_msg", {
        "comm_id": model_id, "data": {"method": "update", "state": {"value": 7},
                                      "buffer_paths": []}})
    await send(sock, update)
    await until_state(api, kernel_id, None)
    assert await sock.execute("print(w.value)") == "7\n"


async def test_two_clients_wake_it_once_and_both_get_their_answers(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
) -> None:
    kernel_id, first = await notebook_kernel(api, kernel_socket)
    await first.execute("n = 1")
    second = await kernel_socket(kernel_id)
    await hibernated(api, kernel_id)
    (a,) = await send(first, execute(first.session, "print(n + 1)"))
    (b,) = await send(second, execute(second.session, "print(n + 2)"))
    assert printed((await collect(first, [a]))[a]) == "2\n"
    assert printed((await collect(second, [b]))[b]) == "3\n"
    assert len(wake_jobs(jp_serverapp, kernel_id)) == 1


async def test_a_client_that_connects_to_a_hibernated_kernel_is_not_kept_waiting(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("z = 5")
    await hibernated(api, kernel_id)
    started = time.monotonic()
    late = await kernel_socket(kernel_id)
    assert time.monotonic() - started < 10
    assert (await hibernation(api))[kernel_id]["state"] == "hibernated"
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["hibernation"]["state"] == "hibernated" and not status["ready"], status
    # Woken through the API: the client that connected meanwhile sent nothing to be held,
    # and still re-joins the kernel's output before its first cell.
    await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "wake", expect=202)
    await until_state(api, kernel_id, None)
    assert await late.execute("print(z)") == "5\n"
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["hibernation"] is None and status["ready"], status


async def test_a_running_cell_is_never_hibernated_and_when_idle_waits_for_it(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, tmp_path: Path
) -> None:
    extension(jp_serverapp).parts.hibernation.start()
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    # The cell runs until both requests below have been answered.
    released = tmp_path / "released"
    (cell,) = await send(sock, execute(sock.session, (
        f"import os, time\nwhile not os.path.exists({str(released)!r}): time.sleep(0.01)\n"
        "print('done')")))
    deadline = time.monotonic() + 30
    while (await api.ok("GET", "api", "kernels", kernel_id))["execution_state"] != "busy":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    code, body = await api.call("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate")
    assert code == 409 and "running a cell" in body["message"], body
    state = await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate",
                         body={"when_idle": True}, expect=202)
    assert state["state"] == "requested"
    released.touch()
    assert printed((await collect(sock, [cell]))[cell]) == "done\n"
    await until_state(api, kernel_id, "hibernated")


async def test_a_cell_sent_while_the_hibernation_saves_waits_and_then_wakes_it(
    api: Api, kernel_socket: KernelConnector, events: list[Json]
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("y = 'kept'")
    await api.ok("POST", "gpu-snapshot", "kernels", kernel_id, "hibernate", expect=202)
    (cell,) = await send(sock, execute(sock.session, "print(y)"))
    assert printed((await collect(sock, [cell]))[cell]) == "kept\n"
    assert [e["action"] for e in events] == ["hibernating", "hibernated", "waking", "woken"]


async def test_a_wake_that_fails_says_why_and_keeps_the_kernel_hibernated(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("v = 'still here'")
    found = await hibernated(api, kernel_id)
    info = jp_serverapp.kernel_manager.get_kernel(kernel_id).get_connection_info()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind((info["ip"], info["shell_port"]))
    squatter.listen()
    try:
        (cell,) = await send(sock, execute(sock.session, "print(v)"))
        answers = (await collect(sock, [cell]))[cell]
    finally:
        squatter.close()
    errors = [m["content"] for m in answers if m["msg_type"] == "error"]
    assert len(errors) == 1 and errors[0]["ename"] == "KernelWakeError", answers
    assert found["snapshot_id"] in errors[0]["evalue"]
    reply = next(m for m in answers if m["msg_type"] == "execute_reply")
    assert reply["content"]["status"] == "error"
    after = (await hibernation(api))[kernel_id]
    assert after["state"] == "hibernated" and after["last_wake_error"]["message"]
    snapshots = {s["id"] for s in await api.snapshots()}
    assert found["snapshot_id"] in snapshots
    # The port is free again: the next cell wakes it, with its state.
    assert await sock.execute("print(v)") == "still here\n"


async def test_a_hibernated_kernel_shut_down_keeps_its_snapshot(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("w = 1")
    found = await hibernated(api, kernel_id)
    code, _ = await api.call("DELETE", "gpu-snapshot", "snapshots", found["snapshot_id"])
    assert code == 409  # a hibernated kernel's snapshot is not deleted under it
    started = time.monotonic()
    await api.ok("DELETE", "api", "kernels", kernel_id, expect=204)
    assert time.monotonic() - started < 5
    assert kernel_id not in await api.kernel_ids()
    assert await hibernation(api) == {}
    assert found["snapshot_id"] in {s["id"] for s in await api.snapshots()}


async def test_the_magic_hibernates_its_own_kernel_once_its_cell_ends(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
) -> None:
    extension(jp_serverapp).parts.hibernation.start()
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    out = await sock.execute("%gpu_snapshot hibernate\nm = 'kept'")
    assert "hibernates once this cell ends" in out
    await until_state(api, kernel_id, "hibernated")
    assert await sock.execute("print(m)") == "kept\n"


class TestStoppingTheServer:
    @pytest.fixture
    def snapshot_config(self) -> Json:
        return {"autosave": False, "autosave_check_seconds": 0.2,
                "snapshot_on_shutdown": True, "shutdown_budget": 60}

    async def test_a_hibernated_kernel_is_not_saved_again_and_its_snapshot_is_offered(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        kernel_id, sock = await notebook_kernel(api, kernel_socket)
        await sock.execute("q = 3")
        found = await hibernated(api, kernel_id)
        app = extension(jp_serverapp)
        await app.stop_extension()
        assert "hibernated" in app.last_shutdown.skipped[kernel_id]
        assert app.last_shutdown.saved == {}
        latest = await api.snapshots(latest="true")
        assert [s["id"] for s in latest if s["notebook_path"] == NOTEBOOK] == [
            found["snapshot_id"]]


async def test_the_cli_lists_hibernated_kernels_and_wakes_one(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from jupyter_gpu_snapshot.cli.main import main as cli

    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("c = 'cli'")
    found = await hibernated(api, kernel_id)
    server = ["--url", jp_serverapp.connection_url,
              "--token", jp_serverapp.identity_provider.token]
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["hibernation", "--json", *server]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(k["kernel_id"], k["state"], k["snapshot_id"]) for k in listed] == [
        (kernel_id, "hibernated", found["snapshot_id"])]
    assert await asyncio.to_thread(cli, ["hibernation", *server]) == 0
    table = capsys.readouterr().out
    assert kernel_id in table and NOTEBOOK in table
    assert await asyncio.to_thread(cli, ["wake", kernel_id, *server]) == 0
    assert "waking" in capsys.readouterr().out
    await until_state(api, kernel_id, None)
    assert await sock.execute("print(c)") == "cli\n"
    # A kernel that is not hibernated: one line naming the step and the cause.
    assert await asyncio.to_thread(cli, ["wake", kernel_id, *server]) == 2
    assert "is not hibernated" in capsys.readouterr().err


async def test_a_notebook_chooses_when_its_kernel_hibernates(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
) -> None:
    extension(jp_serverapp).parts.hibernation.start()  # the server's own setting: never
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    out = await sock.execute("%gpu_snapshot hibernate after 2s")
    assert out == "This notebook's kernel hibernates after 2 s idle.\n"
    await until_state(api, kernel_id, "hibernated")
    policy = (await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "autosave"))["policy"]
    assert policy["hibernate_after_minutes"] == pytest.approx(2 / 60)
    assert policy["release_gpu_after_minutes"] == 10  # the gpu tier keeps the server's
    out = await sock.execute("%gpu_snapshot hibernate never")  # this cell wakes it
    assert out == "This notebook's kernel never hibernates by itself.\n"
    await idle_past(jp_serverapp, kernel_id, 2)
    await extension(jp_serverapp).parts.hibernation.tick()
    assert await hibernation(api) == {}


async def test_a_hibernated_kernel_keeps_a_portable_copy_by_policy(
    api: Api, kernel_socket: KernelConnector
) -> None:
    # c.GPUSnapshot.portable_on holds "hibernate" by default: the snapshot a hibernated
    # kernel wakes from can also come back where its image cannot.
    kernel_id, sock = await notebook_kernel(api, kernel_socket)
    await sock.execute("kept = list(range(5))")
    found = await hibernated(api, kernel_id)
    (summary,) = [s for s in await api.snapshots() if s["id"] == found["snapshot_id"]]
    assert summary["fallback"] == ["portable", "replay", "both"], summary
    assert not summary["warnings"], summary["warnings"]
