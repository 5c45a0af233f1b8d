"""The failure contract through the server: a failed job names the step and the cause, the
kernel stays alive in its slot and answers, nothing partial is listed, and earlier
snapshots are untouched."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.errors import SnapshotError
from jupyter_gpu_snapshot.core.restore import RestoredKernel
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.launch.provisioner import SnapshotReadyProvisioner
from testkit import stored_pages

from .conftest import Api, KernelConnector, KernelSocket

# criu as the server runs it, with one fault injected into the next dump when the file
# INJECT next to it names one:
#   kill  SIGKILL the real criu once it has written its first images, then itself;
#   fill  fill the store's disk (leaving 1 MiB) just before the real criu starts.
WRAPPER = """#!/bin/sh
real="{real}"
inject="$(dirname "$0")/INJECT"
[ "$1" = dump ] && [ -f "$inject" ] || exec "$real" "$@"
mode="$(cat "$inject")"; rm -f "$inject"
images=""; prev=""
for arg in "$@"; do [ "$prev" = "-D" ] && images="$arg"; prev="$arg"; done
if [ "$mode" = fill ]; then
    avail=$(df --output=avail -B1 "$images" | tail -1)
    fallocate -l $((avail - 1048576)) "{filler}"
    exec "$real" "$@"
fi
"$real" "$@" &
criu=$!
i=0
# Once criu writes the kernel's memory pages (16 MiB: namespace init's image is 4 MiB); a
# kill while it patches its parasite into a process or takes it out can end the kernel too,
# which no rollback undoes (README, limits).
while [ $i -lt 1000 ] && [ -z "$(find "$images" -name 'pages-*.img' -size +16M)" ]; do
    sleep 0.005; i=$((i + 1))
