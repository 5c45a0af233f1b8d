"""The engine's end of CRIU's CUDA plugin: it answers the ``cuda-checkpoint`` stand-in.

The driver's checkpoint protocol (NVIDIA's README, and CRIU's ``plugins/cuda``) is:
lock while the process runs; checkpoint only once CRIU has seized every thread, with the
driver's restore thread alone woken; restore and unlock before CRIU lets the threads run
again. Frameworks whose threads keep calling into CUDA (JAX, XLA) crash if they run while
their state is checkpointed, and the whole process must not be stopped either, since the
driver does the work on a thread inside it. Only CRIU, which holds every thread under
ptrace, can wake that one thread at the right moments, so the plugin sequences the calls.

The plugin runs ``cuda-checkpoint`` for each call; our stand-in
(``cuda_checkpoint_shim.c``) forwards the arguments over a Unix socket to a
``CheckpointBroker`` in the engine's process, which makes the call with the driver it has
loaded (a millisecond or two, where NVIDIA's binary initialises CUDA for seconds inside the
pause). So the engine keeps what the in-process API gives: its lock timeout, per-step
timings, GPU remap pairs at restore, its own error messages, and at restore a gate that
holds every task until the images' digests have matched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .._constants import ENV_CUDA_BROKER
from ..core import procfs
from ..core.criu import PidView
from ..core.criu_build import read_note
from ..core.errors import SnapshotError
from .driver import CUDA_ERROR_ILLEGAL_STATE, CheckpointDriver, DriverCallError, ProcessState

T = TypeVar("T")

_EXECUTOR = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="cuda-checkpoint")

# criu's CUDA plugin starts only on a machine with an NVIDIA GPU, unless this fault is
# injected (CRIU_FAULT): the tests use it to run the plugin against a stand-in driver.
CRIU_FAULT_FORCE_CUDA_PLUGIN = "138"
RETRIES = 3


async def uninterruptible(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking driver call in a thread and wait for it even if we are cancelled.

    The cancellation is re-raised once the call has returned, so callers can roll back.
    """
    future = _EXECUTOR.submit(fn, *args)
    cancelled = False
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(asyncio.wrap_future(future))
            break
        cancelled = True
    result = future.result()
    if cancelled:
        raise asyncio.CancelledError
    return result


@dataclass(frozen=True)
class PluginInstall:
    """CRIU's CUDA plugin and our stand-in, where ``scripts/install-criu.sh`` puts them:
    ``ROOT/criu/cuda_plugin.so`` (with ``built-for``, the install's note of its criu:
    ``core.criu_build``) and
    ``ROOT/bin/cuda-checkpoint``."""

    root: Path

    @property
    def plugin_dir(self) -> Path:
        return self.root / "criu"

    @property
    def shim_dir(self) -> Path:
        return self.root / "bin"

    def problem(self, criu_version: str) -> str | None:
        """Why the plugin cannot be used with criu ``criu_version`` (e.g. '4.2.1'), if so."""
        plugin = self.plugin_dir / "cuda_plugin.so"
        shim = self.shim_dir / "cuda-checkpoint"
        if not plugin.is_file():
            return f"CRIU's CUDA plugin is not installed ({plugin} is missing)"
        if not os.access(shim, os.X_OK):
            return f"the cuda-checkpoint stand-in is not installed in {self.shim_dir}"
        # criu loads every library of the plugin directory and runs the stand-in with our
        # privileges: anyone who can change them could run code as root.
        for path in (self.plugin_dir, plugin, self.shim_dir, shim):
            unsafe = _unsafe_owner(path)
            if unsafe:
                return f"{path} {unsafe}: criu, run with our privileges, would load it"
        # The install's note: the criu the plugin was built with (core/criu_build.py).
        build = read_note(self.plugin_dir)
        if build is None or build.version != criu_version.strip():
            built_for = f"criu {build.version}" if build else "another criu"
            return (f"CRIU's CUDA plugin in {self.plugin_dir} was built for "
                    f"{built_for}, not for this criu {criu_version}")
        return None

    def criu_env(self, socket_path: Path) -> dict[str, str]:
        """criu's environment: the plugin runs ``cuda-checkpoint`` from PATH."""
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        return {"PATH": f"{self.shim_dir}{os.pathsep}{path}", ENV_CUDA_BROKER: str(socket_path)}


def _unsafe_owner(path: Path) -> str | None:
    """Why another user could change ``path``, if one could."""
    st = path.stat()
    if st.st_uid not in (0, os.geteuid()):
        return f"belongs to uid {st.st_uid}"
    if st.st_mode & 0o022:
        return "is writable by other users"
    return None


@dataclass
class BrokerCall:
    """One request of the plugin, as answered."""

    request: str
    pid: int
    status: int
    seconds: float
    answer: str


