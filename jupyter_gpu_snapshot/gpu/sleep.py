"""The first tier of hibernation: a kernel's GPU released, its process kept.

``GpuSleep.release`` locks the CUDA processes of a kernel tree while they run, has a holder
process (``gpu/holder.py``) stop every thread but the driver's restore threads, then
checkpoints them: the device memory moves into each process's own host memory and the GPU
is free. Nothing is written to disk; the kernel keeps its pid, its sockets and its clients.
``GpuSleep.wake`` restores and unlocks them, then the holder lets the threads run.

Every step that fails puts back what the steps before it did: a release that fails leaves
the kernel running with CUDA unlocked, a wake that fails (most often for want of GPU
memory) leaves it asleep, its GPU free again, with nothing lost. The holder outlives the
server that asked (a restarted server finds it by the kernel's pid: ``asleep``); should it
die, the kernel dies with it (``PTRACE_O_EXITKILL``), never left running on checkpointed CUDA.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._constants import format_bytes
from ..core import procfs
from ..core.errors import InvalidRequest, NotFound, NotReady
from .checkpoint import CudaCheckpoint, CudaProcess, error_hint, host_tids
from .driver import CheckpointDriver, CudaError, DriverCallError, ProcessState
from .inventory import GpuInventory

# Host memory a release wants beyond the GPU memory it moves there (the driver's own).
HOST_MARGIN_FRACTION = 0.05
HOST_MARGIN_BYTES = 256 << 20
# How long a holder may take to stop a tree's threads before the release gives up.
HOLD_TIMEOUT_SECONDS = 30.0
ANSWER_TIMEOUT_SECONDS = 10.0


@dataclass
class SleepReport:
    """What a release or a wake did, for the API and the benchmarks."""

    pids: list[int]
    # The GPU memory the processes held when the release started, by GPU UUID.
    gpu_memory: dict[str, int] = field(default_factory=dict)
    held_threads: int = 0

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_memory.values())
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"pids": self.pids, "gpu_bytes": self.gpu_bytes, "gpu_memory": self.gpu_memory,
                "held_threads": self.held_threads,
                "timings": {k: round(v, 4) for k, v in self.timings.items()}}


def holders_dir(base: Path) -> Path:
    """The directory of the holders' sockets under ``base``: made here, ours alone."""
    directory = base / f"jgs-holders-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    found = os.lstat(directory)
    if not os.path.isdir(directory) or os.path.islink(directory) or \
            found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise NotReady("hold", f"{directory} is not a private directory of this user",
                       hint="remove it; it is made again")
    return directory


