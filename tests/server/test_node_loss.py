"""A node that goes away without warning: real server processes, real kernels, real CRIU.

The server and every kernel process are SIGKILLed at once, as a power loss or a kernel
panic ends them, and the page cache is dropped where this machine allows it. The next
server must offer each notebook its newest autosave, restore it with the state it had
then, and list nothing partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpu_snapshot.core.manifest import ManifestPolicy
from jupyter_gpu_snapshot.core.store import PARTIAL_PREFIX, SnapshotStore

from .conftest import Json
from .test_reboot import (
    NOTEBOOK,
    ServerProcess,
    _clean_up,
    _environment,
    _kernel_processes,
)

AUTOSAVE = {
    "autosave_interval_minutes": 2 / 60,
    "autosave_check_seconds": 0.2,
    "autosave_min_free_bytes": 0,
}


def _with_autosave(env: dict[str, str], **settings: Any) -> dict[str, str]:
    config_file = Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_server_config.json"
    config = json.loads(config_file.read_text())
    config["GPUSnapshot"].update(AUTOSAVE, **settings)
    config_file.write_text(json.dumps(config))
    return env


def _power_loss(server: ServerProcess, kernel_ids: list[str]) -> None:
    """SIGKILL the server, its children (criu included) and every kernel process at once."""
    doomed = {server.proc.pid}
    with contextlib.suppress(psutil.NoSuchProcess):
        doomed |= {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    for kernel_id in kernel_ids:
        doomed |= set(_kernel_processes(kernel_id))
    # Stopped first, so that none of them sees another die and cleans up after it.
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    server.proc.wait()
    for kernel_id in kernel_ids:
        deadline = time.monotonic() + 60
        while _kernel_processes(kernel_id):
            assert time.monotonic() < deadline, "a kernel process survived SIGKILL"
            time.sleep(0.05)
    os.sync()
    # What a reboot does to the page cache; not every container may do it.
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _partials(store_dir: Path) -> dict[Path, int]:
    """The store's working directories and the bytes written into each."""
    return {
        entry: sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        for entry in store_dir.iterdir() if entry.name.startswith(PARTIAL_PREFIX)
    }


async def _until_autosaved(server: ServerProcess, count: int, timeout: float = 90) -> list[Json]:
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s for s in await server.api.snapshots(notebook_path=NOTEBOOK)
            if s["reason"] == "autosave"
        ]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} autosaves, not {count}:\n{server.log}"
        await asyncio.sleep(0.1)


async def _until_no_job(server: ServerProcess, kernel_id: str) -> None:
    deadline = time.monotonic() + 90
    path = ("gpu-snapshot", "kernels", kernel_id, "autosave")
    while (await server.api.ok("GET", *path))["autosaving"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def _restore_into_notebook(server: ServerProcess, snapshot_id: str) -> str:
    job = await server.api.succeeded(await server.api.restore(snapshot_id, path=NOTEBOOK))
    return str(job["result"]["kernel_id"])


async def test_after_a_hard_kill_the_newest_autosave_comes_back(
    tmp_path: Path, snapshot_kernelspec: Path, store_dir: Path, criu_path: str
) -> None:
    env = _with_autosave(_environment(tmp_path, snapshot_kernelspec.parent, store_dir, criu_path))
    servers: list[ServerProcess] = []
    kernel_ids: list[str] = []
    try:
        first = await ServerProcess.start(tmp_path, env, "before", servers)
        kernel_id, ws = await first.open_notebook_kernel(kernel_ids)
        await ws.execute("import random; random.seed(7); state = {'step': 1}")
        autosave = (await _until_autosaved(first, 1))[-1]
        await _until_no_job(first, kernel_id)
        # Work after the autosave that the power loss takes away (no later autosave).
        await first.api.ok(
            "PUT", "gpu-snapshot", "kernels", kernel_id, "autosave", body={"enabled": False}
        )
        expected = (await ws.execute("print(random.random())")).strip()
        await ws.execute("state['step'] = 2; lost = True")
        ws.close()

        _power_loss(first, kernel_ids)

        second = await ServerProcess.start(tmp_path, env, "after", servers)
        # The offer: the notebook's newest snapshot, an autosave, and nothing partial.
        latest = await second.api.snapshots(notebook_path=NOTEBOOK, latest="true")
        assert [s["id"] for s in latest] == [autosave["id"]], latest
        assert latest[0]["reason"] == "autosave" and latest[0]["notebook_path"] == NOTEBOOK
        assert [s["id"] for s in await second.api.snapshots()] == [autosave["id"]]
        assert _partials(store_dir) == {}

        new_id = await _restore_into_notebook(second, autosave["id"])
        kernel_ids.append(new_id)
        ws = await second.kernel(new_id)
        # The state at the autosave, its RNG included; the later cells are gone.
        assert (await ws.execute("print(state['step'], 'lost' in dir())")).split() == [
            "1", "False",
        ]
        assert (await ws.execute("print(random.random())")).strip() == expected
        ws.close()
    finally:
        _clean_up(servers, kernel_ids)


async def test_a_kill_during_an_autosave_keeps_the_previous_one(
    tmp_path: Path, snapshot_kernelspec: Path, store_dir: Path, criu_path: str
) -> None:
    env = _with_autosave(_environment(tmp_path, snapshot_kernelspec.parent, store_dir, criu_path))
    servers: list[ServerProcess] = []
    kernel_ids: list[str] = []
    try:
        first = await ServerProcess.start(tmp_path, env, "before", servers)
        kernel_id, ws = await first.open_notebook_kernel(kernel_ids)
        # Big enough that the next dump takes a while to write.
        await ws.execute("import os; blob = os.urandom(300 << 20); state = 1")
        previous = (await _until_autosaved(first, 1))[-1]
        await _until_no_job(first, kernel_id)
        await ws.execute("state = 2")

        # The next autosave starts within an interval; kill once its images are on disk.
        deadline = time.monotonic() + 60
        half: Path | None = None
        while half is None:
            assert time.monotonic() < deadline, f"no autosave started:\n{first.log}"
            for entry, written in _partials(store_dir).items():
                if written > 16 << 20:
                    half = entry
            await asyncio.sleep(0.01)
        ws.close()
        _power_loss(first, kernel_ids)
        assert half.exists(), "the save committed before the kill"

        second = await ServerProcess.start(tmp_path, env, "after", servers)
        assert not half.exists(), "the half-written autosave was not cleaned up"
        listed = await second.api.snapshots()
        assert [s["id"] for s in listed] == [previous["id"]], listed
        latest = await second.api.snapshots(notebook_path=NOTEBOOK, latest="true")
        assert [s["id"] for s in latest] == [previous["id"]]
        # The servers' key and kernel-log directory, not this process's.
        store = SnapshotStore(
            store_dir,
            Path(env["JUPYTER_DATA_DIR"]) / "gpu_snapshot_signing.key",
            ManifestPolicy(lambda: Path(env["JUPYTER_RUNTIME_DIR"]) / "gpu_snapshot"),
        )
        store.verify(store.get(previous["id"]))

        new_id = await _restore_into_notebook(second, previous["id"])
        kernel_ids.append(new_id)
        ws = await second.kernel(new_id)
        assert (await ws.execute("print(state, len(blob))")).split() == ["1", str(300 << 20)]
        ws.close()
    finally:
        _clean_up(servers, kernel_ids)
