"""A kernel provisioner whose kernels can be snapshotted and restored.

It launches ipykernel the way the measured facts in DESIGN.md require: in its own PID
namespace under a small init (``launch/nsinit.py``), in its own session, with no parent
polling and with stdio on /dev/null and a per-kernel log file. It can also adopt a kernel
restored from a snapshot instead of launching one, so the server's kernel manager treats
the restored process as a normal kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import psutil
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir
from jupyter_core.utils import ensure_async
from traitlets import Unicode

from .._constants import ENV_KERNEL_ID, ENV_TOKEN, ENV_URL, KERNEL_ENV_NAMES
from ..config import GPUSnapshot
from ..core import procfs
from ..core.engine import ProgressCallback, RestoredKernel, SnapshotEngine
from ..engines import make_engine
from .kernel_token import kernel_token

NSINIT = Path(__file__).with_name("nsinit.py")
# Kernel start must fail loudly, not hang, if the namespace init never shows up.
_INIT_WAIT_SECONDS = 10.0
# Keyword arguments of ``KernelManager.start_kernel`` that ask for an adoption; they must
# never reach Popen, and a restart finds them again in the manager's launch arguments.
RESTORE_KWARGS = ("restore_snapshot", "restore_engine", "restore_progress")
# How long the message telling a restored kernel its new slot waits for a reply; the
# kernel runs it after a running cell even when nobody waits any more.
_ENV_REFRESH_SECONDS = 10.0


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


async def refresh_kernel_env(km: Any, env: dict[str, str], log: Any) -> bool:
    """Update ``os.environ`` inside a running kernel with a silent execute request.

    Silent requests leave no history, no output and no execution count. A kernel busy with
    a cell runs it after the cell; we stop waiting for the reply after a few seconds.
    Returns whether the kernel confirmed; failures are logged, never raised.
    """
    try:
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    except Exception as exc:
        log.warning("could not tell the restored kernel its new environment: %s", exc)
        return False
    try:
        code = f"__import__('os').environ.update({env!r})"
        msg_id = client.execute(code, silent=True, store_history=False)
        deadline = time.monotonic() + _ENV_REFRESH_SECONDS
        while time.monotonic() < deadline:
            try:
                reply = await ensure_async(
                    client.get_shell_msg(timeout=max(0.0, deadline - time.monotonic()))
                )
            except Exception:  # queue.Empty on timeout: the kernel is busy with a cell
                break
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return bool(reply["content"].get("status") == "ok")
        log.info("the restored kernel has not yet taken its new environment (it is busy)")
        return False
    finally:
        client.stop_channels()


class AdoptedProcess:
    """Popen-like handle on a restored kernel tree, which is not our child."""

    # No pipes: LocalProvisioner.wait() closes these when they are set.
    stdin = stdout = stderr = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not procfs.tree_alive(self.pid):
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


class SnapshotReadyProvisioner(LocalProvisioner):
    """Launches snapshot-ready kernels; adopts restored ones.

    ``KernelManager.start_kernel(restore_snapshot=ID)`` makes the next launch an adoption:
    the manager takes the snapshot's connection info (ports and HMAC key, which the restored
    process still listens with) and ``launch_kernel`` runs the engine's restore instead of
    starting a process. ``restore_engine`` (a ``SnapshotEngine``) and ``restore_progress``
    (a progress callback) may come with it; the server extension passes its own. A later
    restart of that kernel launches a fresh kernel in the same slot.
    """

    log_dir = Unicode(
        "",
        config=True,
        help="Directory for the per-kernel stdout/stderr logs (default: the Jupyter runtime dir).",
    )

    server_url = Unicode(
        "",
        config=True,
        help="""URL of the Jupyter server (base_url included) that snapshot-ready kernels call
        for %gpu_snapshot; given to them as $JUPYTER_GPU_SNAPSHOT_URL. The jupyter_gpu_snapshot
        server extension sets it when it loads; empty means the kernel gets none.""",
    )

    server_token = Unicode(
        "",
        config=True,
        help="""Token the kernel authenticates to the server with ($JUPYTER_GPU_SNAPSHOT_TOKEN).
        Set by the server extension when it loads, like server_url.""",
    )

    kernel_token_secret = Unicode(
        "",
        config=True,
        help="""Secret (hex) from which each kernel's own credential is derived
        (launch/kernel_token.py); it never enters a kernel. Set by the server extension when
        it loads. When set, kernels get that credential instead of server_token.""",
    )

    root_pid: int | None = None
    log_path: Path | None = None
    restored: RestoredKernel | None = None
    _pending_restore: str | None = None
    _restore_engine: SnapshotEngine | None = None
    _restore_progress: ProgressCallback | None = None
    _restore_used = False
    _env_refresh: asyncio.Future[bool] | None = None

    def _settings(self) -> GPUSnapshot:
        return GPUSnapshot(parent=self)

    def server_env(self) -> dict[str, str]:
        """The variables that tell a kernel which server and kernel slot it belongs to."""
        if not self.server_url:
            return {}
        token = self.server_token
        if self.kernel_token_secret:
            token = kernel_token(self.kernel_token_secret, str(self.kernel_id))
        return {
            ENV_URL: self.server_url,
            ENV_TOKEN: token,
            ENV_KERNEL_ID: str(self.kernel_id),
        }

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Called by ``KernelManager.pre_start_kernel()`` before every (re)start."""
        snapshot_ref, engine, progress = (kwargs.pop(key, None) for key in RESTORE_KWARGS)
        # A restart after a restore starts a fresh kernel, not the snapshot again.
        if snapshot_ref and not self._restore_used:
            engine = engine or make_engine(self._settings())
            snapshot = engine.get(snapshot_ref)
            km = self.parent
            if km is not None:
                # The restored kernel listens on its original ports with its original key.
                km.load_connection_info(snapshot.connection_info)
                km.cache_ports = False
            self._pending_restore = snapshot.id
            self._restore_engine = engine
            self._restore_progress = progress
        kwargs = await super().pre_launch(**kwargs)
        env = dict(kwargs.get("env") or os.environ)
        env.pop("JPY_PARENT_PID", None)
        # Values inherited from a server that itself runs inside a kernel would be wrong.
        for key in KERNEL_ENV_NAMES:
            env.pop(key, None)
        env.update(self.server_env())
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
        assert self.process is not None
        self.root_pid = await asyncio.to_thread(wait_for_namespace_init, self.process.pid)
        return info

    async def _adopt(self, snapshot_id: str) -> KernelConnectionInfo:
        engine = self._restore_engine or make_engine(self._settings())
        progress = self._restore_progress
        self._pending_restore = self._restore_engine = self._restore_progress = None
        self._restore_used = True
        try:
            self.restored = await engine.restore(snapshot_id, progress)
        except BaseException:
            # The slot never comes to life: its connection file (with the key) must go.
            km = self.parent
            if km is not None:
                with contextlib.suppress(OSError):
                    km.cleanup_connection_file()
            raise
        self.root_pid = self.restored.pid
        # LocalProvisioner only polls, waits for and signals its process: duck typing works.
        self.process = cast("subprocess.Popen[bytes]", AdoptedProcess(self.restored.pid))
        self.pid = self.restored.pid
        self.pgid = None
        return self.connection_info

    async def post_launch(self, **kwargs: Any) -> None:
        """Called by ``KernelManager.post_start_kernel()`` once the kernel runs.

        A restored kernel's environment still names the slot and server it was saved
        from; tell it the new ones, so %gpu_snapshot inside it addresses this slot. It is
        not awaited: a kernel restored in the middle of a cell answers after that cell.
        """
        await super().post_launch(**kwargs)
        if self.restored is not None and self.server_url and self.parent is not None:
            self._env_refresh = asyncio.ensure_future(
                refresh_kernel_env(self.parent, self.server_env(), self.log)
            )

    async def send_signal(self, signum: int) -> None:
        """Called by ``KernelManager.signal_kernel()``; nsinit forwards it to the kernel."""
        if self.root_pid is None:
            return await super().send_signal(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.root_pid, signum)

    async def kill(self, restart: bool = False) -> None:
        """Called by ``KernelManager._kill_kernel()``: killing the init ends the namespace."""
        if self.root_pid is not None:
            await asyncio.to_thread(procfs.kill_tree, self.root_pid)
        await super().kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        """Called by ``KernelManager.finish_shutdown()`` when a graceful shutdown timed out."""
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Called by ``KernelManager.cleanup_resources()``; nothing may outlive the kernel."""
        if self._env_refresh is not None:
            self._env_refresh.cancel()
            self._env_refresh = None
        if self.root_pid is not None and procfs.tree_alive(self.root_pid):
            await asyncio.to_thread(procfs.kill_tree, self.root_pid)
        self.root_pid = None
        await super().cleanup(restart)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["root_pid"] = self.root_pid
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.root_pid = provisioner_info.get("root_pid")
