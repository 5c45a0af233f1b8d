"""The processes that tests and benchmarks start and end: a free port for a server, its
shutdown, the processes of a kernel, and a power loss. Standard library and psutil only, so that the
benchmarks, run as scripts, import it as well."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Kernels the tests start themselves take their ports below the system's ephemeral range, each
# xdist worker from a block of its own: a port a killed kernel left is then never handed by
# the system to another test's connection or kernel (bind(0) and connect() draw from that
# range) before the test restores the kernel on it.
_PRIVATE_PORTS = range(15000, 32000)
_CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
_next_port: dict[str, int] = {}


def private_kernel_ports(ip: str = "127.0.0.1") -> dict[str, int]:
    """Five free ports for a kernel this process starts, from this worker's block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = len(_PRIVATE_PORTS) // workers
    block = range(_PRIVATE_PORTS.start + index * size, _PRIVATE_PORTS.start + (index + 1) * size)
    ports: list[int] = []
    port = _next_port.get(worker, block.start)
    for _ in range(len(block)):
        if port >= block.stop:
            port = block.start
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                pass  # taken: by a kernel of this worker still running, most likely
            else:
                ports.append(port)
        port += 1
        if len(ports) == len(_CHANNELS):
            _next_port[worker] = port
            return dict(zip(_CHANNELS, ports, strict=True))
    raise RuntimeError(f"no {len(_CHANNELS)} free ports in {block}")


def shut_down(process: subprocess.Popen[bytes], timeout: float, *, group: bool = False) -> int:
    """Ends the process as a node's shutdown does, with SIGTERM, and SIGKILLs it (its whole
    process group with ``group``) if it still runs ``timeout`` s later; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            process.wait()
    return int(process.returncode)


def kernel_processes(kernel_id: str) -> list[int]:
    """Processes launched for the kernel (restored copies keep the original's command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(kernel_id in arg for arg in proc.info.get("cmdline") or []):
            found.append(proc.pid)
    return found


def kernel_pids(kernel_id: str) -> list[int]:
    """The kernel's own processes: those of ``kernel_processes`` without the launchers
    (``unshare``, ``nsenter``, the node agent's entry into a container) and the namespace
    init (nsinit), which name the kernel too."""
    from jupyter_gpu_snapshot.agent.pods.entry import ENTER
    from jupyter_gpu_snapshot.launch.provisioner import NSINIT

    found = []
    for pid in kernel_processes(kernel_id):
        with contextlib.suppress(psutil.Error):
            cmdline = psutil.Process(pid).cmdline()
            if (Path(cmdline[0]).name not in ("unshare", "nsenter")
                    and not {str(NSINIT), str(ENTER)} & set(cmdline)):
                found.append(pid)
    return found


def kill_kernels(kernel_ids: Iterable[str]) -> None:
    """Kill every process of these kernels that still runs."""
    for kernel_id in kernel_ids:
        for pid in kernel_processes(kernel_id):
            # Killing a namespace's init ends the rest of it meanwhile.
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def power_loss(server_pid: int, kernel_ids: Iterable[str]) -> None:
    """SIGKILL the server, its children (criu included) and every process of the kernels,
    all at once."""
    doomed = {server_pid}
    with contextlib.suppress(psutil.NoSuchProcess):
        doomed |= {p.pid for p in psutil.Process(server_pid).children(recursive=True)}
    for kernel_id in kernel_ids:
        doomed |= set(kernel_processes(kernel_id))
    # Stopped first, so that none of them sees another die and cleans up after it.
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
