"""A kernel provisioner whose kernels can be snapshotted and restored.

It launches ipykernel the way the measured facts in DESIGN.md require: in its own PID
namespace under a small init (``core/nsinit.py``), in its own session, with no parent
polling and with stdio on /dev/null and a per-kernel log file. It can also adopt a kernel
restored from a snapshot instead of launching one, so the server's kernel manager treats
the restored process as a normal kernel.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir
from traitlets import Unicode

from .config import GPUSnapshot
from .core import process
from .core.engine import RestoredKernel

NSINIT = Path(__file__).parent / "core" / "nsinit.py"
PROVISIONER_NAME = "gpu-snapshot-provisioner"
# Kernel start must fail loudly, not hang, if the namespace init never shows up.
_INIT_WAIT_SECONDS = 10.0


def kernel_log_dir() -> Path:
    path = Path(jupyter_runtime_dir()) / "gpu_snapshot"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def namespaced_command(cmd: list[str], log_path: Path) -> list[str]:
    """Wrap a kernel command so it runs under ``nsinit`` as PID 1 of a new PID namespace."""
    unshare = shutil.which("unshare") or "unshare"
    return [
        unshare, "--pid", "--fork", "--",
        sys.executable, "-I", "-S", str(NSINIT), "--log", str(log_path), "--", *cmd,
    ]


def wait_for_namespace_init(launcher_pid: int, timeout: float = _INIT_WAIT_SECONDS) -> int:
    """Host pid of the init that ``unshare --fork`` started, once it runs nsinit."""
    deadline = time.monotonic() + timeout
    launcher = psutil.Process(launcher_pid)
    while time.monotonic() < deadline:
        try:
            for child in launcher.children():
                if str(NSINIT) in child.cmdline():
                    return int(child.pid)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    raise RuntimeError(
        "the snapshot-ready kernel did not start its PID namespace "
        "(unshare --pid needs root or CAP_SYS_ADMIN); see the kernel log"
    )


class AdoptedProcess:
    """Popen-like handle on a restored kernel tree, which is not our child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not process.tree_alive(self.pid):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.05)
        return self.returncode or 0

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class SnapshotReadyProvisioner(LocalProvisioner):  # type: ignore[misc]
    """Launches snapshot-ready kernels; adopts restored ones (``restore_snapshot=ID``)."""

    log_dir = Unicode(
        "",
        config=True,
        help="Directory for the per-kernel stdout/stderr logs (default: the Jupyter runtime dir).",
    )

    root_pid: int | None = None
    log_path: Path | None = None
    restored: RestoredKernel | None = None
    _pending_restore: str | None = None
    _restore_used = False

    def _settings(self) -> GPUSnapshot:
        return GPUSnapshot(parent=self)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Called by ``KernelManager.pre_start_kernel()`` before every (re)start."""
        snapshot_ref = kwargs.pop("restore_snapshot", None)
        # A restart after a restore starts a fresh kernel, not the snapshot again.
        if snapshot_ref and not self._restore_used:
            snapshot = self._settings().make_engine().get(snapshot_ref)
            km = self.parent
            if km is not None:
                # The restored kernel listens on its original ports with its original key.
                km.load_connection_info(snapshot.connection_info)
                km.cache_ports = False
            self._pending_restore = snapshot.id
        kwargs = await super().pre_launch(**kwargs)
        env = dict(kwargs.get("env") or os.environ)
        env.pop("JPY_PARENT_PID", None)
        kwargs["env"] = env
        log_dir = Path(self.log_dir) if self.log_dir else kernel_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = log_dir / f"kernel-{self.kernel_id}.log"
        kwargs["cmd"] = namespaced_command(kwargs["cmd"], self.log_path)
        kwargs["independent"] = True
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Called by ``KernelManager._launch_kernel()`` with the command from ``pre_launch``."""
        if self._pending_restore is not None:
            return await self._adopt(self._pending_restore)
        assert self.log_path is not None
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            kwargs.update(stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd)
            info = await super().launch_kernel(cmd, **kwargs)
        finally:
            os.close(log_fd)
        self.root_pid = await asyncio.to_thread(wait_for_namespace_init, self.process.pid)
        return info  # type: ignore[no-any-return]

    async def _adopt(self, snapshot_id: str) -> KernelConnectionInfo:
        self._pending_restore = None
        self._restore_used = True
        engine = self._settings().make_engine()
        self.restored = await engine.restore(snapshot_id)
        self.root_pid = self.restored.pid
        self.process = AdoptedProcess(self.restored.pid)
        self.pid = self.restored.pid
        self.pgid = None
        return self.connection_info  # type: ignore[no-any-return]

    async def send_signal(self, signum: int) -> None:
        """Called by ``KernelManager.signal_kernel()``; nsinit forwards it to the kernel."""
        if self.root_pid is None:
            return await super().send_signal(signum)  # type: ignore[no-any-return]
        try:
            os.kill(self.root_pid, signum)
        except ProcessLookupError:
            pass

    async def kill(self, restart: bool = False) -> None:
        """Called by ``KernelManager._kill_kernel()``: killing the init ends the namespace."""
        if self.root_pid is not None:
            await asyncio.to_thread(process.kill_tree, self.root_pid)
        await super().kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        """Called by ``KernelManager.finish_shutdown()`` when a graceful shutdown timed out."""
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Called by ``KernelManager.cleanup_resources()``; nothing may outlive the kernel."""
        if self.root_pid is not None and process.tree_alive(self.root_pid):
            await asyncio.to_thread(process.kill_tree, self.root_pid)
        self.root_pid = None
        await super().cleanup(restart)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["root_pid"] = self.root_pid
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.root_pid = provisioner_info.get("root_pid")
