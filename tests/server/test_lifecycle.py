"""Kernel lifecycle around snapshots: the restarter, retention, restarting a restored
kernel, and the shutdown hook of an in-process server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.core.store.snapshot import new_snapshot_id
from tests.core.store.test_store import CONNECTION

from .conftest import Api, KernelConnector


class TestStoppingSave:
    @pytest.fixture
    def server_config(self) -> dict[str, Any]:
        # The restarter looks every 50 ms: it would notice the dead kernel during commit.
        return {"KernelRestarter": {"time_to_dead": 0.05}}

    async def test_restarter_does_not_revive_a_stopped_kernel(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        kernel_id = await api.start_kernel()
        ws = await kernel_socket(kernel_id)
        # Enough memory that the checksums after the dump take a while.
        await ws.execute("blob = b'z' * (150 << 20); marker = 'stopped'")
        km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        root = km.provisioner.root_pid
        fired: list[str] = []
        km.add_restart_callback(lambda: fired.append("restart"), "restart")
        km.add_restart_callback(lambda: fired.append("dead"), "dead")

        job = await api.succeeded(await api.save(kernel_id, stop=True))
        await asyncio.sleep(0.3)  # several restarter periods
        assert fired == []
        assert kernel_id not in await api.kernel_ids()
        assert not procfs.tree_alive(root)

        restored = await api.succeeded(await api.restore(job["snapshot_id"]))
        ws = await kernel_socket(restored["result"]["kernel_id"])
        assert (await ws.execute("print(marker)")).strip() == "stopped"


class TestRetention:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        return {"keep_last": 2}

    async def test_keeps_the_newest_per_notebook(self, api: Api) -> None:
        sessions = {}
        for path in ("a.ipynb", "b.ipynb"):
            sessions[path] = await api.open_notebook(path)
        a, b = (sessions[p]["kernel"]["id"] for p in ("a.ipynb", "b.ipynb"))
        only_b = (await api.succeeded(await api.save(b)))["snapshot_id"]
        made = [(await api.succeeded(await api.save(a)))["snapshot_id"] for _ in range(3)]
        assert [s["id"] for s in await api.snapshots(notebook_path="a.ipynb")] == made[1:]
        # Another notebook's snapshots do not count against it.
        assert [s["id"] for s in await api.snapshots(notebook_path="b.ipynb")] == [only_b]


async def test_restarting_a_restored_kernel_starts_a_fresh_one(
    api: Api, kernel_socket: KernelConnector
) -> None:
    kernel_id = await api.start_kernel()
    ws = await kernel_socket(kernel_id)
    await ws.execute("kept = 'yes'")
    new_id = await api.saved_and_restored(kernel_id)
    ws = await kernel_socket(new_id)
    assert (await ws.execute("print(kept)")).strip() == "yes"

    # Interrupt reaches it like any kernel.
    await api.ok("POST", "api", "kernels", new_id, "interrupt", expect=204)
    await api.ok("POST", "api", "kernels", new_id, "restart")
    ws = await kernel_socket(new_id)
    assert "NameError" in await ws.execute(
        "try:\n    kept\nexcept NameError as e:\n    print('NameError')"
    )
    # The fresh kernel is snapshot-ready as well.
    status = await api.ok("GET", "gpu-snapshot", "kernels", new_id, "status")
    assert status["ready"], status["reasons"]
    await api.ok("DELETE", "api", "kernels", new_id, expect=204)
    assert new_id not in await api.kernel_ids()


class TestShutdownHook:
    @pytest.fixture
    def snapshot_config(self) -> dict[str, Any]:
        return {"snapshot_on_shutdown": True, "shutdown_budget": 60.0}

    async def test_stopping_the_server_saves_ready_kernels_only(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        ready = await api.open_notebook("keep.ipynb")
        ready_id = ready["kernel"]["id"]
        plain_id = await api.start_kernel("python3")
        ws = await kernel_socket(ready_id)
        await ws.execute("state = 'saved on shutdown'")
        root = jp_serverapp.kernel_manager.get_kernel(ready_id).provisioner.root_pid

        # What ServerApp._cleanup() does first, before it shuts the kernels down.
        await jp_serverapp.extension_manager.stop_all_extensions()
        app = jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]
        report = next(iter(app)).last_shutdown
        assert list(report.saved) == [ready_id]
        assert plain_id in report.skipped and report.failed == {}
        assert not procfs.tree_alive(root)

        listed = await api.snapshots(notebook_path="keep.ipynb")
        assert [s["id"] for s in listed] == [report.saved[ready_id]]
        assert listed[0]["reason"] == "shutdown"


class TestStartup:
    @pytest.fixture
    def store_dir(self, tmp_path: Any) -> Any:
        # What a server that died mid-save leaves: a working directory whose owner is gone,
        # next to a committed snapshot that must survive.
        store = SnapshotStore(tmp_path / "snapshots")
        partial = store.begin(new_snapshot_id())
        (partial / "pages-1.img").write_bytes(b"a whole dump")
        kernel = {"name": "python3-snapshot", "connection_info": CONNECTION, "log_files": []}
        kept = store.commit(partial, {"id": partial.name.split("-", 1)[1], "name": "kept",
                                      "created": 1.0, "kernel": kernel})
        stale = store.root / ".partial-20260101T000000Z-0badc0de"
        stale.mkdir()
        (stale / ".owner").write_text("999999999")
        (stale / "pages-1.img").write_bytes(b"half a dump")
        (store.root / ".deleting-20250101T000000Z-00000000").mkdir()
        self.kept = kept.id
        return store.root

    async def test_stale_working_directories_are_removed_at_start(
        self, api: Api, store_dir: Any
    ) -> None:
        assert sorted(p.name for p in store_dir.iterdir()) == [self.kept]
        assert [s["id"] for s in await api.snapshots()] == [self.kept]


def test_installing_the_package_enables_the_extension() -> None:
    # The data file that pip installs from jupyter-config/ (see pyproject.toml).
    import subprocess
    import sys

    listing = subprocess.run(
        [sys.executable, "-m", "jupyter_server", "extension", "list"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    text = listing.stdout + listing.stderr
    assert "jupyter_gpu_snapshot \x1b[32menabled" in text or "jupyter_gpu_snapshot enabled" in text
    assert "jupyter_gpu_snapshot 0" in text and "OK" in text


class TestConfigFile:
    @pytest.fixture
    def server_config(self, jp_config_dir: Any) -> dict[str, Any]:
        (jp_config_dir / "jupyter_gpu_snapshot_config.py").write_text(
            "c.GPUSnapshot.keep_last = 7\nc.GPUSnapshot.shutdown_budget = 12.5\n"
        )
        return {}

    async def test_settings_come_from_the_extensions_config_file(self, jp_serverapp: Any):
        app = next(iter(jp_serverapp.extension_manager.extension_apps["jupyter_gpu_snapshot"]))
        assert app.parts.settings.keep_last == 7
        assert app.parts.settings.shutdown_budget == 12.5


class TestKernelFacingSettings:
    @pytest.fixture
    def server_config(self) -> dict[str, Any]:
        return {"SnapshotReadyProvisioner": {"server_url": "http://proxy.local:9999/jupyter/"}}

    async def test_a_configured_url_wins_over_the_computed_one(
        self, api: Api, kernel_socket: KernelConnector, jp_serverapp: Any
    ) -> None:
        kernel_id = await api.start_kernel()
        ws = await kernel_socket(kernel_id)
        env = await ws.execute(
            "import os; print(os.environ['JUPYTER_GPU_SNAPSHOT_URL'], "
            "os.environ['JUPYTER_GPU_SNAPSHOT_TOKEN'])"
        )
        url, token = env.split()
        assert url == "http://proxy.local:9999/jupyter/"
        # The kernel's own credential, never the server's token.
        assert token.startswith(f"gpusnap-kernel.{kernel_id}.")
        assert jp_serverapp.identity_provider.token not in token
