"""The CLI and the server on one kernel or one snapshot: exactly one operation runs, the
other is refused as busy (409, or a failed job naming the step), and the kernel answers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.core.locks import kernel_key, snapshot_key
from jupyter_gpu_snapshot.core.store import SnapshotStore
from testkit.criu_wrappers import gated

from .conftest import Api, KernelConnector

SNAPSHOTS = ("gpu-snapshot", "snapshots")


def _cli(store_dir: Path, criu: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpu_snapshot.cli", "--store", str(store_dir),
         "--criu", criu, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )


async def _until_held(store_dir: Path, key: str, proc: subprocess.Popen[str]) -> None:
    store = SnapshotStore(store_dir)
    deadline = time.monotonic() + 60
    while not store.locks.is_held(key):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_cli_save_and_rest_save_of_one_kernel(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, store_dir: Path, tmp_path: Path
):
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("counter = 0; blob = b'x' * (20 << 20)")
    root = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid
    criu, gate = gated(tmp_path, "dump")
    cli = _cli(store_dir, criu, "save", "--pid", str(root), "--json")
    try:
        await _until_held(store_dir, kernel_key(root), cli)
        job = await api.wait(await api.save(kernel_id))
    finally:
        gate.touch()

    assert job["status"] == "failed"
    assert job["error"]["step"] == "preflight" and "is busy: pid" in job["error"]["message"]
    out, err = await asyncio.to_thread(cli.communicate, timeout=120)
    assert cli.returncode == 0, err
    assert [s["id"] for s in await api.snapshots()] == [json.loads(out)["id"]]
    assert (await ws.execute("counter += 1; print(counter)")).strip() == "1"
    assert kernel_id in await api.kernel_ids()


async def test_rest_delete_during_a_cli_restore(
    api: Api, kernel_socket: KernelConnector, store_dir: Path, tmp_path: Path
):
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("counter = 0")
    job = await api.succeeded(await api.save(kernel_id, name="shared", stop=True))
    criu, gate = gated(tmp_path, "restore")
    cli = _cli(store_dir, criu, "restore", "shared", "--json")
    try:
        try:
            await _until_held(store_dir, snapshot_key(job["snapshot_id"]), cli)
            code, error = await api.call("DELETE", *SNAPSHOTS, "shared")
        finally:
            gate.touch()
        assert code == 409 and "is busy" in error["message"] and error["step"] == "delete"
        out, err = await asyncio.to_thread(cli.communicate, timeout=120)
        assert cli.returncode == 0, err
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    from jupyter_gpu_snapshot.core import procfs

    procfs.kill_tree(json.loads(out)["pid"])
    assert [s["name"] for s in await api.snapshots()] == ["shared"]


async def test_deeply_nested_body_is_400(api: Api):
    kernel_id = await api.start_kernel()
    response = await api.fetch(
        "gpu-snapshot", "kernels", kernel_id, "snapshots", method="POST",
        body="[" * 200_000, raise_error=False,
    )
    assert response.code == 400
    assert "nested too deeply" in json.loads(response.body)["message"]
    assert await api.snapshots() == []