done
kill -9 $criu
kill -9 $$
"""


@pytest.fixture
def disk(small_disk: Callable[[int], Path]) -> Path:
    return small_disk(512)


@pytest.fixture
def store_dir(disk: Path) -> Path:
    return disk / "store"


@pytest.fixture
def filler(disk: Path) -> Path:
    return disk / "filler"


@pytest.fixture
def criu_path(tmp_path: Path, filler: Path) -> str:
    real = shutil.which("criu")
    assert real
    wrapper = tmp_path / "criu-wrapper" / "criu"
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(real=real, filler=filler))
    wrapper.chmod(0o755)
    return str(wrapper)


def inject(criu_path: str, mode: str) -> None:
    (Path(criu_path).parent / "INJECT").write_text(mode)


async def _kernel(api: Api, kernel_socket: KernelConnector) -> tuple[str, KernelSocket]:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("counter = 0; blob = b'y' * (40 << 20)")
    return kernel_id, ws


async def assert_contract(
    api: Api, ws: KernelSocket, kernel_id: str, store_dir: Path, listed: list[str]
) -> None:
    assert kernel_id in await api.kernel_ids()
    assert (await ws.execute("counter += 1; print(counter)")).strip().isdigit()
    status = await api.ok("GET", "gpu-snapshot", "kernels", kernel_id, "status")
    assert status["ready"] and status["job"] is None, status
    assert [s["id"] for s in await api.snapshots()] == listed
    assert _hidden_entries(store_dir) == []
    store = SnapshotStore(store_dir)
    for snapshot_id in listed:
        store.verify(store.get(snapshot_id))


def _hidden_entries(store_dir: Path) -> list[str]:
    """Working directories (.partial-*, .deleting-*) left in the store."""
    store_dir.mkdir(exist_ok=True)
    return [p.name for p in store_dir.iterdir() if p.name.startswith(".")]


def _connection_files(runtime_dir: Any) -> list[Path]:
    return sorted(Path(runtime_dir).glob("kernel-*.json"))


@pytest.mark.parametrize("stop", [False, True], ids=["keep-running", "stop"])
async def test_criu_killed_mid_dump(
    api: Api, kernel_socket: KernelConnector, criu_path: str, store_dir: Path, stop: bool
) -> None:
    kernel_id, ws = await _kernel(api, kernel_socket)
    earlier = await api.succeeded(await api.save(kernel_id, name="earlier"))
    inject(criu_path, "kill")
    job = await api.wait(await api.save(kernel_id, name="doomed", stop=stop))
    assert job["status"] == "failed"
    error = job["error"]
    assert error["step"] == "dump" and "killed by signal 9" in error["cause"], error
    assert error["log"] and await asyncio.to_thread(os.path.exists, error["log"])
    assert job["result"] is None and job["snapshot_id"] is None
    # Even after a failed stopping save the kernel keeps its slot, and the restarter is
    # back on duty: a crash now is noticed and restarted as for any kernel.
    await assert_contract(api, ws, kernel_id, store_dir, [earlier["snapshot_id"]])


async def test_disk_fills_during_dump(
    api: Api,
    kernel_socket: KernelConnector,
    criu_path: str,
    store_dir: Path,
    filler: Path,
) -> None:
    kernel_id, ws = await _kernel(api, kernel_socket)
    earlier = await api.succeeded(await api.save(kernel_id))
    inject(criu_path, "fill")
    job = await api.wait(await api.save(kernel_id))
    assert job["status"] == "failed"
    error = job["error"]
    assert error["step"] in ("dump", "commit"), error
    assert "full" in error["message"] or "No space" in error["message"], error
    # Checking the earlier snapshot assembles its images from the store's pages, which
    # needs room: on the full disk it may fail, but never calls the snapshot damaged.
    store = SnapshotStore(store_dir)
    try:
        await asyncio.to_thread(store.verify, store.get(earlier["snapshot_id"]))
    except SnapshotError as exc:
        assert exc.hint and "free space" in exc.hint and "damaged" not in exc.message, exc
    assert _hidden_entries(store_dir) == []
    # Once there is room again, the earlier snapshot checks out whole, and saving works.
    await asyncio.to_thread(filler.unlink)
    await assert_contract(api, ws, kernel_id, store_dir, [earlier["snapshot_id"]])
    await api.succeeded(await api.save(kernel_id))


async def test_disk_too_small_is_refused_before_freezing(
    api: Api, kernel_socket: KernelConnector, store_dir: Path, filler: Path
) -> None:
    kernel_id, ws = await _kernel(api, kernel_socket)
    # Leave 100 MiB: less than the kernel's memory plus the engine's safety margin.
    free = shutil.disk_usage(filler.parent).free
    await asyncio.to_thread(
        subprocess.run, ["fallocate", "-l", str(free - (100 << 20)), str(filler)], check=True
    )
    job = await api.wait(await api.save(kernel_id))
    assert job["status"] == "failed"
    assert job["error"]["step"] == "preflight"
    assert "not enough free disk" in job["error"]["cause"]
    await assert_contract(api, ws, kernel_id, store_dir, [])


async def test_failed_restore_leaves_no_kernel_and_keeps_the_snapshot(
    caplog: pytest.LogCaptureFixture,
    api: Api,
    kernel_socket: KernelConnector,
    store_dir: Path,
    jp_runtime_dir: Any,
    jp_serverapp: Any,
) -> None:
    kernel_id, ws = await _kernel(api, kernel_socket)
    saved = await api.succeeded(await api.save(kernel_id))
    connection_files = _connection_files(jp_runtime_dir)
    # The original still holds the snapshot's ports: the restore must refuse.
    job = await api.wait(await api.restore(saved["snapshot_id"]))
    assert job["status"] == "failed" and job["error"]["step"] == "preflight"
    assert "in use" in job["error"]["cause"]
    # It names the kernel holding the ports, so that a client offers to shut down that one.
    assert job["error"]["code"] == "ports_in_use"
    assert job["error"]["details"]["holder_kernel_id"] == kernel_id
    # Refused before a kernel slot was started: no traceback in the server's log.
    assert not [r for r in caplog.records if r.exc_info and "in use" in r.getMessage()]
    assert await api.kernel_ids() == [kernel_id]
    assert _connection_files(jp_runtime_dir) == connection_files
    await assert_contract(api, ws, kernel_id, store_dir, [saved["snapshot_id"]])
    # Nothing of the failed slot is left for the server's shutdown to trip over.
    await jp_serverapp.kernel_manager.shutdown_all()
    assert jp_serverapp.kernel_manager.list_kernel_ids() == []


async def test_a_failed_adoption_kills_the_restored_tree(
    api: Api,
    kernel_socket: KernelConnector,
    store_dir: Path,
    jp_serverapp: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel_id, _ = await _kernel(api, kernel_socket)
    saved = await api.succeeded(await api.save(kernel_id, stop=True))
    app = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]))
    engine = app.parts.service.engine
    restored: list[RestoredKernel] = []
    real_restore = engine.restore

    async def restore_and_record(*args: Any, **kwargs: Any) -> RestoredKernel:
        result = await real_restore(*args, **kwargs)
        restored.append(result)
        return result

    async def refuse(self: Any, cmd: list[str], **kwargs: Any) -> Any:
        raise RuntimeError("no slot for it")

    # Its own context: undoing the fixture's monkeypatch would undo the server's environment.
    with monkeypatch.context() as patch:
        patch.setattr(engine, "restore", restore_and_record)
        patch.setattr(SnapshotReadyProvisioner, "launch_kernel", refuse)
        job = await api.wait(await api.restore(saved["snapshot_id"], path="adopt.ipynb"))
    assert job["status"] == "failed" and job["error"]["step"] == "adopt", job["error"]
    assert "no slot for it" in job["error"]["cause"]
    # criu did bring the tree back; nothing of it may outlive the failed adoption.
    assert len(restored) == 1
    assert not procfs.tree_alive(restored[0].pid)
    assert procfs.ports_in_use(restored[0].connection_info) == []
    assert await api.kernel_ids() == [] and await api.ok("GET", "api", "sessions") == []
    assert [s["id"] for s in await api.snapshots()] == [saved["snapshot_id"]]
    # The snapshot still restores once the kernel manager can take it.
    done = await api.succeeded(await api.restore(saved["snapshot_id"]))
    again = await kernel_socket(done["result"]["kernel_id"])
    assert (await again.execute("print(counter)")).strip() == "0"


async def test_damaged_snapshot_is_refused_and_named(
    api: Api, kernel_socket: KernelConnector, store_dir: Path, criu_path: str
) -> None:
    kernel_id, _ = await _kernel(api, kernel_socket)
    saved = await api.succeeded(await api.save(kernel_id, stop=True))
    await asyncio.to_thread(_damage_largest_image, store_dir / saved["snapshot_id"])
    # criu runs while the digests are checked, and is killed here: the error still names
    # the damaged file, the cause that matters.
    inject(criu_path, "kill")
    job = await api.wait(await api.restore(saved["snapshot_id"], path="damaged.ipynb"))
    assert job["status"] == "failed" and job["error"]["step"] == "verify"
    assert "does not match its" in job["error"]["cause"] and "digest" in job["error"]["cause"]
    assert await api.kernel_ids() == []
    assert await api.ok("GET", "api", "sessions") == []


def _damage_largest_image(snapshot_dir: Path) -> None:
    """One page of the largest image, in the store's pack: its recipe still matches."""
    image = stored_pages.largest_chunked(snapshot_dir)
    stored_pages.flip_page_byte(snapshot_dir.parent, snapshot_dir, image)
