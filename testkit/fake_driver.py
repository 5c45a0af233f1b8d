"""A scripted stand-in for the CUDA driver's checkpoint API, for machines without a GPU.

A process "holds CUDA state" when its environment has ``JGS_FAKE_CUDA=<bytes>:<token>``
(``fake_cuda_env`` makes one); the fake
keeps each such process's state (running, locked, checkpointed, failed), enforces the
driver's transitions (a wrong one answers CUDA_ERROR_ILLEGAL_STATE, as the real driver
does), records every call, and fails or delays any step on request. As with the real
driver, a process restored from an image taken while it was checkpointed comes back
checkpointed: the fake recognises it by its environment, which CRIU restores.

Like the real driver, it does its work on a "restore thread" inside the target process: the
thread named ``cuda-restore`` (``RESTORE_THREAD_CODE`` starts one in a kernel), else the
main thread. At each checkpoint, restore and unlock it notes which other threads of the
process were running (``protocol_breaches``): the driver's protocol wants them all stopped.

Restoring onto other GPUs follows what driver 580 does: ``gpuPairs`` must map as many distinct
GPUs as the process can see onto every GPU of the (fake) node, each once, else
CUDA_ERROR_INVALID_VALUE; the process's memory then shows on its new GPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jupyter_gpu_snapshot.core import procfs
from jupyter_gpu_snapshot.gpu.broker import CRIU_FAULT_FORCE_CUDA_PLUGIN
from jupyter_gpu_snapshot.gpu.driver import (
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_TIMEOUT,
    DriverCallError,
    DriverInfo,
    DriverStatus,
    ProcessState,
)
from jupyter_gpu_snapshot.gpu.inventory import GpuDevice, GpuInventory

FAKE_ENV = "JGS_FAKE_CUDA"
RESTORE_THREAD_NAME = "cuda-restore"
# Run in a kernel: a thread that stands for the driver's restore thread, as libcuda starts one.
RESTORE_THREAD_CODE = (
    "import ctypes as _c, threading as _t\n"
    "def _cuda_restore_thread():\n"
    f"    _c.CDLL(None).prctl(15, b'{RESTORE_THREAD_NAME}', 0, 0, 0)\n"
    "    _t.Event().wait()\n"
    "_t.Thread(target=_cuda_restore_thread, daemon=True).start()\n"
)
# criu's environment that starts its CUDA plugin on a machine without a GPU.
FORCE_CUDA_PLUGIN = {"CRIU_FAULT": CRIU_FAULT_FORCE_CUDA_PLUGIN}
# Thread states of a running thread (not stopped by a tracer or a signal).
_RUNNING_STATES = frozenset("RSD")
GIB = 1 << 30
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"


def fake_cuda_env(nbytes: int) -> dict[str, str]:
    """Environment for a kernel that the fake driver treats as holding ``nbytes`` on the GPU."""
    return {FAKE_ENV: f"{nbytes}:{uuid.uuid4().hex}"}


def fake_cuda_token(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            # The namespace's init inherits the environment but never touches the GPU.
            if b"nsinit.py" in f.read():
                return None
    except OSError:
        return None
    for item in env:
        if item.startswith(FAKE_ENV.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    return None


def fake_cuda_bytes(pid: int) -> int | None:
    token = fake_cuda_token(pid)
    return int(token.split(":")[0]) if token else None


@dataclass
class Failure:
    code: int
    times: int
    leaves: ProcessState | None = None


@dataclass
class FakeCudaDriver:
    """Implements ``CheckpointDriver``; see the module docstring."""

    version: str = "580.159.04"
    states: dict[int, ProcessState] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    delays: dict[str, float] = field(default_factory=dict)
    restore_pairs: list[Sequence[tuple[str, str]]] = field(default_factory=list)
    # The node's GPUs (set by FakeGpus) and the one each process's memory lives on.
    gpu_uuids: list[str] = field(default_factory=list)
    placed: dict[str, str] = field(default_factory=dict)  # fake token -> GPU UUID
    # Called with (op, pid) as each step starts, from the thread that makes the call.
    on_call: Callable[[str, int], None] | None = None
    # (op, pid, tids of other threads that ran during it) for each checkpoint/restore/unlock.
    breaches: list[tuple[str, int, list[int]]] = field(default_factory=list)
    _failures: dict[str, Failure] = field(default_factory=dict)
    _imaged: set[str] = field(default_factory=set)  # tokens of processes checkpointed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def info(self) -> DriverInfo:
        return DriverInfo(self.version, 13000, "fake", True)

    def status(self) -> DriverStatus:
        return DriverStatus(self, info=self.info)

    def fail(self, op: str, code: int, times: int = 1, leaves: ProcessState | None = None) -> None:
        """Make the next ``times`` calls of ``op`` fail with ``code``."""
        self._failures[op] = Failure(code, times, leaves)

    def ops(self, pid: int | None = None) -> list[str]:
        return [op for op, p in self.calls if op != "state" and (pid is None or p == pid)]

    def protocol_breaches(self) -> list[tuple[str, int, list[int]]]:
        return list(self.breaches)

    def _note_running_threads(self, op: str, pid: int) -> None:
        if op not in ("checkpoint", "restore", "unlock"):
            return
        restore_tid = self.restore_thread_id(pid)
        running = [tid for tid, state in procfs.thread_states(pid).items()
                   if tid != restore_tid and state in _RUNNING_STATES]
        if running:
            self.breaches.append((op, pid, running))

    def _step(self, op: str, pid: int, needs: ProcessState, becomes: ProcessState) -> None:
        if self.on_call is not None:
            self.on_call(op, pid)
        self._note_running_threads(op, pid)
        with self._lock:
            self.calls.append((op, pid))
            state = self._current(pid)
            failure = self._failures.get(op)
            if failure and failure.times > 0:
                failure.times -= 1
                if failure.leaves is not None:
                    self.states[pid] = failure.leaves
            elif state != needs:
                failure = Failure(CUDA_ERROR_ILLEGAL_STATE, 0)
            else:
                failure = None
        time.sleep(self.delays.get(op, 0.0))
        if failure is not None:
            raise DriverCallError(f"cuCheckpointProcess{op.title()}", pid, failure.code)
        with self._lock:
            self.states[pid] = becomes
            if becomes == ProcessState.CHECKPOINTED:
                self._imaged.add(fake_cuda_token(pid) or "")

    def _current(self, pid: int) -> ProcessState | None:
        if pid not in self.states:
            held = fake_cuda_token(pid)
            if held is None:
                return None
            # Restored from an image made while checkpointed: comes back checkpointed.
            self.states[pid] = (ProcessState.CHECKPOINTED if held in self._imaged
                                else ProcessState.RUNNING)
        return self.states[pid]

    # -- CheckpointDriver ------------------------------------------------------------------
    def state(self, pid: int) -> ProcessState | None:
        with self._lock:
            self.calls.append(("state", pid))
            return self._current(pid)

    def lock(self, pid: int, timeout_ms: int) -> None:
        failure = self._failures.get("lock")
        if failure and failure.times > 0 and failure.code in (CUDA_ERROR_NOT_READY,
                                                              CUDA_ERROR_TIMEOUT):
            time.sleep(timeout_ms / 1000)  # a real timeout takes its time
        self._step("lock", pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._step("checkpoint", pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        self.restore_pairs.append(list(gpu_pairs))
        if gpu_pairs:
            old = {o for o, _ in gpu_pairs}
            new = sorted(n for _, n in gpu_pairs)
            if len(old) != len(gpu_pairs) or new != sorted(self.gpu_uuids):
                with self._lock:
                    self.calls.append(("restore", pid))
                raise DriverCallError("cuCheckpointProcessRestore", pid,
                                      CUDA_ERROR_INVALID_VALUE)
        self._step("restore", pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)
        token = fake_cuda_token(pid) or ""
        where = self.placed.get(token, self.gpu_uuids[0] if self.gpu_uuids else "")
        self.placed[token] = dict(gpu_pairs).get(where, where)

    def unlock(self, pid: int) -> None:
        self._step("unlock", pid, ProcessState.LOCKED, ProcessState.RUNNING)

    def restore_thread_id(self, pid: int) -> int | None:
        if fake_cuda_token(pid) is None:
            return None  # as the driver: no CUDA state, no restore thread
        for tid in procfs.thread_states(pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == RESTORE_THREAD_NAME:
                    return tid
        return pid


@dataclass
class FakeGpus:
    """The NVML reading that goes with a ``FakeCudaDriver``: one 80 GiB GPU by default."""

    driver: FakeCudaDriver
    devices: list[tuple[str, str, int]] = field(
        default_factory=lambda: [("NVIDIA Fake H100 80GB HBM3", UUID0, 80 * GIB)])
    free: int | None = None  # every GPU's free bytes, unless ``free_on`` names it
    free_on: dict[str, int] = field(default_factory=dict)
    mig: bool = False
    mps: bool = False

    def __call__(self) -> GpuInventory:
        uuids = [uuid for _, uuid, _ in self.devices]
        self.driver.gpu_uuids = uuids
        memory: dict[int, dict[str, int]] = {}
        for pid, state in list(self.driver.states.items()):
            held = fake_cuda_bytes(pid)
            if held and state in (ProcessState.RUNNING, ProcessState.LOCKED):
                token = fake_cuda_token(pid) or ""
                memory[pid] = {self.driver.placed.get(token, uuids[0]): held}
        used = {u: sum(m.get(u, 0) for m in memory.values()) for u in uuids}
        devices = tuple(
            GpuDevice(i, uuid, name, total, used[uuid],
                      self.free_on.get(uuid, self.free if self.free is not None
                                       else total - used[uuid]),
                      self.mig)
            for i, (name, uuid, total) in enumerate(self.devices))
        return GpuInventory(self.driver.version, devices, memory, self.mps, "fake")
