"""The CUDA driver's checkpoint API: suspend a process's GPU state into its host memory.

A process holding CUDA state goes running -> locked -> checkpointed (device memory copied
into the process's host memory, GPU released) and back: checkpointed -> locked (restore)
-> running (unlock). Calls come from this process and name the target by its host pid.

Backends, first usable wins:
- ``LibcudaDriver``: ``libcuda.so.1`` through ctypes, in-process (about 1 ms for a lock).
- ``CudaCheckpointCli``: the ``cuda-checkpoint`` binary, only when the driver lacks the API
  but the binary is on PATH (driver 550 ships ``--toggle`` only). Each call costs seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import SnapshotError

# CUresult values the checkpoint calls return (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909
CUDA_ERROR_UNKNOWN = 999

ERROR_NAMES = {
    CUDA_ERROR_INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    CUDA_ERROR_OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
    CUDA_ERROR_NOT_INITIALIZED: "CUDA_ERROR_NOT_INITIALIZED",
    CUDA_ERROR_NO_DEVICE: "CUDA_ERROR_NO_DEVICE",
    CUDA_ERROR_OPERATING_SYSTEM: "CUDA_ERROR_OPERATING_SYSTEM",
    CUDA_ERROR_ILLEGAL_STATE: "CUDA_ERROR_ILLEGAL_STATE",
    CUDA_ERROR_NOT_FOUND: "CUDA_ERROR_NOT_FOUND",
    CUDA_ERROR_NOT_READY: "CUDA_ERROR_NOT_READY",
    CUDA_ERROR_NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED",
    CUDA_ERROR_TIMEOUT: "CUDA_ERROR_TIMEOUT",
    CUDA_ERROR_UNKNOWN: "CUDA_ERROR_UNKNOWN",
}

API_SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetRestoreThreadId",
)


class ProcessState(enum.Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


_STATES = {0: ProcessState.RUNNING, 1: ProcessState.LOCKED, 2: ProcessState.CHECKPOINTED,
           3: ProcessState.FAILED}


class DriverCallError(Exception):
    """A checkpoint call returned an error; ``code`` is the CUresult (or -1 for the CLI)."""

    def __init__(self, call: str, pid: int, code: int, detail: str = "") -> None:
        self.call, self.pid, self.code, self.detail = call, pid, code, detail
        name = ERROR_NAMES.get(code, f"CUresult {code}") if code >= 0 else "cuda-checkpoint"
        super().__init__(f"{call}(pid {pid}) returned {name}{': ' + detail if detail else ''}")


class CudaError(SnapshotError):
    """A CUDA checkpoint step failed; the message names the process, the call and the cause."""


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def driver_version_string() -> str:
    """The kernel module's version, e.g. ``580.159.04`` ('' without a driver)."""
    for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
        with contextlib.suppress(OSError):
            text = _read(path)
            for word in text.split():
                if word[:1].isdigit() and word.count(".") >= 1:
                    return word
    return ""


@dataclass(frozen=True)
class DriverInfo:
    """What the installed driver is and can do."""

    version: str  # kernel module, e.g. "580.159.04"
    cuda_version: int  # cuDriverGetVersion, e.g. 13000
    backend: str
    has_api: bool

    @property
    def major(self) -> int:
        with contextlib.suppress(ValueError):
            return int(self.version.split(".")[0])
        return 0

    @property
    def lock_timeout(self) -> bool:
        """Lock honours a timeout from driver 570 (550 locks until the GPU is idle)."""
        return self.major >= 570

    @property
    def gpu_remap(self) -> bool:
        """Restore onto GPUs with other UUIDs (``gpuPairs``) from driver 570."""
        return self.major >= 570


