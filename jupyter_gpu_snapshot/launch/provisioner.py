"""A kernel provisioner whose kernels can be snapshotted and restored.

It launches ipykernel the way a restore needs it (docs/architecture.md, "Launching
kernels"): in its own PID namespace under a small init (``launch/nsinit.py``), in its own
session, with no parent polling and with stdio on /dev/null and a per-kernel log file, and
with JAX's and TensorFlow's GPU allocators growing rather than preallocating
(``c.GPUSnapshot.grow_gpu_allocators``), so that images hold what is live. It can also
adopt a kernel tree that the engine has already restored, so the server's kernel manager
treats the restored process as a normal kernel. It receives plain data for that (an
``Adoption``), never the engine.
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
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import psutil
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir
from traitlets import TraitError, Unicode

from .._constants import (
    ENV_KERNEL_ID,
    ENV_TOKEN,
    ENV_URL,
    GROWING_ALLOCATOR_ENV,
    KERNEL_ENV_NAMES,
    TIMELINE_ENV,
)
from ..agent_client.client import AgentClient
from ..config import GPUSnapshot
from ..core import procfs
from ..core.kernel_log import log_size
from .kernel_token import new_kernel_token, same_token

NSINIT = Path(__file__).with_name("nsinit.py")
# Kernel start must fail loudly, not hang, if the namespace init never shows up.
_INIT_WAIT_SECONDS = 10.0
# The keyword argument of ``KernelManager.start_kernel`` that asks for an adoption; it must
# never reach Popen, and a restart finds it again in the manager's launch arguments.
ADOPT_KWARG = "adopt"


# What a server does once one of its kernels has a running tree (``on_kernel_tree``).
TreeListener = Callable[["SnapshotReadyProvisioner"], Awaitable[None]]
# By the server's kernel manager (the MultiKernelManager each kernel's manager is a child
# of), so that two servers in one process never hear of each other's kernels.
_TREE_LISTENERS: weakref.WeakKeyDictionary[Any, TreeListener] = weakref.WeakKeyDictionary()


def on_kernel_tree(kernel_manager: Any, listener: TreeListener | None) -> None:
    """Have ``listener`` awaited whenever a kernel of ``kernel_manager`` gets a running tree
    (launched, restarted, adopted, woken), before that launch or wake returns, so before
    anyone learns of it; None removes it. The server extension records its kernels there
    (``server/adoption.py``)."""
    if listener is None:
        _TREE_LISTENERS.pop(kernel_manager, None)
    else:
        _TREE_LISTENERS[kernel_manager] = listener


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


def wait_for_namespace_init(launcher_pid: int, timeout: float = _INIT_WAIT_SECONDS,
                            script: str = str(NSINIT)) -> int:
    """Host pid of the init that ``unshare --fork`` started, once it runs nsinit (the
    ``script``; below the launcher, as in a container the node agent entered)."""
    deadline = time.monotonic() + timeout
    launcher = psutil.Process(launcher_pid)
    while time.monotonic() < deadline:
        try:
            children = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            break  # the launcher itself ended: no init will come
        for child in children:
            # A child that ended since it was listed (unshare's own fork before it execs
            # nsinit, say) is no reason to give up on the others.
            with contextlib.suppress(psutil.NoSuchProcess):
                if script in child.cmdline():
                    return int(child.pid)
        time.sleep(0.01)
    raise RuntimeError(
        "the snapshot-ready kernel did not start its PID namespace "
        "(unshare --pid needs root or CAP_SYS_ADMIN); see the kernel log"
    )


def root_pid(km: Any) -> int | None:
    """The pid CRIU dumps of a kernel manager's kernel: our namespace init, else the kernel."""
    provisioner = getattr(km, "provisioner", None)
    if provisioner is None or not provisioner.has_process:
        return None
    root = getattr(provisioner, "root_pid", None) or getattr(provisioner, "pid", None)
    return int(root) if root else None


@dataclass(frozen=True)
class Adoption:
    """A running kernel tree for the kernel manager to adopt: one the engine just restored,
    or one a server killed earlier left running (then ``snapshot_id`` is None)."""

    pid: int  # host pid of the tree's root (the namespace init)
    connection_info: dict[str, Any]  # ports and HMAC key the kernel listens with
    snapshot_id: str | None
    # The credential the restored tree holds in its memory: the one of the kernel it was
    # saved from, when this server made it. Accepted as the adopting kernel's until the
    # server has told the tree its own (``SnapshotReadyProvisioner.inherited_credential``).
    credential: str | None = None


