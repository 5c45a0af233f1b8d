"""Through the REST API: save a kernel with state, restore it into a new slot, use it."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from jupyter_gpu_snapshot.server.wiring import JOB_EVENT_ID

from .conftest import Api, KernelConnector

STATE = """
import os, random
counter = 41
words = ["snap", "shot"]
random.seed(7)
def bump():
    global counter
    counter += 1
    return counter
"""
CHECK = "print(bump(), '-'.join(words), random.random())"


def _private(store_dir: Path) -> bool:
    dirs = [store_dir, *(p for p in store_dir.rglob("*") if p.is_dir())]
    files = [p for p in store_dir.rglob("*") if p.is_file()]
    return bool(files) and all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in dirs) and all(
        stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files
    )


def _credential(jp_serverapp: Any, kernel_id: str) -> str:
    """The credential the kernel's provisioner made for its launch."""
    credential = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.kernel_credential
    assert credential and credential.startswith(f"gpusnap-kernel.{kernel_id}."), credential
    return str(credential)


async def test_save_shutdown_restore_keeps_state(
    api: Api, kernel_socket: KernelConnector, jp_serverapp: Any, store_dir: Path
) -> None:
    events: list[dict[str, Any]] = []

    async def listen(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        events.append(data)

    jp_serverapp.event_logger.add_listener(schema_id=JOB_EVENT_ID, listener=listen)

    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute(STATE)
    env = await ws.execute(
        "print(*(os.environ['JUPYTER_GPU_SNAPSHOT_' + k] for k in ('KERNEL_ID', 'URL', 'TOKEN')))"
    )
    url = f"http://localhost:{jp_serverapp.port}{jp_serverapp.base_url}"
    # The kernel's own credential, never the server's token.
    assert env.split() == [kernel_id, url, _credential(jp_serverapp, kernel_id)]
    assert jp_serverapp.identity_provider.token not in env
    # What a cell after the snapshot prints, the restored kernel must print too.
    expected = await ws.execute("import copy; _rng = random.getstate(); " + CHECK)
    await ws.execute("counter -= 1; random.setstate(_rng)")

    job = await api.save(kernel_id, name="with-state")
    assert job["kind"] == "save" and job["kernel_id"] == kernel_id
    job = await api.succeeded(job)
    summary = job["result"]
    assert summary["name"] == "with-state" and summary["id"] == job["snapshot_id"]
    assert "key" not in summary["kernel"]["connection_info"]
    assert [s["id"] for s in await api.snapshots()] == [summary["id"]]
    # Snapshots hold all of the kernel's memory: nobody else may read them.
    assert _private(store_dir)

    # Progress went out as events, phase by phase, ending in success.
    mine = [e for e in events if e["id"] == job["id"]]
    phases = [e["phase"] for e in mine]
    for phase in ("preflight", "suspend", "dump", "resume", "commit", "done"):
        assert phase in phases, phases
    assert phases.index("dump") < phases.index("commit") < phases.index("done")
    assert mine[-1]["status"] == "succeeded"
    assert any(e["phase"] == "commit" and e["total"] > 0 for e in mine)

    # The kernel kept running through the save.
    assert (await ws.execute("print(counter)")).strip() == "41"
    await api.ok("DELETE", "api", "kernels", kernel_id, expect=204)

    job = await api.restore(summary["id"])
    new_id = job["kernel_id"]
    assert new_id != kernel_id and job["kind"] == "restore"
    job = await api.succeeded(job)
    assert job["result"] == {"kernel_id": new_id, "session_id": None, "gpu_remap": None}
    assert new_id in await api.kernel_ids()

    restored = await kernel_socket(new_id)
    assert await restored.execute(CHECK) == expected
    # It knows its new slot (the %gpu_snapshot magic relies on it), with a fresh credential.
    assert (await restored.execute(
        "print(os.environ['JUPYTER_GPU_SNAPSHOT_KERNEL_ID'], "
        "os.environ['JUPYTER_GPU_SNAPSHOT_TOKEN'])"
    )).split() == [new_id, _credential(jp_serverapp, new_id)]
    status = await api.ok("GET", "gpu-snapshot", "kernels", new_id, "status")
    assert status["ready"], status["reasons"]
    assert status["last_snapshot"] is None or status["last_snapshot"]["id"] == summary["id"]


async def test_a_save_right_after_start_waits_for_the_kernel(
    api: Api, kernel_socket: KernelConnector
) -> None:
    # The server lists a kernel as soon as its process runs; a dump taken before the
    # kernel has bound its ports would come back as a process that never answers.
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(await api.saved_and_restored(kernel_id))
    assert (await ws.execute("print('answers')", timeout=20)).strip() == "answers"