class CheckpointDriver(Protocol):
    """One way of calling the checkpoint API. Every call blocks; run it off the event loop."""

    info: DriverInfo

    def state(self, pid: int) -> ProcessState | None:
        """The process's CUDA state, or None when it holds none (or has gone)."""

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """``gpu_pairs``: (old UUID, new UUID) when restoring onto other GPUs."""

    def unlock(self, pid: int) -> None: ...

    def restore_thread_id(self, pid: int) -> int | None:
        """Host tid of the driver's restore thread, which must not be stopped during restore."""


# -- ctypes on libcuda.so.1 -------------------------------------------------------------------
class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_ulonglong * 7)]


class _ReservedArgs(ctypes.Structure):  # CUcheckpointCheckpointArgs / CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_ulonglong * 8)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_ulonglong)]


def uuid_bytes(uuid: str) -> bytes:
    """``GPU-d4b6458e-d207-...`` as the 16 bytes of a CUuuid."""
    hexdigits = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(hexdigits)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return raw


def _process_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


class LibcudaDriver:
    """The checkpoint API called in-process through ctypes."""

    def __init__(self, lib: Any | None = None) -> None:
        self._lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        self._lib.cuDriverGetVersion(ctypes.byref(version))
        has_api = all(hasattr(self._lib, name) for name in API_SYMBOLS)
        self.info = DriverInfo(driver_version_string(), version.value, "libcuda", has_api)
        self._init_lock = threading.Lock()
        self._init_result: int | None = None

    def _ensure_init(self) -> None:
        # Until this process has called cuInit, every query answers NOT_INITIALIZED.
        with self._init_lock:
            if self._init_result is None:
                self._init_result = int(self._lib.cuInit(0))
        if self._init_result != CUDA_SUCCESS:
            raise DriverCallError("cuInit", os.getpid(), self._init_result)

    def _call(self, name: str, pid: int, arg: Any) -> None:
        self._ensure_init()
        result = int(getattr(self._lib, name)(pid, arg))
        if result != CUDA_SUCCESS:
            raise DriverCallError(name, pid, result)

    def state(self, pid: int) -> ProcessState | None:
        try:
            self._ensure_init()
        except DriverCallError as exc:
            if exc.code == CUDA_ERROR_NO_DEVICE:
                return None  # no GPU: no process can hold CUDA state
            raise
        value = ctypes.c_int(-1)
        result = int(self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(value)))
        # Measured on driver 580: NOT_INITIALIZED for a process without CUDA state,
        # OPERATING_SYSTEM for a pid that does not exist.
        if result == CUDA_ERROR_NOT_INITIALIZED or (
            result in (CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_NOT_FOUND) and _process_gone(pid)
        ):
            return None
        if result != CUDA_SUCCESS:
            raise DriverCallError("cuCheckpointProcessGetState", pid, result)
        if value.value not in _STATES:
            raise DriverCallError("cuCheckpointProcessGetState", pid, CUDA_ERROR_UNKNOWN,
                                  f"unknown state {value.value}")
        return _STATES[value.value]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(_LockArgs(timeoutMs=timeout_ms)))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(_ReservedArgs()))

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        if not gpu_pairs:
            self._call("cuCheckpointProcessRestore", pid, None)
            return
        pairs = (_GpuPair * len(gpu_pairs))()
        for i, (old, new) in enumerate(gpu_pairs):
            pairs[i].oldUuid[:] = list(uuid_bytes(old))
            pairs[i].newUuid[:] = list(uuid_bytes(new))
        args = _RestoreArgs(gpuPairs=pairs, gpuPairsCount=len(gpu_pairs))
        self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.byref(_ReservedArgs()))

    def restore_thread_id(self, pid: int) -> int | None:
        self._ensure_init()
        tid = ctypes.c_int(0)
        result = int(self._lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid)))
        return tid.value if result == CUDA_SUCCESS and tid.value > 0 else None


