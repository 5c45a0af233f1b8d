"""A real ``jupyter server`` with the snapshot extension, and notebook kernels in it.

The magic and the widget run inside kernels and talk to the server over HTTP, exactly as
in JupyterLab: the server is a subprocess on 127.0.0.1 with a token, its kernels are real
python3-snapshot kernels started through ``/api/sessions``, and the tests reach a kernel
over ZMQ with the connection file the server wrote (as ``jupyter console --existing``).
"""

from __future__ import annotations

import json
import os
import secrets
import textwrap
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.blocking import BlockingKernelClient

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.kernel.client import ServerLink, SnapshotClient
from testkit.processes import free_port
from testkit.server_process import JupyterServerProcess

SERVER_START_SECONDS = 60.0


@dataclass
class Cell:
    """What one execute request produced."""

    status: str
    stdout: str = ""
    stderr: str = ""
    ename: str | None = None
    traceback: list[str] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    iopub: list[dict[str, Any]] = field(default_factory=list)

    @property
    def error_text(self) -> str:
        return "\n".join(self.traceback)


def run_cell(
    client: BlockingKernelClient,
    code: str,
    timeout: float = 60,
    on_message: Callable[[dict[str, Any]], None] | None = None,
) -> Cell:
    """Execute code; collect its output, errors and every IOPub message it caused."""
    cell = Cell("?")

    def hook(msg: dict[str, Any]) -> None:
        cell.iopub.append(msg)
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                cell.stdout += content["text"]
            else:
                cell.stderr += content["text"]
        elif kind == "error":
            cell.ename = content["ename"]
            cell.traceback = list(content["traceback"])
        elif kind in ("display_data", "update_display_data", "execute_result"):
            cell.displays.append(content)
        if on_message is not None:
            on_message(msg)

    reply = client.execute_interactive(
        textwrap.dedent(code), timeout=timeout, output_hook=hook, allow_stdin=False
    )
    cell.status = reply["content"]["status"]
    if cell.ename is None and cell.status == "error":
        cell.ename = reply["content"].get("ename")
    return cell


def ok(client: BlockingKernelClient, code: str, timeout: float = 60) -> str:
    """Execute code that must succeed; its stdout."""
    cell = run_cell(client, code, timeout)
    assert cell.status == "ok", f"{cell.ename}: {cell.error_text}{cell.stderr}"
    return cell.stdout


@dataclass
class NotebookKernel:
    """A notebook's session on the server and a ZMQ client of its kernel."""

    server: JupyterServer
    path: str
    session_id: str
    kernel_id: str
    client: BlockingKernelClient

    def run(self, code: str, timeout: float = 60, **kw: Any) -> Cell:
        return run_cell(self.client, code, timeout, **kw)

    def ok(self, code: str, timeout: float = 60) -> str:
        return ok(self.client, code, timeout)