@dataclass
class CheckpointBroker:
    """Answers the plugin's requests for the processes ``allowed`` names; see the module.

    ``gate`` (restore only) is awaited before the first answer: CRIU holds every restored
    task stopped until then, so no code of an image runs before its digests matched. If it
    raises, ``on_gate_failed(pid, error)`` kills the tree of the pid that asked (still stopped)
    and every request fails.
    ``gpu_pairs`` gives the (old, new) GPU UUIDs to restore a process onto.
    ``hands_off``: the tree sleeps in the gpu tier, its CUDA state checkpointed before
    criu and left so by its dump, restored by the engine once criu is done. The plugin is
    told that no process has a restore thread, so that it touches none: it would run one
    of a stopped tree (at the end of a failed dump) and wait on it for ever.
    ``pids``: how criu names the processes and threads it asks about (the criu run's own
    ``CriuExtras.pids``, which a criu inside a user's container names differently).
    """

    driver: CheckpointDriver
    lock_timeout: float
    allowed: Callable[[int], bool]
    gate: Awaitable[Any] | None = None
    on_gate_failed: Callable[[int, BaseException], None] | None = None
    gpu_pairs: Callable[[int], Sequence[tuple[str, str]]] = lambda _pid: ()
    hands_off: bool = False
    pids: PidView = field(default_factory=PidView)
    calls: list[BrokerCall] = field(default_factory=list)
    # The first driver error of each step, for the engine's message.
    errors: list[DriverCallError] = field(default_factory=list)
    timings: dict[int, dict[str, float]] = field(default_factory=dict)
    gate_error: BaseException | None = None
    _server: asyncio.AbstractServer | None = None
    _dir: Path | None = None
    _gate_passed: bool = False

    @property
    def socket_path(self) -> Path:
        assert self._dir is not None, "the broker is not started"
        return self._dir / "broker.sock"

    async def start(self) -> None:
        # A private directory (0700): only our user can reach the driver through it.
        self._dir = Path(tempfile.mkdtemp(prefix="jupyter-gpu-snapshot-cuda-"))
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            args = [a.decode() for a in (await reader.read()).split(b"\0") if a]
            status, text = await self.answer(args)
            writer.write(f"{status}\n{text}".encode())
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def answer(self, args: list[str]) -> tuple[int, str]:
        """The exit status and output of ``cuda-checkpoint ARGS``."""
        options = _parse(args)
        if options is None:
            return 2, f"unsupported request: {' '.join(args)}\n"
        request, seen = options
        try:
            pid = await asyncio.to_thread(self.pids.from_criu, seen)
        except SnapshotError as exc:
            return 1, f"{exc.message}\n"
        if self.gate is not None and not self._gate_passed:
            await self._pass_gate(pid)
        if self.gate_error is not None:
            return 1, f"the restore was stopped: {self.gate_error}\n"
        owner = procfs.thread_group(pid) or pid  # the plugin asks some things by thread id
        if not self.allowed(owner):
            return 1, f"pid {pid} is not part of the kernel being saved or restored\n"
        started = time.monotonic()
        try:
            status, text = await self._call(request, owner)
        except DriverCallError as exc:
            self.errors.append(exc)
            status, text = 1, f"{exc}\n"
        seconds = time.monotonic() - started
        self.calls.append(BrokerCall(request, owner, status, seconds, text.strip()))
        if request.startswith("action") and status == 0:
            step = request.split()[-1]
            per_pid = self.timings.setdefault(owner, {})
            per_pid[step] = per_pid.get(step, 0.0) + seconds
        return status, text

    async def _pass_gate(self, pid: int) -> None:
        assert self.gate is not None
        try:
            await self.gate
        except BaseException as exc:  # a damaged image: nothing of it may run
            self.gate_error = exc
            if self.on_gate_failed is not None:
                await asyncio.to_thread(self.on_gate_failed, pid, exc)
        self._gate_passed = True

    async def _call(self, request: str, pid: int) -> tuple[int, str]:
        driver = self.driver
        if request == "get-restore-tid" and self.hands_off:
            return 1, f"pid {pid} sleeps: its CUDA state is the engine's to restore\n"
        if request == "get-restore-tid":
            tid = await uninterruptible(driver.restore_thread_id, pid)
            if not tid:
                return 1, f"pid {pid} holds no CUDA state\n"
            return 0, f"{await asyncio.to_thread(self.pids.to_criu, tid)}\n"
        if request == "get-state":
            state = await uninterruptible(driver.state, pid)
            return (0, f"{state.value}\n") if state else (1, f"pid {pid} holds no CUDA state\n")
        action = request.split()[-1]
        if action == "lock":
            # Our timeout, not the plugin's (criu's --timeout, meant for freezing).
            timeout_ms = max(1, int(self.lock_timeout * 1000))
            await uninterruptible(driver.lock, pid, timeout_ms)
        elif action == "checkpoint":
            await uninterruptible(driver.checkpoint, pid)
        elif action == "restore":
            # The plugin restores every process it had locked, also one whose checkpoint
            # failed: that one is only locked, and goes on to its unlock.
            state = await uninterruptible(driver.state, pid)
            if state == ProcessState.FAILED:
                raise DriverCallError("cuCheckpointProcessRestore", pid, CUDA_ERROR_ILLEGAL_STATE,
                                      "the driver reports its CUDA state as failed")
            if state != ProcessState.LOCKED:
                await self._retried(driver.restore, pid, tuple(self.gpu_pairs(pid)))
        elif action == "unlock":
            await self._retried(driver.unlock, pid)
        else:
            return 2, f"unknown action {action!r}\n"
        return 0, ""


    async def _retried(self, fn: Callable[..., None], pid: int, *args: Any) -> None:
        # A restore can fail for want of GPU memory that another process frees a moment
        # later; the tree stays frozen meanwhile, so waiting here costs no safety.
        for attempt in range(RETRIES):
            try:
                await uninterruptible(fn, pid, *args)
                return
            except DriverCallError:
                if attempt == RETRIES - 1:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)


def _parse(args: list[str]) -> tuple[str, int] | None:
    """('action lock', pid), ('get-state', pid) or ('get-restore-tid', pid)."""
    try:
        pid = int(args[args.index("--pid") + 1])
    except (ValueError, IndexError):
        return None
    if "--action" in args:
        i = args.index("--action") + 1
        return (f"action {args[i]}", pid) if i < len(args) else None
    for request in ("get-restore-tid", "get-state"):
        if f"--{request}" in args:
            return request, pid
    return None
