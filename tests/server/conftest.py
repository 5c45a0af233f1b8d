"""A real Jupyter server with the extension, real python3-snapshot kernels, real CRIU.

pytest-jupyter's fixtures are imported here rather than enabled for the whole suite, so
its event-loop plugin applies to these tests only.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.utils import url_path_join
from pytest_jupyter.jupyter_server import *  # noqa: F403 - the fixtures, scoped to tests/server
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPRequest, HTTPResponse
from tornado.websocket import WebSocketClientConnection, websocket_connect
from traitlets.config import Config

from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.manifest import ManifestPolicy
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json
from testkit.processes import free_port, kill_kernels
from testkit.server_process import JupyterServerProcess

Json = dict[str, Any]
Fetch = Callable[..., Awaitable[HTTPResponse]]

# Seconds a save or restore of a small kernel may take on a slow two-core machine.
JOB_TIMEOUT = 90.0


# -- server ----------------------------------------------------------------------------------
@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "snapshots"


@pytest.fixture
def snapshot_config() -> Json:
    """Extra ``c.GPUSnapshot`` settings; tests override this fixture."""
    return {}


@pytest.fixture
def server_config() -> Json:
    """Extra server settings (other than ``GPUSnapshot``); tests override this fixture."""
    return {}


@pytest.fixture
def jp_server_config(
    store_dir: Path, criu_path: str, snapshot_config: Json, server_config: Json
) -> Config:
    config = Config(
        {
            "ServerApp": {"jpserver_extensions": {"jupyter_gpu_snapshot": True}},
            "GPUSnapshot": {
                "store_dir": str(store_dir),
                "criu_path": criu_path,
                # On by default; here only the tests about it want every teardown to save.
                "snapshot_on_shutdown": False,
                **snapshot_config,
            },
        }
    )
    config.merge(Config(server_config))
    return config


@pytest.fixture(autouse=True)
def snapshot_kernelspec(jp_kernel_dir: Path) -> Path:
    """python3-snapshot where this test's server looks for kernelspecs."""
    spec_dir = Path(jp_kernel_dir) / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps(kernel_json()))
    return spec_dir


# -- events ----------------------------------------------------------------------------------
def recorded_events(jp_serverapp: Any, schema_id: str) -> list[Json]:
    """A list that receives every event of ``schema_id`` the server emits from now on."""
    seen: list[Json] = []

    async def listener(logger: Any, schema_id: str, data: Json) -> None:
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=schema_id, listener=listener)
    return seen


