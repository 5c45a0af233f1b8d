"""Saves upload by themselves: user saves, autosaves and shutdown saves, on a real server.

A failed upload never costs the local snapshot: the save succeeds, its job says what
failed, and the server log says it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpu_snapshot.core.remote import RemoteStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json

from ..server.test_reboot import ServerProcess, _environment, _free_port, _kernel_processes
from .seaweed import SeaweedServer

NOTEBOOK = "project/uploads.ipynb"
AUTOSAVE = {
    "autosave_interval_minutes": 2 / 60,
    "autosave_check_seconds": 0.2,
    "autosave_min_free_bytes": 0,
}


def _server_env(tmp_path: Path, criu: str, **settings: Any) -> dict[str, str]:
    kernel_dir = tmp_path / "data" / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(json.dumps(kernel_json()))
    env = _environment(tmp_path, kernel_dir.parent, tmp_path / "snapshots", criu)
    config_file = Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_server_config.json"
    config = json.loads(config_file.read_text())
    config["GPUSnapshot"].update(settings)
    config_file.write_text(json.dumps(config))
    return env


def _remote_settings(seaweed: SeaweedServer, url: str) -> dict[str, Any]:
    options = seaweed.storage_options()
    return {
        "remote_url": url,
        "remote_endpoint_url": options["endpoint_url"],
        "remote_options": {"key": options["key"], "secret": options["secret"]},
    }


def _kill(server: ServerProcess, kernel_ids: list[str]) -> None:
    server.kill()
    for kernel_id in kernel_ids:
        for pid in _kernel_processes(kernel_id):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_a_failed_upload_keeps_the_save_and_says_why(
    tmp_path: Path, seaweed: SeaweedServer, criu_path: str
) -> None:
    settings = _remote_settings(seaweed, "s3://no-such-bucket/alice")
    env = _server_env(tmp_path, criu_path, snapshot_on_shutdown=False, **settings)
    asyncio.run(_failed_upload(ServerProcess(tmp_path, env, _free_port(), "uploads")))


async def _failed_upload(server: ServerProcess) -> None:
    kernel_ids: list[str] = []
    try:
        await server.ready()
        kernel_id, ws = await server.open_notebook_kernel(kernel_ids, NOTEBOOK)
        await ws.execute("state = 5")

        job = await server.api.succeeded(await server.api.save(kernel_id, name="kept"))
        upload = job["result"]["upload"]
        assert upload["status"] == "failed", upload
        assert upload["error"]["step"] == "upload", upload
        assert "no-such-bucket" in upload["error"]["message"], upload
        (listed,) = await server.api.snapshots()
        assert listed["name"] == "kept" and listed["status"] == "ok", listed
        assert listed["location"] == "local", listed
        # The kernel was not held by the upload, and it goes on answering.
        assert (await ws.execute("print(state)")).strip() == "5"
        ws.close()
        assert "its upload to s3://no-such-bucket/alice failed" in server.log, server.log
    finally:
        _kill(server, kernel_ids)


def test_autosaves_and_shutdown_saves_upload(
    tmp_path: Path, seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any],
    criu_path: str,
) -> None:
    settings = _remote_settings(seaweed, remote_url)
    env = _server_env(
        tmp_path, criu_path, snapshot_on_shutdown=True, shutdown_budget=60, **AUTOSAVE,
        **settings,
    )
    server = ServerProcess(tmp_path, env, _free_port(), "autosave")
    remote = RemoteStore(remote_url, s3_options)
    asyncio.run(_autosave_and_shutdown(server, remote))


async def _autosave_and_shutdown(server: ServerProcess, remote: RemoteStore) -> None:
    kernel_ids: list[str] = []
    try:
        await server.ready()
        kernel_id, ws = await server.open_notebook_kernel(kernel_ids, NOTEBOOK)
        await ws.execute("state = 1")

        deadline = time.monotonic() + 120
        while True:
            found = [s for s in await server.api.snapshots() if s["reason"] == "autosave"]
            if found and found[0]["location"] == "both":
                break
            assert time.monotonic() < deadline, f"no uploaded autosave: {found}\n{server.log}"
            await asyncio.sleep(0.5)
        autosave_id = found[0]["id"]
        await server.api.ok(
            "PUT", "gpu-snapshot", "kernels", kernel_id, "autosave", body={"enabled": False}
        )
        await ws.execute("state = 2")  # work since the autosave: the shutdown saves it
        ws.close()

        server.proc.send_signal(signal.SIGTERM)
        assert await server.exited() == 0, server.log
        uploaded = {s.id: s for s in await asyncio.to_thread(remote.list)}
        reasons = sorted(str((s.manifest or {}).get("reason")) for s in uploaded.values())
        assert autosave_id in uploaded and "shutdown" in reasons, (reasons, server.log)
    finally:
        _kill(server, kernel_ids)