class AdoptedProcess:
    """Popen-like handle on a restored kernel tree, which is not our child: held as the
    process it was when adopted, so that its pid, once taken by another, is not it."""

    # No pipes: LocalProvisioner.wait() closes these when they are set.
    stdin = stdout = stderr = None

    def __init__(self, pid: int, root: psutil.Process | None) -> None:
        self.pid = pid
        self.root = root
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and (self.root is None or not procfs.tree_alive(self.root)):
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
        try:
            if self.root is None:
                raise psutil.NoSuchProcess(self.pid)
            self.root.send_signal(signum)
        except psutil.NoSuchProcess as gone:  # as os.kill says it, for Popen's callers
            raise ProcessLookupError(signum, f"process {self.pid} has ended") from gone

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class HibernatedProcess:
    """Popen-like stand-in for a hibernated kernel: its tree ended after a snapshot, and
    the kernel manager must go on seeing a live kernel (the restarter would otherwise start
    a blank one, and the server would drop the slot). Signals other than the ones that end
    a kernel reach nobody; those end the stand-in, so a shutdown completes at once."""

    stdin = stdout = stderr = None
    pid = None

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            raise subprocess.TimeoutExpired("hibernated kernel", timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGKILL):
            self.returncode = -signum

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _mark_activity_from_start(km: Any) -> None:
    """Give a kernel jupyter_server's ``last_activity`` from its start on.

    jupyter_server lists a kernel as soon as jupyter_client has added it, and marks its
    activity only one event-loop step later. A listing in between (``/api/kernels``,
    ``/api/status``) fails with a 500 on the unset trait. A busy machine, and the kernels a
    server adopts while its first requests arrive, make that step likely. The server
    overwrites the mark right after.
    """
    if km is None or not km.has_trait("last_activity"):
        return
    try:
        km.last_activity  # noqa: B018  # reading an unset Instance trait raises
    except TraitError:
        km.last_activity = datetime.now(timezone.utc)