# -- the cuda-checkpoint binary ---------------------------------------------------------------
class CudaCheckpointCli:
    """``cuda-checkpoint`` as a fallback; with only ``--toggle`` (driver 550), lock and
    checkpoint happen together at ``checkpoint`` and restore and unlock at ``restore``."""

    def __init__(self, executable: str, cuda_version: int = 0) -> None:
        self.executable = executable
        usage = self._run("--help", check=False)
        self.toggle_only = "--action" not in usage
        self.info = DriverInfo(driver_version_string(), cuda_version, "cuda-checkpoint", True)

    def _run(self, *args: str, check: bool = True, pid: int = 0) -> str:
        out = subprocess.run([self.executable, *args], capture_output=True, text=True,
                             check=False)
        text = (out.stdout + out.stderr).strip()
        if check and out.returncode != 0:
            raise DriverCallError(f"cuda-checkpoint {' '.join(args[:2])}", pid, -1, text[-300:])
        return text

    def state(self, pid: int) -> ProcessState | None:
        out = subprocess.run([self.executable, "--get-state", "--pid", str(pid)],
                             capture_output=True, text=True, check=False)
        word = out.stdout.strip().split()[-1] if out.stdout.strip() else ""
        if out.returncode != 0 or word not in {s.value for s in ProcessState}:
            return None
        return ProcessState(word)

    def lock(self, pid: int, timeout_ms: int) -> None:
        if not self.toggle_only:
            self._run("--action", "lock", "--pid", str(pid), "--timeout", str(timeout_ms),
                      pid=pid)

    def checkpoint(self, pid: int) -> None:
        if self.toggle_only:
            self._run("--toggle", "--pid", str(pid), pid=pid)
        else:
            self._run("--action", "checkpoint", "--pid", str(pid), pid=pid)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        if gpu_pairs:
            raise DriverCallError("cuda-checkpoint restore", pid, CUDA_ERROR_NOT_SUPPORTED,
                                  "restoring onto other GPUs needs the libcuda backend")
        if self.toggle_only:
            self._run("--toggle", "--pid", str(pid), pid=pid)
        else:
            self._run("--action", "restore", "--pid", str(pid), pid=pid)

    def unlock(self, pid: int) -> None:
        if not self.toggle_only:
            self._run("--action", "unlock", "--pid", str(pid), pid=pid)

    def restore_thread_id(self, pid: int) -> int | None:
        out = subprocess.run([self.executable, "--get-restore-tid", "--pid", str(pid)],
                             capture_output=True, text=True, check=False)
        with contextlib.suppress(ValueError):
            return int(out.stdout.strip()) if out.returncode == 0 else None
        return None


@dataclass
class DriverStatus:
    """What ``load_driver`` found: a usable backend, or why there is none."""

    driver: CheckpointDriver | None
    problem: str = ""
    info: DriverInfo | None = None


def load_driver(backend: str = "auto") -> DriverStatus:
    """The first usable backend (``auto``), or the one named: libcuda or cli."""
    info: DriverInfo | None = None
    problem = ""
    if backend in ("auto", "libcuda"):
        try:
            lib = LibcudaDriver()
        except OSError:
            problem = "no NVIDIA driver here (libcuda.so.1 cannot be loaded)"
        else:
            info = lib.info
            if lib.info.has_api:
                return DriverStatus(lib, info=info)
            problem = (f"driver {lib.info.version or lib.info.cuda_version} has no CUDA "
                       "checkpoint API (driver 550 or newer is needed, 570+ recommended)")
    if backend in ("auto", "cli"):
        exe = shutil.which("cuda-checkpoint")
        if exe:
            cli = CudaCheckpointCli(exe, info.cuda_version if info else 0)
            return DriverStatus(cli, info=cli.info)
        if backend == "cli":
            problem = "cuda-checkpoint is not on PATH"
    return DriverStatus(None, problem, info)


@functools.cache
def driver_status() -> DriverStatus:
    """``load_driver()``, once per process: the server, the CLI and the GPU hook share it."""
    return load_driver()
