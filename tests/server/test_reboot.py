"""The node reboot flow with real server processes: SIGTERM saves the kernels, the next
server lists those snapshots for their notebooks and restores one into the notebook."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import psutil
from jupyter_server.utils import url_path_join
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPRequest, HTTPResponse
from tornado.websocket import websocket_connect

from jupyter_gpu_snapshot.core.manifest import ManifestPolicy
from jupyter_gpu_snapshot.core.store import SnapshotStore

from .conftest import Api, KernelSocket

TOKEN = "reboot-test-token"
NOTEBOOK = "project/reboot.ipynb"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``jupyter server`` in its own process, as a user or systemd runs it.

    ``launcher`` runs it through another command (e.g. into other namespaces); ``host`` is
    the address it listens on.
    """

    def __init__(
        self,
        home: Path,
        env: dict[str, str],
        port: int,
        label: str,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        self.host = host
        self.log_path = home / f"server-{label}.log"
        self.env = env
        log = open(self.log_path, "wb")  # noqa: SIM115 - the server process owns it
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "jupyter_server", "--no-browser",
             f"--port={port}", f"--ServerApp.ip={host}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.api = Api(self.fetch, f"token {TOKEN}")

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def fetch(self, *parts: str, params: dict[str, str] | None = None, **kw: Any) -> Any:
        path = url_escape(url_path_join("/", *parts), plus=False)
        query = urllib.parse.urlencode(params or {})
        headers = {"Authorization": f"token {TOKEN}", **(kw.pop("headers", None) or {})}
        url = f"http://{self.host}:{self.port}{path}?{query}"
        kw.setdefault("request_timeout", 60)
        return AsyncHTTPClient().fetch(url, headers=headers, **kw)

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited:\n{self.log}"
            try:
                response: HTTPResponse = await self.fetch("api", "status", raise_error=False)
                if response.code == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"the server did not start in {timeout}s:\n{self.log}")

    @classmethod
    async def start(
        cls, home: Path, env: dict[str, str], label: str, started: list[ServerProcess]
    ) -> ServerProcess:
        """A server on a free port, listening; kept in ``started`` for the clean-up."""
        server = cls(home, env, _free_port(), label)
        started.append(server)
        await server.ready()
        return server

    async def open_notebook_kernel(
        self, kernel_ids: list[str], path: str = NOTEBOOK
    ) -> tuple[str, KernelSocket]:
        """A session for the notebook at ``path``; its kernel id also goes to ``kernel_ids``."""
        session = await self.api.open_notebook(path, path.rsplit("/", 1)[-1])
        kernel_id: str = session["kernel"]["id"]
        kernel_ids.append(kernel_id)
        return kernel_id, await self.kernel(kernel_id)

    async def kernel(self, kernel_id: str) -> KernelSocket:
        url = f"ws://{self.host}:{self.port}/api/kernels/{kernel_id}/channels"
        request = HTTPRequest(url, headers={"Authorization": f"token {TOKEN}"})
        return KernelSocket(await websocket_connect(request))

    async def exited(self, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"the server did not stop:\n{self.log}"
            await asyncio.sleep(0.1)
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _clean_up(servers: list[ServerProcess], kernel_ids: list[str]) -> None:
    """Kill what a test started: its servers, then every process of its kernels."""
    for server in servers:
        server.kill()
    for kid in kernel_ids:
        for pid in _kernel_processes(kid):
            # Killing a namespace's init ends the rest of it meanwhile.
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def _kernel_processes(kernel_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(kernel_id in arg for arg in proc.info.get("cmdline") or []):
            found.append(proc.pid)
    return found


def _environment(tmp_path: Path, kernel_dir: Path, store: Path, criu: str) -> dict[str, str]:
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
        "IdentityProvider": {"token": TOKEN},
        "GPUSnapshot": {
            "store_dir": str(store),
            "criu_path": criu,
            "snapshot_on_shutdown": True,
            "shutdown_budget": 60,
        },
    }
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(config))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))
    }
    env.update(
        HOME=str(tmp_path),
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_DATA_DIR=str(kernel_dir.parent),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    return env


async def test_sigterm_saves_kernels_and_the_next_server_restores_them(
    tmp_path: Path, snapshot_kernelspec: Path, store_dir: Path, criu_path: str
) -> None:
    env = _environment(tmp_path, snapshot_kernelspec.parent, store_dir, criu_path)
    servers: list[ServerProcess] = []
    kernel_ids: list[str] = []
    try:
        first = await ServerProcess.start(tmp_path, env, "before", servers)
        kernel_id, ws = await first.open_notebook_kernel(kernel_ids)
        await ws.execute("trained = {'epoch': 12, 'loss': 0.125}")
        ws.close()

        # What systemd does when the node shuts down.
        first.proc.send_signal(signal.SIGTERM)
        assert await first.exited() == 0, first.log
        assert "gpu-snapshot: saved kernel" in first.log, first.log
        assert _kernel_processes(kernel_id) == []

        # The next boot: a new server process with the same configuration.
        second = await ServerProcess.start(tmp_path, env, "after", servers)
        listed = await second.api.snapshots(notebook_path=NOTEBOOK)
        assert len(listed) == 1, listed
        snapshot = listed[0]
        assert snapshot["reason"] == "shutdown" and snapshot["kernel"]["kernel_id"] == kernel_id

        job = await second.api.succeeded(await second.api.restore(snapshot["id"], path=NOTEBOOK))
        new_id = job["result"]["kernel_id"]
        kernel_ids.append(new_id)
        session = await second.api.ok("GET", "api", "sessions", job["result"]["session_id"])
        assert session["path"] == NOTEBOOK and session["kernel"]["id"] == new_id
        ws = await second.kernel(new_id)
        assert (await ws.execute("print(trained['epoch'], trained['loss'])")).split() == [
            "12", "0.125",
        ]
        ws.close()

        # `jupyter server stop` takes the same way out and saves the restored kernel.
        stop = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "jupyter_server", "stop", str(second.port)],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )
        assert stop.returncode == 0, stop.stderr
        await second.exited()
        assert _kernel_processes(new_id) == []
        # The servers' key and kernel-log directory, not this process's.
        store = SnapshotStore(
            store_dir,
            Path(env["JUPYTER_DATA_DIR"]) / "gpu_snapshot_signing.key",
            ManifestPolicy(lambda: Path(env["JUPYTER_RUNTIME_DIR"]) / "gpu_snapshot"),
        )
        saved = store.list(NOTEBOOK)
        assert [s.manifest["kernel"]["kernel_id"] for s in saved] == [kernel_id, new_id]
        for s in saved:
            store.verify(s)
    finally:
        _clean_up(servers, kernel_ids)
