"""A server killed with SIGKILL: its notebooks go on, on the same live kernels, once a new
server starts on the same runtime dir; no snapshot is involved. What cannot be adopted (a
dead kernel's connection file, a dead saver's criu work directory) is cleaned."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.recovery import WORK_LOCK
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME
from jupyter_gpu_snapshot.launch.provisioner import NSINIT
from testkit.server_process import JupyterServerProcess

from ..conftest import run
from .conftest import KernelSocket

TOKEN = "adoption-test-token"


class Server(JupyterServerProcess):
    """A real ``jupyter server`` process with the extension, listening once constructed."""

    def __init__(self, tmp_path: Path, *options: str) -> None:
        self.tmp_path = tmp_path
        self.runtime = tmp_path / "runtime"
        (tmp_path / "tmp").mkdir(exist_ok=True)
        (tmp_path / "notebooks").mkdir(exist_ok=True)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.runtime),
               "TMPDIR": str(tmp_path / "tmp")}
        super().__init__(
            tmp_path / "server.log", env=env, token=TOKEN, append_log=True, options=[
                f"--ServerApp.root_dir={tmp_path / 'notebooks'}",
                "--ServerApp.jpserver_extensions=jupyter_gpu_snapshot=True",
                f"--GPUSnapshot.store_dir={tmp_path / 'store'}", *options,
            ],
        )
        self.wait_ready(60)

    def until(self, path: str, check: Callable[[Any], bool], timeout: float = 60) -> Any:
        """GET ``path`` until ``check`` holds: the server adopts kernels after it listens."""
        deadline = time.monotonic() + timeout
        while not check(data := self.call("GET", path)):
            assert time.monotonic() < deadline, f"{path}: {data}"
            time.sleep(0.2)
        return data

    def call(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}", method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"token {TOKEN}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()!r}") from None
        return json.loads(data) if data else None

    async def socket(self, kernel_id: str) -> KernelSocket:
        url = f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels"
        ws = await websocket_connect(
            HTTPRequest(url, headers={"Authorization": f"token {TOKEN}"})
        )
        return KernelSocket(ws)


@pytest.fixture
def trees() -> Iterator[list[int]]:
    """Kernel trees to kill after the test, whatever happened."""
    roots: list[int] = []
    yield roots
    for root in roots:
        procfs.kill_tree(root)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def _record(runtime: Path, pid: int) -> dict[str, Any]:
    path = runtime / "gpu_snapshot" / "servers" / f"server-{pid}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


async def _execute(server: Server, kernel_id: str, code: str) -> str:
    ws = await server.socket(kernel_id)
    try:
        return await ws.execute(code)
    finally:
        ws.close()


def test_a_killed_servers_kernels_are_adopted(
    tmp_path: Path, trees: list[int], servers: list[Server]
):
    first = Server(tmp_path)
    servers.append(first)
    notebooks = ["a.ipynb", "b.ipynb", "gone.ipynb"]
    sessions = {
        nb: first.call("POST", "api/sessions", {"path": nb, "type": "notebook", "name": nb,
                                                "kernel": {"name": KERNEL_NAME}})
        for nb in notebooks
    }
    for i, nb in enumerate(notebooks):
        code = f"state = {{'notebook': {nb!r}, 'step': {i}}}"
        run(_execute(first, sessions[nb]["kernel"]["id"], code))
    deadline = time.monotonic() + 30
    while len(_record(first.runtime, first.proc.pid).get("kernels", {})) < 3:
        assert time.monotonic() < deadline, "the server never recorded its kernels"
        time.sleep(0.2)
    roots = {kid: k["root_pid"] for kid, k in _record(first.runtime, first.proc.pid)["kernels"]
             .items()}
    trees.extend(roots.values())
    # A dead saver's criu work directory, as a SIGKILL in the middle of a save leaves it.
    leaked = tmp_path / "tmp" / "jupyter-gpu-snapshot-dump-leaked"
    leaked.mkdir()
    (leaked / WORK_LOCK).touch()

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert all(procfs.tree_alive(root) for root in roots.values())
    gone = sessions["gone.ipynb"]["kernel"]["id"]
    procfs.kill_tree(roots[gone])
    assert (first.runtime / f"kernel-{gone}.json").exists()

    second = Server(tmp_path)
    servers.append(second)
    alive = {sessions[nb]["kernel"]["id"] for nb in ("a.ipynb", "b.ipynb")}
    second.until("api/kernels", lambda ks: {k["id"] for k in ks} == alive)
    now = {s["id"]: (s["path"], s["kernel"]["id"]) for s in second.call("GET", "api/sessions")}
    assert now == {sessions[nb]["id"]: (nb, sessions[nb]["kernel"]["id"])
                   for nb in ("a.ipynb", "b.ipynb")}

    printed = [
        run(_execute(second, sessions[nb]["kernel"]["id"], "state['step'] += 10; print(state)"))
        for nb in ("a.ipynb", "b.ipynb")
    ]
    assert printed == ["{'notebook': 'a.ipynb', 'step': 10}\n",
                       "{'notebook': 'b.ipynb', 'step': 11}\n"]
    # The same processes, not restored copies.
    record = _record(second.runtime, second.proc.pid)
    assert {kid: k["root_pid"] for kid, k in record["kernels"].items()} == {
        kid: roots[kid] for kid in alive
    }
    assert not (second.runtime / f"kernel-{gone}.json").exists()
    assert not leaked.exists()
    assert not (second.runtime / "gpu_snapshot" / "servers" /
                f"server-{first.proc.pid}.json").exists()
    # No snapshot was involved.
    assert not (tmp_path / "store").exists() or list((tmp_path / "store").iterdir()) == []


def _open_notebooks(server: Server, notebooks: list[str]) -> dict[str, str]:
    """Notebook path -> kernel id, each kernel holding some state and 60 MB."""
    kernels = {}
    for i, nb in enumerate(notebooks):
        session = server.call("POST", "api/sessions", {"path": nb, "type": "notebook",
                                                       "name": nb,
                                                       "kernel": {"name": KERNEL_NAME}})
        kernels[nb] = session["kernel"]["id"]
        code = f"state = {{'notebook': {nb!r}, 'step': {i}}}; blob = b'x' * (60 << 20)"
        run(_execute(server, kernels[nb], code))
    return kernels


def test_server_killed_during_shutdown_saves(
    tmp_path: Path, trees: list[int], servers: list[Server]
):
    """SIGTERM starts the shutdown saves, SIGKILL hits while criu writes the first one:
    each kernel comes back, adopted alive or restored from its recovered snapshot."""
    first = Server(tmp_path, "--GPUSnapshot.snapshot_on_shutdown=True")
    servers.append(first)
    kernels = _open_notebooks(first, ["a.ipynb", "b.ipynb"])
    deadline = time.monotonic() + 30
    while len(_record(first.runtime, first.proc.pid).get("kernels", {})) < 2:
        assert time.monotonic() < deadline, "the server never recorded its kernels"
        time.sleep(0.2)
    trees.extend(k["root_pid"] for k in _record(first.runtime, first.proc.pid)["kernels"]
                 .values())
    store = tmp_path / "store"

    first.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("pages-") and p.stat().st_size > 1 << 20
                  for d in store.glob(".partial-*") for p in d.iterdir()):
        assert time.monotonic() < deadline, "no shutdown save began"
        time.sleep(0.005)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    while any(procfs.criu_working_on(d) for d in store.glob(".partial-*")):
        time.sleep(0.05)

    second = Server(tmp_path)
    servers.append(second)
    snapshots = second.call("GET", "gpu-snapshot/snapshots")["snapshots"]
    saved = {s["kernel"]["kernel_id"]: s["id"] for s in snapshots}
    adopted = {k["id"] for k in second.until(
        "api/kernels", lambda ks: len(ks) + len(saved) >= 2, timeout=60)}
    assert saved and all(s["reason"] == "shutdown" for s in snapshots)
    assert sorted([*saved, *adopted]) == sorted(kernels.values())
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(".")) == []
    for i, (nb, kernel_id) in enumerate(kernels.items()):
        if kernel_id in saved:
            job = second.call("POST", f"gpu-snapshot/snapshots/{saved[kernel_id]}/restore",
                              {"path": nb})
            deadline = time.monotonic() + 90
            while job["status"] == "running":
                assert time.monotonic() < deadline
                time.sleep(0.2)
                job = second.call("GET", f"gpu-snapshot/jobs/{job['id']}")
            assert job["status"] == "succeeded", job
            kernel_id = job["result"]["kernel_id"]
        printed = run(_execute(second, kernel_id, "print(state, len(blob) >> 20)"))
        assert printed == f"{{'notebook': {nb!r}, 'step': {i}}} 60\n"


def _kernel_roots(runtime: Path) -> dict[str, int]:
    """Kernel id -> host pid of its namespace init, for every snapshot-ready kernel tree
    launched with a connection file in ``runtime``, listed by a server or not."""
    roots = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        # The unshare launcher names nsinit too, and so does the kernel nsinit forks until
        # it execs: the init is the one that is PID 1 of its namespace.
        if str(NSINIT) not in cmdline or procfs.ns_pid(proc.pid) != 1:
            continue
        found = re.search(rf"{re.escape(str(runtime))}/kernel-([-0-9a-f]+)\.json",
                          " ".join(cmdline))
        if found:
            roots[found.group(1)] = proc.pid
    return roots


def test_a_kernel_started_just_before_a_kill_is_adopted(
    tmp_path: Path, trees: list[int], servers: list[Server]
):
    """The server records a kernel before it answers the kernel's start: SIGKILLed right
    after that answer, it leaves nothing for the next server to miss."""
    first = Server(tmp_path)
    servers.append(first)
    kernel_id = first.call("POST", "api/kernels", {"name": KERNEL_NAME})["id"]
    first.proc.send_signal(signal.SIGKILL)  # at once: no record update comes in between
    first.proc.wait()
    roots = _kernel_roots(first.runtime)
    trees.extend(roots.values())
    assert list(roots) == [kernel_id]

    second = Server(tmp_path)
    servers.append(second)
    # The new server removes a dead server's record once it has adopted its kernels.
    record = first.runtime / "gpu_snapshot" / "servers" / f"server-{first.proc.pid}.json"
    deadline = time.monotonic() + 60
    while record.exists():
        assert time.monotonic() < deadline, "the new server never took up the record"
        time.sleep(0.2)
    listed = [k["id"] for k in second.call("GET", "api/kernels")]
    unlisted = set(_kernel_roots(second.runtime)) - set(listed)
    assert not unlisted, f"kernels running, listed by no server: {sorted(unlisted)}"
    assert listed == [kernel_id]
    # The very tree the first server started, not a fresh one in its slot, and it answers.
    adopted = _record(second.runtime, second.proc.pid)["kernels"][kernel_id]
    assert adopted["root_pid"] == roots[kernel_id]
    assert run(_execute(second, kernel_id, "print(6 * 7)")) == "42\n"