class Holder:
    """The engine's end of one holder process, found by the root pid of its tree."""

    def __init__(self, root: int, directory: Path) -> None:
        self.root = root
        self.socket_path = directory / f"{root}.sock"

    def start(self, keep_running: list[int], note: dict[str, Any],
              continue_tree: bool = False) -> int:
        """Start the holder and wait until it holds the tree; the number of threads held.
        ``note`` comes back in its status, for a server started later. ``continue_tree``:
        the tree is stopped, and is continued once held (only ``keep_running`` runs)."""
        command = [sys.executable, "-m", "jupyter_gpu_snapshot.gpu.holder",
                   "--root", str(self.root), "--socket", str(self.socket_path),
                   "--timeout", str(HOLD_TIMEOUT_SECONDS), "--note", json.dumps(note)]
        if continue_tree:
            command.append("--continue")
        for tid in keep_running:
            command += ["--keep-running", str(tid)]
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        assert proc.stdout is not None and proc.stderr is not None
        with proc.stdout, proc.stderr:
            # The holder gives up by itself after HOLD_TIMEOUT_SECONDS; this is a backstop.
            ready, _, _ = select.select([proc.stdout], [], [], HOLD_TIMEOUT_SECONDS + 5)
            line = proc.stdout.readline() if ready else b""
            proc.wait()  # the first process only: it forks the holder and ends
            try:
                told = json.loads(line or b"{}")
            except ValueError:
                told = {}
            if "held" in told:
                return int(told["held"])
            err = ""
            if not told and select.select([proc.stderr], [], [], 1.0)[0]:  # it crashed
                err = os.read(proc.stderr.fileno(), 65536).decode(errors="replace")
        why = str(told.get("error") or (err.strip().splitlines() or ["it said nothing"])[-1])
        raise NotReady("hold", f"cannot stop the threads of kernel tree {self.root}: {why}",
                       hint="stopping another user's threads needs root (or the node agent)")

    def ask(self, op: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ANSWER_TIMEOUT_SECONDS)
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps({"op": op}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        answer = json.loads(data or b"{}")
        if not isinstance(answer, dict) or "error" in answer:
            raise NotReady("hold", f"the holder of kernel tree {self.root} answered "
                           f"{answer.get('error') if isinstance(answer, dict) else answer!r}")
        return answer

    def status(self) -> dict[str, Any] | None:
        """The holder's status, or None when no holder holds this tree."""
        try:
            answer = self.ask("status")
        except (OSError, ValueError):
            return None
        return answer if answer.get("root") == self.root else None

    def release(self) -> None:
        self.ask("release")


class GpuSleep:
    """Releases and gives back the GPU of kernel trees through the driver's checkpoint."""

    def __init__(self, driver: CheckpointDriver, holders: Path, lock_timeout: float,
                 read_inventory: Callable[[], GpuInventory | None] = lambda: None,
                 memory_available: Callable[[], int] | None = None) -> None:
        self.driver = driver
        # The host memory free for the GPU memory a release moves there; None: unchecked.
        self.memory_available = memory_available
        # The node's GPUs and what each process holds on them, now (NVML).
        self.read_inventory = read_inventory
        self.cuda = CudaCheckpoint(driver)
        self.holders = holders
        self.lock_timeout = lock_timeout

    def holder(self, root: int) -> Holder:
        return Holder(root, self.holders)

    def asleep(self, root: int) -> dict[str, Any] | None:
        """The holder's status when the tree sleeps in the first tier, else None."""
        return self.holder(root).status()

    def release(self, root: int, note: dict[str, Any] | None = None) -> SleepReport:
        """Lock, hold, checkpoint: the GPU is free and the kernel sleeps. Blocks.
        ``note``: what ``asleep`` tells of this sleep later (JSON)."""
        holder = self.holder(root)
        if holder.status() is not None:
            raise InvalidRequest("release the GPU", f"kernel tree {root} sleeps already")
        procs = self.cuda.holders([p.pid for p in procfs.tree(root)])
        if not procs:
            raise NotReady("release the GPU", f"kernel tree {root} holds no CUDA state, so "
                           "it has no GPU to give back",
                           hint="hibernate it to disk instead, which frees its host memory")
        for proc in procs:
            if proc.state != ProcessState.RUNNING:
                raise CudaError("release the GPU", f"the CUDA state of pid {proc.pid} is "
                                f"{proc.state.value}, not running")
        report = SleepReport([p.pid for p in procs])
        by_pid = self.gpu_memory_by_pid(report.pids)
        for memory in by_pid.values():
            for uuid, nbytes in memory.items():
                report.gpu_memory[uuid] = report.gpu_memory.get(uuid, 0) + nbytes
        self._require_host_memory(report.gpu_bytes)
        self._lock_all(procs, report)
        try:
            started = time.monotonic()
            keep = [tid for p in procs for tid in self._restore_threads(p.pid)]
            # What each process held goes into a snapshot taken while it sleeps.
            report.held_threads = holder.start(
                keep, {**(note or {}), "gpu_memory": report.gpu_memory,
                       "gpu_memory_by_pid": {str(k): v for k, v in by_pid.items()}})
            report.timings["hold"] = time.monotonic() - started
        except BaseException:
            self._unlock_all(procs)
            raise
        try:
            for proc in procs:
                self._step(proc, report, "checkpoint", self.driver.checkpoint, proc.pid)
        except DriverCallError as exc:
            problems = self.cuda.resume_all(procs)
            with contextlib.suppress(NotReady, OSError, ValueError):
                holder.release()
            raise CudaError("release the GPU", f"{exc}" + (
                f"; and {'; '.join(problems)}" if problems else
                "; the kernel runs on with its GPU"), hint=error_hint(exc)) from exc
        return report

    def wake(self, root: int,
             gpu_pairs: Callable[[int], Sequence[tuple[str, str]]] = lambda _pid: ()
             ) -> SleepReport:
        """Restore, unlock, let the threads run. A wake that fails leaves the kernel asleep.
        ``gpu_pairs``: the (old, new) GPU UUIDs to restore each process onto, by pid."""
        holder = self.holder(root)
        if holder.status() is None:
            raise NotFound("wake", f"kernel tree {root} is not sleeping in host memory")
        procs = [p for p in self.cuda.holders([p.pid for p in procfs.tree(root)])
                 if p.state != ProcessState.RUNNING]
        report = SleepReport([p.pid for p in procs])
        woken: list[CudaProcess] = []
        try:
            for proc in procs:
                self.cuda.resume(proc, tuple(gpu_pairs(proc.pid)))
                woken.append(proc)
        except CudaError as exc:
            # Give back what was restored, so that the GPU is as free as before the wake.
            for proc in woken:
                with contextlib.suppress(DriverCallError):
                    self.driver.lock(proc.pid, int(self.lock_timeout * 1000))
                    self.driver.checkpoint(proc.pid)
            exc.cause += "; the kernel sleeps on, its state in host memory"
            raise
        for proc in procs:
            for step, seconds in proc.timings.items():
                report.timings[step] = report.timings.get(step, 0.0) + seconds
        started = time.monotonic()
        holder.release()
        report.timings["run"] = time.monotonic() - started
        return report

    def hand_over(self, root: int) -> None:
        """Stop the sleeping tree (SIGSTOP) and end its holder, so that criu can seize it
        and write it to disk with its CUDA state as it is (checkpointed). A tree that
        could not be stopped is killed: it must never run on checkpointed CUDA."""
        try:
            self.holder(root).ask("hand_over")
        except (NotReady, OSError, ValueError) as exc:
            procfs.kill_tree(root)
            raise NotReady("hand over", f"the holder of kernel tree {root} could not stop it "
                           f"for its dump, so it was ended: {exc}") from exc

    def hold_stopped(self, root: int, note: dict[str, Any] | None = None) -> int:
        """Hold a tree that sleeps stopped (a dump that failed after ``hand_over``, or a
        restore of such a dump), then continue it: it sleeps in the first tier again,
        only the driver's restore threads running. Returns the threads held.

        The driver is asked only for the restore threads: asked for the state of a process
        whose restore thread is stopped, it waits for that thread (seen on the H200)."""
        keep = [tid for p in procfs.tree(root) for tid in self._restore_threads(p.pid)]
        return self.holder(root).start(keep, dict(note or {}), continue_tree=True)

    def _require_host_memory(self, gpu_bytes: int) -> None:
        """The driver copies the GPU memory into the kernel's host memory: a node short of
        it would meet the OOM killer halfway through the checkpoint."""
        if self.memory_available is None:
            return
        need = int(gpu_bytes * (1 + HOST_MARGIN_FRACTION)) + HOST_MARGIN_BYTES
        available = self.memory_available()
        if available < need:
            raise NotReady(
                "release the GPU",
                f"the kernel's {format_bytes(gpu_bytes)} of GPU memory would move into host "
                f"memory, and {format_bytes(available)} of it is available",
                hint="hibernate in the process tier instead, which writes it to disk",
            )

    def gpu_memory_by_pid(self, pids: list[int]) -> dict[int, dict[str, int]]:
        """What each process holds on each GPU now (UUID -> bytes), from one reading."""
        inventory = self.read_inventory()
        memory = inventory.process_memory if inventory is not None else {}
        return {pid: dict(memory.get(pid, {})) for pid in pids}

    def _restore_threads(self, pid: int) -> list[int]:
        tid = self.driver.restore_thread_id(pid)
        return host_tids(pid, tid) if tid is not None else []

    def _lock_all(self, procs: list[CudaProcess], report: SleepReport) -> None:
        locked: list[CudaProcess] = []
        try:
            for proc in procs:
                self._step(proc, report, "lock", self.driver.lock, proc.pid,
                           int(self.lock_timeout * 1000))
                locked.append(proc)
        except DriverCallError as exc:
            self._unlock_all(locked)
            raise CudaError("release the GPU", str(exc), hint=error_hint(exc)) from exc

    def _unlock_all(self, procs: list[CudaProcess]) -> None:
        for proc in procs:
            with contextlib.suppress(DriverCallError):
                self.driver.unlock(proc.pid)

    @staticmethod
    def _step(proc: CudaProcess, report: SleepReport, step: str, fn: Any, *args: Any) -> None:
        started = time.monotonic()
        fn(*args)
        report.timings[step] = report.timings.get(step, 0.0) + time.monotonic() - started