class JupyterServer:
    """``jupyter server`` as a subprocess with a private root, runtime dir and store."""

    def __init__(
        self, base: Path, unix_socket: bool = False, options: Sequence[str] = ()
    ) -> None:
        self.base = base
        self.options = list(options)  # more command-line options of the server
        # Listening on a Unix socket instead of a TCP port (as behind some proxies).
        self.sock = base / "server.sock" if unix_socket else None
        self.root = base / "notebooks"
        self.runtime = base / "runtime"
        self.store = base / "store"
        for d in (self.root, self.runtime):
            d.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = base / "server.log"
        where = f"http+unix://{urllib.parse.quote(str(self.sock), safe='')}/" if self.sock else None
        # The in-kernel REST client, as the magic uses it (no kernel id: tests name kernels).
        self.http = SnapshotClient(ServerLink(where or self.url, self.token, kernel_id=""))
        self.process: JupyterServerProcess | None = None
        self.clients: list[BlockingKernelClient] = []

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(JUPYTER_RUNTIME_DIR=str(self.runtime), JUPYTER_GPU_SNAPSHOT_DIR=str(self.store))
        # A kernel of this test server must not believe it runs under another one.
        for key in list(env):
            if key.startswith("JUPYTER_GPU_SNAPSHOT_") and key != "JUPYTER_GPU_SNAPSHOT_DIR":
                env.pop(key)
        return env

    def start(self) -> None:
        self.process = JupyterServerProcess(
            self.log_path, env=self.env, port=self.port, sock=self.sock, token=self.token,
            cwd=self.root, append_log=True,
            # SIGTERM stops jupyter server at once. Two SIGINTs sent together can arrive as
            # one, which only asks for a confirmation and leaves the server running.
            stop_timeout=20,
            options=[
                f"--ServerApp.root_dir={self.root}",
                '--ServerApp.jpserver_extensions={"jupyter_gpu_snapshot": True}',
                f"--GPUSnapshot.store_dir={self.store}",
                # On by default; these scenarios do not want every stop to save their kernels.
                "--GPUSnapshot.snapshot_on_shutdown=False",
                *self.options,
            ],
        )
        self.process.wait_ready(SERVER_START_SECONDS)

    def stop(self) -> None:
        for client in self.clients:
            client.stop_channels()
        if self.process is not None:
            self.process.stop()
        # Kernels (restored ones included) are ours only if they use our runtime dir.
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info.get("cmdline") or []
            if any(str(self.runtime) in arg for arg in cmdline):
                procfs.kill_tree(proc.pid)

    # -- HTTP ------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, decoded body) of one request, sent the way the magic sends its own."""
        status, _, raw = self.http.exchange(method, path, body)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body}"
        return body

    def snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        query = f"?notebook_path={urllib.parse.quote(notebook_path)}" if notebook_path else ""
        return list(self.get(f"gpu-snapshot/snapshots{query}")["snapshots"])

    def wait_job(self, job_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get(f"gpu-snapshot/jobs/{job_id}")
            if job["status"] != "running":
                return dict(job)
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} still running after {timeout} s")

    def wait_kernel_job(self, kernel_id: str, timeout: float = 60) -> dict[str, Any]:
        """Wait for the first job on a kernel to appear (started elsewhere), then to end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.get(f"gpu-snapshot/jobs?kernel_id={kernel_id}")["jobs"]
            if jobs:
                return self.wait_job(jobs[0]["id"])
            time.sleep(0.05)
        raise AssertionError(f"no job for kernel {kernel_id}")

    def start_save(self, kernel_id: str, name: str | None = None) -> dict[str, Any]:
        body = {"name": name} if name else {}
        status, job = self.request("POST", f"gpu-snapshot/kernels/{kernel_id}/snapshots", body)
        assert status == 202, f"save: {status} {job}"
        return dict(job)

    # -- kernels ---------------------------------------------------------------------------
    def connect(self, kernel_id: str, timeout: float = 60) -> BlockingKernelClient:
        client = BlockingKernelClient()
        client.load_connection_file(str(self.runtime / f"kernel-{kernel_id}.json"))
        # No heartbeat channel: the server watches the kernel already, and a first beat
        # that is late on a loaded machine makes wait_for_ready report a living kernel dead.
        client.start_channels(hb=False)
        client.wait_for_ready(timeout=timeout)
        self.clients.append(client)
        return client

    def open_notebook(self, path: str, kernel_name: str = "python3-snapshot") -> NotebookKernel:
        """What opening a notebook in JupyterLab does: a session with a new kernel."""
        status, session = self.request(
            "POST",
            "api/sessions",
            {"path": path, "name": path, "type": "notebook",
             "kernel": {"name": kernel_name}},
        )
        assert status == 201, f"session: {status} {session}"
        kernel_id = session["kernel"]["id"]
        return NotebookKernel(self, path, session["id"], kernel_id, self.connect(kernel_id))

    def session(self, session_id: str) -> dict[str, Any]:
        return dict(self.get(f"api/sessions/{session_id}"))

    def kernel_ids(self) -> set[str]:
        return {k["id"] for k in self.get("api/kernels")}

    def shutdown_kernel(self, kernel_id: str) -> None:
        status, body = self.request("DELETE", f"api/kernels/{kernel_id}")
        assert status == 204, f"shutdown: {status} {body}"


@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    server = JupyterServer(tmp_path_factory.mktemp("server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def notebook(jupyter_server: JupyterServer, request: pytest.FixtureRequest) -> NotebookKernel:
    """A notebook of the test's own, named after it, on the module's server."""
    return jupyter_server.open_notebook(f"{request.node.name}.ipynb")
