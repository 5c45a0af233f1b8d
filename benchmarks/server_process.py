"""A real ``jupyter server`` with the extension in its own process, and its kernels, for
benchmarks that measure what a user of the REST API sees."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

from jupyter_client.blocking import BlockingKernelClient

from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME
from testkit.jupyter_processes import until_job_ends
from testkit.server_process import JupyterServerProcess


class Server(JupyterServerProcess):
    """``jupyter server`` with the extension, in its own process, under ``base``; listening
    once constructed."""

    def __init__(self, base: Path, snapshot_settings: dict[str, Any], label: str) -> None:
        self.base = base
        self.runtime = base / "runtime"
        config_dir = base / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (base / "notebooks").mkdir(exist_ok=True)
        # Its address, port and token are on its command line.
        config = {
            "ServerApp": {
                "root_dir": str(base / "notebooks"),
                "jpserver_extensions": {"jupyter_gpu_snapshot": True},
            },
            "GPUSnapshot": {"store_dir": str(base / "store"), **snapshot_settings},
        }
        (config_dir / "jupyter_server_config.json").write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "JPY_"))}
        env.update(JUPYTER_CONFIG_DIR=str(config_dir), JUPYTER_RUNTIME_DIR=str(self.runtime))
        super().__init__(base / f"server-{label}.log", env=env, stop_timeout=120)
        self.wait_ready(120, interval=0.3, extension=True)

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