# -- REST ------------------------------------------------------------------------------------
class Api:
    """Calls to the server under test; returns (status, JSON or None) without raising."""

    def __init__(self, fetch: Fetch, token: str = "") -> None:
        self.fetch = fetch
        self.token = token

    async def call(
        self,
        method: str,
        *parts: str,
        body: Json | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        request_timeout: float | None = None,
    ) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {"method": method, "raise_error": False}
        if request_timeout is not None:
            kwargs["request_timeout"] = request_timeout
        if method in ("POST", "PUT", "PATCH"):
            kwargs["body"] = json.dumps(body or {})
        if headers is not None:
            kwargs["headers"] = headers
        response = await self.fetch(*parts, params=params, **kwargs)
        try:
            data = json.loads(response.body) if response.body else None
        except ValueError:  # the server's own HTML error pages
            data = response.body.decode(errors="replace")
        return response.code, data

    async def ok(self, method: str, *parts: str, expect: int = 200, **kw: Any) -> Any:
        code, data = await self.call(method, *parts, **kw)
        assert code == expect, f"{method} {'/'.join(parts)}: {code} {data}"
        return data

    # -- the snapshot API --------------------------------------------------------------------
    async def save(self, kernel_id: str, **body: Any) -> Json:
        job: Json = await self.ok(
            "POST", "gpu-snapshot", "kernels", kernel_id, "snapshots", body=body, expect=202
        )
        return job

    async def restore(self, ref: str, **body: Any) -> Json:
        job: Json = await self.ok(
            "POST", "gpu-snapshot", "snapshots", ref, "restore", body=body, expect=202
        )
        return job

    async def snapshots(self, **params: str) -> list[Json]:
        data = await self.ok("GET", "gpu-snapshot", "snapshots", params=params)
        return list(data["snapshots"])

    async def wait(self, job: Json, timeout: float = JOB_TIMEOUT) -> Json:
        """Poll the job until it ends; return its last state."""
        deadline = time.monotonic() + timeout
        while job["status"] == "running":
            assert time.monotonic() < deadline, f"job did not end in {timeout}s: {job}"
            await asyncio.sleep(0.1)
            job = await self.ok("GET", "gpu-snapshot", "jobs", job["id"])
        return job

    async def succeeded(self, job: Json) -> Json:
        job = await self.wait(job)
        assert job["status"] == "succeeded", job["error"]
        return job

    async def saved_and_restored(self, kernel_id: str) -> str:
        """Saves the kernel, stopping it, and restores that snapshot: the new kernel's id."""
        job = await self.succeeded(await self.save(kernel_id, stop=True))
        restored = await self.succeeded(await self.restore(job["snapshot_id"]))
        return str(restored["result"]["kernel_id"])

    # -- the server's own API ----------------------------------------------------------------
    async def start_kernel(self, name: str = KERNEL_NAME) -> str:
        data = await self.ok("POST", "api", "kernels", body={"name": name}, expect=201)
        return str(data["id"])

    async def open_notebook(self, path: str, name: str | None = None) -> Json:
        """A notebook session with a new python3-snapshot kernel, as JupyterLab makes one."""
        body = {"path": path, "type": "notebook", "name": name or path,
                "kernel": {"name": KERNEL_NAME}}
        session: Json = await self.ok("POST", "api", "sessions", body=body, expect=201)
        return session

    async def kernel_ids(self) -> list[str]:
        return [k["id"] for k in await self.ok("GET", "api", "kernels")]


@pytest.fixture
def api(jp_fetch: Fetch, jp_auth_header: dict[str, str]) -> Api:
    return Api(jp_fetch, jp_auth_header["Authorization"])