class SnapshotReadyProvisioner(LocalProvisioner):
    """Launches snapshot-ready kernels; adopts restored ones.

    ``KernelManager.start_kernel(adopt=Adoption(...))`` makes the next launch an adoption:
    the manager takes the restored kernel's connection info (ports and HMAC key, which the
    restored process still listens with) and ``launch_kernel`` takes the running tree as its
    process instead of starting one. The caller has restored (and verified) the snapshot
    before. A later restart of that kernel launches a fresh kernel in the same slot.
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
        help="""Secret (hex) from which each launch of a kernel derives its own credential
        (launch/kernel_token.py); it never enters a kernel. Set by the server extension when
        it loads. When set, kernels get that credential instead of server_token.""",
    )

    # This launch's own credential, given to the kernel as $JUPYTER_GPU_SNAPSHOT_TOKEN (with
    # kernel_token_secret); None once the launch's tree has ended. The server accepts a
    # kernel's credential only while its provisioner holds it (server/kernel_credentials.py).
    kernel_credential: str | None = None
    # A restored tree's credential from the kernel it was saved from (``Adoption``), until
    # the server has told the tree this kernel's own: a copy restored in the middle of a
    # cell calls the server with it until that cell ends.
    inherited_credential: str | None = None

    root_pid: int | None = None
    # The root as the process it was when it started: what signals and kills reach.
    _root: psutil.Process | None = None
    # The log the running tree writes, and its size when this kernel began: what nsinit
    # writes there after that says how this kernel ended (core/kernel_log.py).
    log_path: Path | None = None
    log_start: int = 0
    adopted_snapshot: str | None = None
    _pending_adoption: Adoption | None = None
    _adoption_used = False
    # The node agent, when this server launches through it (not root).
    _agent: AgentClient | None = None

    def server_env(self) -> dict[str, str]:
        """The variables that tell a kernel which server and kernel slot it belongs to."""
        if not self.server_url:
            return {}
        token = self.server_token
        if self.kernel_token_secret:
            token = self.kernel_credential or ""
        return {
            ENV_URL: self.server_url,
            ENV_TOKEN: token,
            ENV_KERNEL_ID: str(self.kernel_id),
        }

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Called by ``KernelManager.pre_start_kernel()`` before every (re)start."""
        _mark_activity_from_start(self.parent)
        adoption = kwargs.pop(ADOPT_KWARG, None)
        # A restart after an adoption starts a fresh kernel, not the old tree again.
        if isinstance(adoption, Adoption) and not self._adoption_used:
            km = self.parent
            if km is not None:
                # The restored kernel listens on its original ports with its original key.
                km.load_connection_info(adoption.connection_info)
                km.cache_ports = False
            self._pending_adoption = adoption
        kwargs = await super().pre_launch(**kwargs)
        # Every launch, restarts included, gets a credential of its own: the one before
        # dies with the tree that held it.
        self.inherited_credential = None
        self.kernel_credential = (
            new_kernel_token(self.kernel_token_secret, str(self.kernel_id))
            if self.kernel_token_secret else None
        )
        env = dict(kwargs.get("env") or os.environ)
        env.pop("JPY_PARENT_PID", None)
        # Values inherited from a server that itself runs inside a kernel would be wrong.
        for key in KERNEL_ENV_NAMES:
            env.pop(key, None)
        env.update(self.server_env())
        # Added here rather than in the kernelspec's env: jupyter_client lets a kernelspec's
        # env override the server's environment, which would lose a value the user set there,
        # and an installed kernelspec is a file that c.GPUSnapshot cannot switch. The env
        # already holds the server's environment (or the env the kernel is started with)
        # and the kernelspec's, so setdefault leaves every value the user chose.
        settings = GPUSnapshot(parent=self)
        if settings.timeline:
            env.setdefault(TIMELINE_ENV, "on")
        if settings.grow_gpu_allocators:
            for key, value in GROWING_ALLOCATOR_ENV.items():
                env.setdefault(key, value)
        kwargs["env"] = env
        self._agent = AgentClient(settings.agent_socket) if settings.through_agent() else None
        if self._agent is not None:
            # The node agent starts the tree (unshare needs root) and names its log.
            return kwargs
        log_dir = Path(self.log_dir) if self.log_dir else kernel_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = log_dir / f"kernel-{self.kernel_id}.log"
        kwargs["cmd"] = namespaced_command(kwargs["cmd"], self.log_path)
        kwargs["independent"] = True
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Called by ``KernelManager._launch_kernel()`` with the command from ``pre_launch``."""
        if self._pending_adoption is not None:
            adoption = self._pending_adoption
            await self._take_log_of(adoption)
            info = self._adopt(adoption)
        elif self._agent is not None:
            info = await self._launch_through_agent(self._agent, cmd, kwargs)
        else:
            assert self.log_path is not None
            log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                self.log_start = os.fstat(log_fd).st_size
                kwargs.update(stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd)
                info = await super().launch_kernel(cmd, **kwargs)
            finally:
                os.close(log_fd)
            assert self.process is not None
            self.root_pid = await asyncio.to_thread(wait_for_namespace_init, self.process.pid)
            self._root = procfs.held(self.root_pid)
        await self._tree_runs()
        return info

    async def _tree_runs(self) -> None:
        """Tell the server's listener (``on_kernel_tree``) that this kernel's tree runs."""
        server_manager = getattr(self.parent, "parent", None)
        # A kernel manager of its own (jupyter_client used directly) has no server's.
        listener = None if server_manager is None else _TREE_LISTENERS.get(server_manager)
        if listener is None:
            return
        try:
            await listener(self)
        except Exception as exc:  # the kernel runs all the same
            self.log.warning("gpu-snapshot: kernel %s: %s", self.kernel_id, exc)

    async def _launch_through_agent(
        self, agent: AgentClient, cmd: list[str], kwargs: dict[str, Any]
    ) -> KernelConnectionInfo:
        """Have the node agent start the kernel's tree as this user; the tree is no child
        of ours, so it is held as a restored one is."""
        started = await agent.call("launch", {
            "argv": cmd, "env": dict(kwargs.get("env") or {}),
            "cwd": str(kwargs.get("cwd") or os.getcwd()), "kernel_id": str(self.kernel_id),
            # For an agent that starts the tree in this container: what runs it there.
            "nsinit": [sys.executable, str(NSINIT)],
        })
        self.log_path = Path(started["log_path"])
        self.log_start = await asyncio.to_thread(log_size, self.log_path)
        self._hold_tree(int(started["pid"]))
        return self.connection_info

    def _hold_tree(self, pid: int) -> None:
        """A tree that is not our child becomes this kernel's process."""
        self.root_pid = pid
        self._root = procfs.held(pid)
        # LocalProvisioner only polls, waits for and signals its process: duck typing works.
        self.process = cast("subprocess.Popen[bytes]", AdoptedProcess(pid, self._root))
        self.pid = pid
        self.pgid = None

    async def _take_log_of(self, adoption: Adoption) -> None:
        """Follow the log a restored tree writes: the one of the kernel it was saved from,
        not this slot's; nsinit's stderr says which."""
        found = await asyncio.to_thread(procfs.stderr_file, adoption.pid)
        if found is not None:
            self.log_path = Path(found)
        assert self.log_path is not None
        self.log_start = await asyncio.to_thread(log_size, self.log_path)

    # -- hibernation -----------------------------------------------------------------------
    @property
    def hibernated(self) -> bool:
        return isinstance(self.process, HibernatedProcess)

    async def hibernate(self) -> None:
        """The kernel's tree ended after its hibernation snapshot: keep the slot alive.

        The launcher (``unshare``, our child) exits with the tree; it is reaped here, since
        nobody polls it once the stand-in replaces it.
        """
        ended = None if self.hibernated else self.process
        if ended is not None:
            try:
                await asyncio.to_thread(ended.wait, _INIT_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                ended.kill()
                await asyncio.to_thread(ended.wait)
        self.process = cast("subprocess.Popen[bytes]", HibernatedProcess())
        self.root_pid = self._root = None
        self.pid = None
        self.pgid = None

    async def wake(self, adoption: Adoption) -> None:
        """The kernel's restored tree takes the slot back, with the slot's connection info
        (a hibernated kernel is restored from a snapshot of this very slot)."""
        await self._take_log_of(adoption)
        self._adopt(adoption)
        await self._tree_runs()

    async def shutdown_requested(self, restart: bool = False) -> None:
        """Called by ``KernelManager.request_shutdown()``: a hibernated kernel has no process
        to ask, so its shutdown completes now rather than after the manager's wait."""
        if self.hibernated:
            assert self.process is not None
            self.process.kill()
        await super().shutdown_requested(restart)

    def _adopt(self, adoption: Adoption) -> KernelConnectionInfo:
        self._pending_adoption = None
        self._adoption_used = True
        self.adopted_snapshot = adoption.snapshot_id
        self.inherited_credential = adoption.credential
        self._hold_tree(adoption.pid)
        return self.connection_info

    # -- the kernel's credential -----------------------------------------------------------
    def holds_credential(self, token: str) -> bool:
        """Whether ``token`` is the credential of this kernel's running tree."""
        return same_token(self.kernel_credential, token) or same_token(
            self.inherited_credential, token)

    def told_own_credential(self) -> None:
        """The server has told the restored tree this kernel's own credential."""
        self.inherited_credential = None

    def _revoke_credentials(self) -> None:
        self.kernel_credential = self.inherited_credential = None

    async def poll(self) -> int | None:
        """Called by the restarter (``KernelManager.is_alive``): a tree found ended takes
        its credential with it, whether a restart follows or not."""
        ended: int | None = await super().poll()
        if ended is not None and self.process is not None:
            self._revoke_credentials()
        return ended

    async def send_signal(self, signum: int) -> None:
        """Called by ``KernelManager.signal_kernel()``; nsinit forwards it to the kernel."""
        if self._root is None:
            return await super().send_signal(signum)
        with contextlib.suppress(psutil.NoSuchProcess):
            self._root.send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        """Called by ``KernelManager._kill_kernel()``: killing the init ends the namespace."""
        if self._root is not None:
            await asyncio.to_thread(procfs.kill_tree, self._root)
        await super().kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        """Called by ``KernelManager.finish_shutdown()`` when a graceful shutdown timed out."""
        await self.send_signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """Called by ``KernelManager.cleanup_resources()``; nothing may outlive the kernel,
        its credential neither."""
        self._revoke_credentials()
        if self._root is not None and procfs.tree_alive(self._root):
            await asyncio.to_thread(procfs.kill_tree, self._root)
        self.root_pid = self._root = None
        await super().cleanup(restart)

    @property
    def root(self) -> psutil.Process | None:
        """The tree's root as the process it was when it started; None without a tree."""
        return self._root

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["root_pid"] = self.root_pid
        info["root_started"] = None if self._root is None else self._root.create_time()
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.root_pid = provisioner_info.get("root_pid")
        started = provisioner_info.get("root_started")
        # The root only while its pid is still the process that was saved as it.
        same = self.root_pid is not None and procfs.same_process(self.root_pid, started)
        self._root = procfs.held(self.root_pid) if same and self.root_pid else None
