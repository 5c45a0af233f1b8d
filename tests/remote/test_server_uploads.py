"""Saves upload by themselves: user saves, autosaves and shutdown saves, on a real server.

A failed upload never costs the local snapshot: the save succeeds, its job says what
failed, and the server log says it too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.store.remote import RemoteStore
from jupyter_gpu_snapshot.launch.kernelspec import KERNEL_NAME, kernel_json
from testkit.seaweed import SeaweedServer

from ..server.conftest import ServerProcesses, server_environment

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
    return server_environment(tmp_path, kernel_dir.parent, tmp_path / "snapshots", criu, **settings)


def _remote_settings(seaweed: SeaweedServer, url: str) -> dict[str, Any]:
    options = seaweed.storage_options()
    return {
        "remote_url": url,
        "remote_endpoint_url": options["endpoint_url"],
        "remote_options": {"key": options["key"], "secret": options["secret"]},
    }


def _on_servers(
    tmp_path: Path, env: dict[str, str], scenario: Callable[[ServerProcesses], Awaitable[None]]
) -> None:
    """Runs ``scenario`` with servers of ``env``; they and their kernels are killed after."""
    node = ServerProcesses(tmp_path, env, tmp_path / "snapshots")

    async def run() -> None:
        try:
            await scenario(node)
        finally:
            node.kill_all()

    asyncio.run(run())


def test_a_failed_upload_keeps_the_save_and_says_why(
    tmp_path: Path, seaweed: SeaweedServer, criu_path: str
) -> None:
    settings = _remote_settings(seaweed, "s3://no-such-bucket/alice")
    env = _server_env(tmp_path, criu_path, snapshot_on_shutdown=False, **settings)
    _on_servers(tmp_path, env, _failed_upload)


async def _failed_upload(node: ServerProcesses) -> None:
    server = await node.start("uploads")
    kernel_id, ws = await server.open_notebook_kernel(node.kernel_ids, NOTEBOOK)
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


def test_autosaves_and_shutdown_saves_upload(
    tmp_path: Path, seaweed: SeaweedServer, remote_url: str, s3_options: dict[str, Any],
    criu_path: str,
) -> None:
    settings = _remote_settings(seaweed, remote_url)
    env = _server_env(
        tmp_path, criu_path, snapshot_on_shutdown=True, shutdown_budget=60, **AUTOSAVE,
        **settings,
    )
    remote = RemoteStore(remote_url, s3_options)
    _on_servers(tmp_path, env, lambda node: _autosave_and_shutdown(node, remote))


async def _autosave_and_shutdown(node: ServerProcesses, remote: RemoteStore) -> None:
    server = await node.start("autosave")
    kernel_id, ws = await server.open_notebook_kernel(node.kernel_ids, NOTEBOOK)
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