# -- kernels over the websocket, as JupyterLab talks to them ---------------------------------
class KernelSocket:
    """A kernel's channels websocket; ``execute`` returns what the code printed."""

    def __init__(self, ws: WebSocketClientConnection) -> None:
        self.ws = ws
        self.session = uuid.uuid4().hex

    async def execute(self, code: str, timeout: float = 60.0) -> str:
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": "test",
            "session": self.session,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": "5.3",
        }
        content = {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        }
        message = {
            "header": header,
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": "shell",
            "buffers": [],
        }
        await self.ws.write_message(json.dumps(message))
        out: list[str] = []
        reply: Json | None = None
        idle = False
        deadline = time.monotonic() + timeout
        while reply is None or not idle:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to {code!r} in {timeout}s"
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            assert raw is not None, "the kernel's websocket closed"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, body = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(body["text"])
            elif kind == "execute_result":
                out.append(body["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                out.append("\n".join(body["traceback"]))
            elif kind == "execute_reply":
                reply = body
            elif kind == "status" and body["execution_state"] == "idle":
                idle = True
        text = "".join(out)
        assert reply["status"] == "ok", f"{code!r} failed: {text}"
        return text

    def close(self) -> None:
        self.ws.close()


KernelConnector = Callable[[str], Awaitable[KernelSocket]]


@pytest.fixture
def kernel_socket(
    jp_ws_fetch: Callable[..., Any], jp_asyncio_loop: asyncio.AbstractEventLoop,
) -> Iterator[KernelConnector]:
    sockets: list[KernelSocket] = []

    async def connect(kernel_id: str) -> KernelSocket:
        ws = await jp_ws_fetch("api", "kernels", kernel_id, "channels")
        sock = KernelSocket(ws)
        sockets.append(sock)
        return sock

    async def close_all() -> None:
        for sock in sockets:
            sock.close()

    yield connect
    # A socket the server has not closed yet writes its close frame, on the test's loop,
    # which runs no more once the test ended.
    jp_asyncio_loop.run_until_complete(close_all())


# -- servers in their own processes, as a user or systemd runs them --------------------------
SERVER_TOKEN = "server-process-test-token"
# The notebook these servers' tests open unless they say another, in a folder of the root.
NOTEBOOK = "project/reboot.ipynb"


class ServerProcess(JupyterServerProcess):
    """``jupyter server`` in its own process, as a user or systemd runs it, configured by
    ``env`` (see ``server_environment``), with this suite's REST and websocket clients.

    ``launcher`` runs it through another command (e.g. into other namespaces); ``host`` is
    the address it listens on; ``options`` are more of its command-line options.
    """

    def __init__(
        self,
        home: Path,
        env: dict[str, str],
        port: int,
        label: str,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
        options: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            home / f"server-{label}.log", env=env, host=host, port=port, token=SERVER_TOKEN,
            launcher=launcher, options=options,
        )
        self.env = env
        self.api = Api(self.fetch, f"token {SERVER_TOKEN}")
        # Closed by ``kill``: a test that fails midway leaves none open for the collector
        # to warn about during a later test.
        self.sockets: list[KernelSocket] = []

    def fetch(self, *parts: str, params: dict[str, str] | None = None, **kw: Any) -> Any:
        path = url_escape(url_path_join("/", *parts), plus=False)
        query = urllib.parse.urlencode(params or {})
        headers = {"Authorization": f"token {SERVER_TOKEN}", **(kw.pop("headers", None) or {})}
        url = f"http://{self.host}:{self.port}{path}?{query}"
        kw.setdefault("request_timeout", 60)
        return AsyncHTTPClient().fetch(url, headers=headers, **kw)

    async def open_notebook_kernel(
        self, kernel_ids: list[str], path: str = NOTEBOOK
    ) -> tuple[str, KernelSocket]:
        """A session for the notebook at ``path``; its kernel id also goes to ``kernel_ids``."""
        session = await self.api.open_notebook(path, path.rsplit("/", 1)[-1])
        kernel_id: str = session["kernel"]["id"]
        kernel_ids.append(kernel_id)
        return kernel_id, await self.kernel(kernel_id)

    async def restore_into_notebook(
        self, snapshot_id: str, kernel_ids: list[str], path: str = NOTEBOOK
    ) -> str:
        """Restores the snapshot into the notebook at ``path``, as JupyterLab's dialog does;
        the new kernel's id, once the notebook's session runs it (also in ``kernel_ids``)."""
        job = await self.api.succeeded(await self.api.restore(snapshot_id, path=path))
        kernel_id: str = job["result"]["kernel_id"]
        kernel_ids.append(kernel_id)
        session = await self.api.ok("GET", "api", "sessions", job["result"]["session_id"])
        assert session["path"] == path and session["kernel"]["id"] == kernel_id, session
        return kernel_id

    async def kernel(self, kernel_id: str) -> KernelSocket:
        url = f"ws://{self.host}:{self.port}/api/kernels/{kernel_id}/channels"
        request = HTTPRequest(url, headers={"Authorization": f"token {SERVER_TOKEN}"})
        socket = KernelSocket(await websocket_connect(request))
        self.sockets.append(socket)
        return socket

    def kill(self) -> None:
        for socket in self.sockets:
            socket.close()
        super().kill()


def base_environment() -> dict[str, str]:
    """This process's environment without its Jupyter settings: a server started with it
    reads only the configuration its test gives it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))}


def server_environment(
    tmp_path: Path, kernel_dir: Path, store: Path, criu: str, **settings: Any
) -> dict[str, str]:
    """The environment of a ServerProcess, its configuration under ``tmp_path``: the
    extension on, saving its kernels when it stops, with these ``GPUSnapshot`` settings."""
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    root = tmp_path / "notebooks"
    (root / "project").mkdir(parents=True)
    config = {
        "ServerApp": {
            "ip": "127.0.0.1",
            "port_retries": 0,
            "root_dir": str(root),
            "allow_root": True,
            "jpserver_extensions": {"jupyter_gpu_snapshot": True},
        },
        "IdentityProvider": {"token": SERVER_TOKEN},
        "GPUSnapshot": {
            "store_dir": str(store),
            "criu_path": criu,
            "snapshot_on_shutdown": True,
            "shutdown_budget": 60,
            **settings,
        },
    }
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(config))
    env = base_environment()
    env.update(
        HOME=str(tmp_path),
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_DATA_DIR=str(kernel_dir.parent),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    return env


@dataclass
class ServerProcesses:
    """The servers a test starts one after another on this machine, all with the same
    configuration, and the kernels they ran: all killed when the test ends."""

    home: Path
    env: dict[str, str]
    store_dir: Path
    servers: list[ServerProcess] = field(default_factory=list)
    kernel_ids: list[str] = field(default_factory=list)

    async def start(self, label: str) -> ServerProcess:
        """A server on a free port, listening."""
        server = ServerProcess(self.home, self.env, free_port(), label)
        self.servers.append(server)
        await server.ready()
        return server

    def kill_all(self) -> None:
        """The servers, then every process of their kernels."""
        for server in self.servers:
            server.kill()
        kill_kernels(self.kernel_ids)

    def store(self) -> SnapshotStore:
        """The servers' store, read with their key and kernel-log directory, not this
        process's."""
        return SnapshotStore(
            self.store_dir,
            Path(self.env["JUPYTER_DATA_DIR"]) / "gpu_snapshot_signing.key",
            ManifestPolicy(lambda: Path(self.env["JUPYTER_RUNTIME_DIR"]) / "gpu_snapshot"),
        )


@pytest.fixture
def server_processes(
    tmp_path: Path,
    snapshot_kernelspec: Path,
    store_dir: Path,
    criu_path: str,
    snapshot_config: Json,
) -> Iterator[ServerProcesses]:
    """Servers in their own processes, with this test's ``snapshot_config``."""
    env = server_environment(
        tmp_path, snapshot_kernelspec.parent, store_dir, criu_path, **snapshot_config
    )
    processes = ServerProcesses(tmp_path, env, store_dir)
    try:
        yield processes
    finally:
        processes.kill_all()


# -- failure injection -----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount tmpfs filesystems of a given size in MiB (root only, as criu itself)."""
    mounts: list[Path] = []

    def mount(mib: int) -> Path:
        point = tmp_path / f"disk-{len(mounts)}"
        point.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(point)],
            check=True,
        )
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def serve_with_fake_cuda(monkeypatch: pytest.MonkeyPatch, gpus: Any, kernel_bytes: int) -> None:
    """The server's engine gets a CUDA hook over the scripted driver behind ``gpus`` (a
    ``testkit.fake_driver.FakeGpus``), and each kernel it starts holds ``kernel_bytes``."""
    from jupyter_gpu_snapshot.config import GPUSnapshot
    from jupyter_gpu_snapshot.core.engine import SnapshotEngine
    from jupyter_gpu_snapshot.gpu.hook import CudaCheckpointHook
    from jupyter_gpu_snapshot.node.local_engine import default_hooks, make_engine
    from jupyter_gpu_snapshot.server import wiring
    from testkit.fake_driver import FAKE_ENV, FORCE_CUDA_PLUGIN, GIB

    monkeypatch.setenv(FAKE_ENV, f"{kernel_bytes}:{uuid.uuid4().hex}")

    def engine_with_fake_cuda(settings: GPUSnapshot) -> SnapshotEngine:
        cuda = CudaCheckpointHook(driver=gpus.driver.status, inventory=gpus, lock_timeout=1.0,
                                  drop_caches=False, memory_available=lambda: 64 * GIB,
                                  criu_env=FORCE_CUDA_PLUGIN)
        return make_engine(settings, hooks=[*default_hooks(settings)[:-1], cuda])

    monkeypatch.setattr(wiring, "process_engine", engine_with_fake_cuda)
