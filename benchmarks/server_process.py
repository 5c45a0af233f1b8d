"""A real ``jupyter server`` with the extension in its own process, and its kernels, for
benchmarks that measure what a user of the REST API sees."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from jupyter_client.blocking import BlockingKernelClient

from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME
from tests.processes import free_port, power_loss, shut_down
from tests.ui.servers import until_job_ends


class Server:
    """``jupyter server`` with the extension, in its own process, under ``base``."""

    def __init__(self, base: Path, snapshot_settings: dict[str, Any], label: str) -> None:
        self.base = base
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.runtime = base / "runtime"
        config_dir = base / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (base / "notebooks").mkdir(exist_ok=True)
        config = {
            "ServerApp": {
                "ip": "127.0.0.1", "port": self.port, "port_retries": 0,
                "root_dir": str(base / "notebooks"), "allow_root": True,
                "open_browser": False, "jpserver_extensions": {"jupyter_gpu_snapshot": True},
            },
            "IdentityProvider": {"token": self.token},
            "GPUSnapshot": {"store_dir": str(base / "store"), **snapshot_settings},
        }
        (config_dir / "jupyter_server_config.json").write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))}
        env.update(JUPYTER_CONFIG_DIR=str(config_dir), JUPYTER_RUNTIME_DIR=str(self.runtime))
        self.log_path = base / f"server-{label}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter_server"], env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                self.request("GET", "gpu-snapshot/snapshots")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()}")
            time.sleep(0.3)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}", data=data, method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def open_notebook(self, path: str) -> str:
        session = self.request("POST", "api/sessions", {
            "path": path, "name": path, "type": "notebook", "kernel": {"name": KERNEL_NAME},
        })
        return str(session["kernel"]["id"])

    def wait_job(self, job: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        return until_job_ends(lambda path: self.request("GET", path), job, timeout)

    def connection_info(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's ports and key, as its server wrote them when it started the kernel."""
        info: dict[str, Any] = json.loads(
            (self.runtime / f"kernel-{kernel_id}.json").read_text())
        return info

    def power_loss(self, kernel_id: str) -> None:
        """SIGKILL the server, its children and the kernel's processes, all at once."""
        power_loss(self.proc.pid, [kernel_id])
        self.proc.wait()

    def stop(self) -> None:
        shut_down(self.proc, 120)


def connect(connection_info: dict[str, Any]) -> BlockingKernelClient:
    client = BlockingKernelClient()
    client.load_connection_info(connection_info)
    client.start_channels(hb=False)
    client.wait_for_ready(timeout=300)
    return client


def run_cell(client: BlockingKernelClient, code: str, timeout: float) -> str:
    printed: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append("\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    text = "".join(printed)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell failed: {code[:80]!r}:\n{text}")
    return text
