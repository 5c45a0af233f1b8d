"""What GPUs this machine has and how much device memory each process holds.

Read through NVML (``libnvidia-ml.so.1``, installed with every driver) via ctypes, or from
``nvidia-smi`` when NVML cannot be loaded. Used for preflight checks and the manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

import psutil

_MIB = 1 << 20
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
_NOT_AVAILABLE = (1 << 64) - 1


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    mig_enabled: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name,
                "memory_total": self.memory_total, "memory_used": self.memory_used,
                "memory_free": self.memory_free, "mig_enabled": self.mig_enabled}


@dataclass(frozen=True)
class GpuInventory:
    """One reading of the GPUs; ``process_memory`` maps host pid -> {GPU UUID: bytes}."""

    driver_version: str
    devices: tuple[GpuDevice, ...]
    process_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    mps_active: bool = False
    source: str = "nvml"

    def device(self, uuid: str) -> GpuDevice | None:
        return next((d for d in self.devices if d.uuid == uuid), None)

    def bytes_of(self, pid: int) -> int:
        return sum(self.process_memory.get(pid, {}).values())


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2/v3 layout)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class Nvml:
    """A minimal NVML binding: initialised once per process, never shut down."""

    _lock = threading.Lock()
    _instance: Nvml | None = None

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        result = self.lib.nvmlInit_v2()
        if result != NVML_SUCCESS:
            raise OSError(f"nvmlInit_v2 returned {result}")

    @classmethod
    def get(cls) -> Nvml:
        with cls._lock:
            if cls._instance is None:
                cls._instance = Nvml()
            return cls._instance

    def _text(self, fn: str, *args: Any) -> str:
        buf = ctypes.create_string_buffer(256)
        if getattr(self.lib, fn)(*args, buf, ctypes.c_uint(256)) != NVML_SUCCESS:
            return ""
        return buf.value.decode(errors="replace")

    def _processes(self, handle: ctypes.c_void_p) -> list[tuple[int, int]]:
        # _v3 since driver 510; the struct layout is the same as _v2's.
        fn = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        if fn is None:
            fn = self.lib.nvmlDeviceGetComputeRunningProcesses_v2
        count = ctypes.c_uint(64)
        while True:
            infos = (_ProcessInfo * count.value)()
            result = fn(handle, ctypes.byref(count), infos)
            if result == NVML_ERROR_INSUFFICIENT_SIZE:
                count = ctypes.c_uint(count.value * 2)
                continue
            if result != NVML_SUCCESS:
                return []
            return [(infos[i].pid, 0 if infos[i].usedGpuMemory == _NOT_AVAILABLE
                     else infos[i].usedGpuMemory) for i in range(count.value)]

    def read(self) -> GpuInventory:
        n = ctypes.c_uint(0)
        self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
        devices = []
        memory: dict[int, dict[str, int]] = {}
        for index in range(n.value):
            handle = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            uuid = self._text("nvmlDeviceGetUUID", handle)
            mem = _Memory()
            self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
            current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
            mig = (self.lib.nvmlDeviceGetMigMode(handle, ctypes.byref(current),
                                                 ctypes.byref(pending)) == NVML_SUCCESS
                   and current.value == 1)
            devices.append(GpuDevice(index, uuid, self._text("nvmlDeviceGetName", handle),
                                     mem.total, mem.used, mem.free, mig))
            for pid, used in self._processes(handle):
                memory.setdefault(pid, {})[uuid] = used
        return GpuInventory(self._text("nvmlSystemGetDriverVersion"), tuple(devices), memory,
                            mps_active(), "nvml")


def _smi(args: list[str]) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise OSError("nvidia-smi not found")
    out = subprocess.run([exe, *args, "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, check=True, timeout=30)
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line]


def read_with_nvidia_smi() -> GpuInventory:
    devices = []
    version = ""
    for index, uuid, name, total, used, free, driver in _smi(
            ["--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,driver_version"]):
        version = driver
        devices.append(GpuDevice(int(index), uuid, name, int(total) * _MIB, int(used) * _MIB,
                                 int(free) * _MIB))
    memory: dict[int, dict[str, int]] = {}
    for pid, uuid, used in _smi(["--query-compute-apps=pid,gpu_uuid,used_memory"]):
        with contextlib.suppress(ValueError):
            memory.setdefault(int(pid), {})[uuid] = int(used) * _MIB
    return GpuInventory(version, tuple(devices), memory, mps_active(), "nvidia-smi")


def read_inventory() -> GpuInventory | None:
    """The GPUs now, or None on a machine without an NVIDIA driver."""
    try:
        return Nvml.get().read()
    except (OSError, AttributeError):
        pass
    try:
        return read_with_nvidia_smi()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def mps_active() -> bool:
    """Whether an MPS daemon runs here (the checkpoint API does not support MPS clients)."""
    for proc in psutil.process_iter(["name"]):
        if (proc.info.get("name") or "").startswith("nvidia-cuda-mps"):
            return True
    return False


def host_memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(psutil.virtual_memory().available)
