"""Bringing the CUDA processes of one kernel tree back to running, from the engine.

CRIU's CUDA plugin locks, checkpoints, restores and unlocks inside criu (``broker``). What
it could not bring back (a criu that was killed, a restore the driver kept refusing,
snapshots saved before the plugin) ``resume`` brings back from whatever state it is in,
retrying transient failures; a process the driver reports as failed gets a loud error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import procfs
from .driver import (
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TIMEOUT,
    CheckpointDriver,
    CudaError,
    DriverCallError,
    ProcessState,
)


@dataclass
class CudaProcess:
    """A process of the kernel tree that holds CUDA state."""

    pid: int
    state: ProcessState
    timings: dict[str, float] = field(default_factory=dict)


# What a lock that timed out returns: NOT_READY on driver 580 (measured), TIMEOUT elsewhere.
LOCK_TIMED_OUT = (CUDA_ERROR_NOT_READY, CUDA_ERROR_TIMEOUT)


def error_hint(exc: DriverCallError) -> str:
    if exc.code in LOCK_TIMED_OUT:
        return ("the GPU was still busy when the lock timed out; wait for the running cell to "
                "finish or raise c.GPUSnapshot.cuda_lock_timeout")
    if exc.code == CUDA_ERROR_NOT_SUPPORTED:
        return ("the driver cannot checkpoint this process; managed (UVM) memory, CUDA IPC, "
                "MPS and MIG are not supported by the driver's checkpoint API")
    if exc.code == CUDA_ERROR_OUT_OF_MEMORY:
        return "not enough free memory (GPU or host) to bring the state back"
    return ""


class CudaCheckpoint:
    """Finds the CUDA processes of a kernel tree and resumes them, one state change at a
    time: ``resume`` brings one process back to running from whatever state it is in."""

    RETRIES = 3

    def __init__(self, driver: CheckpointDriver) -> None:
        self.driver = driver

    def holders(self, pids: Sequence[int]) -> list[CudaProcess]:
        found = []
        for pid in pids:
            try:
                state = self.driver.state(pid)
            except DriverCallError as exc:
                raise CudaError("preflight", f"cannot read the CUDA state of pid {pid}: {exc}") \
                    from exc
            if state is not None:
                found.append(CudaProcess(pid, state))
        return found

    def _timed(self, proc: CudaProcess, step: str, fn: Any, *args: Any) -> None:
        started = time.monotonic()
        fn(*args)
        proc.timings[step] = proc.timings.get(step, 0.0) + time.monotonic() - started

    def resume(self, proc: CudaProcess, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Whatever state ``proc`` is in, bring it back to running (retrying transient errors)."""
        state = self._state_for_resume(proc.pid)
        if state is None or state == ProcessState.RUNNING:
            proc.state = state or proc.state
            return
        if state == ProcessState.FAILED:
            proc.state = state
            raise CudaError(
                "resume",
                f"the driver reports the CUDA state of pid {proc.pid} as failed: its GPU "
                "state is lost and it cannot use the GPU again",
                hint="save its results if you can, then restart the kernel",
            )
        if state == ProcessState.CHECKPOINTED:
            ensure_restore_thread_runs(self.driver, proc.pid)
            self._retry(proc, "restore", self.driver.restore, proc.pid, gpu_pairs)
            proc.state = ProcessState.LOCKED
        self._retry(proc, "unlock", self.driver.unlock, proc.pid)
        proc.state = ProcessState.RUNNING

    def resume_all(self, procs: Sequence[CudaProcess],
                   gpu_pairs: Sequence[tuple[str, str]] = ()) -> list[str]:
        """Resume in reverse order; return one line per process that could not be resumed."""
        problems = []
        for proc in reversed(procs):
            try:
                self.resume(proc, gpu_pairs)
            except CudaError as exc:
                problems.append(exc.cause)
        return problems

    def _state_for_resume(self, pid: int) -> ProcessState | None:
        try:
            return self.driver.state(pid)
        except DriverCallError as exc:
            raise CudaError("resume", f"cannot read the CUDA state of pid {pid}: {exc}") from exc

    def _retry(self, proc: CudaProcess, step: str, fn: Any, *args: Any) -> None:
        # Restore can fail for want of GPU memory that another process frees a moment later.
        for attempt in range(self.RETRIES):
            try:
                self._timed(proc, step, fn, *args)
                return
            except DriverCallError as exc:
                if attempt == self.RETRIES - 1:
                    where = "checkpointed in host memory" if step == "restore" else "locked"
                    raise CudaError(
                        "resume",
                        f"CUDA {step} of pid {proc.pid} failed {self.RETRIES} times ({exc}); "
                        f"the process is alive but its CUDA state is still {where}",
                        hint=error_hint(exc) or "free GPU memory and retry the restore",
                    ) from exc
                time.sleep(0.5 * 2**attempt)


def ensure_restore_thread_runs(driver: CheckpointDriver, pid: int) -> None:
    """The driver's restore thread does the restore; a stopped one would hang it forever."""
    tid = driver.restore_thread_id(pid)
    if tid is None:
        return
    state = _task_state(pid, tid)
    if state == "T":  # group-stopped, e.g. by a dump that died: SIGCONT wakes it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 2.0
        while _task_state(pid, tid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        state = _task_state(pid, tid)
    if state in ("T", "t"):
        raise CudaError(
            "resume",
            f"the CUDA restore thread {tid} of pid {pid} is stopped"
            + (" under a tracer (is criu still attached?)" if state == "t" else ""),
            hint="end the tracer or send SIGCONT, then retry",
        )


def _task_state(pid: int, tid: int) -> str:
    """One-letter state of a thread, found by host tid or by its tid inside the namespace."""
    states = procfs.thread_states(pid)
    for candidate in host_tids(pid, tid):
        if candidate in states:
            return states[candidate]
    return ""


def host_tids(pid: int, tid: int) -> list[int]:
    if os.path.exists(f"/proc/{pid}/task/{tid}"):
        return [tid]
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                nspids = procfs.status_fields(pid, thread=int(name)).get("NSpid", "").split()
                if nspids and nspids[-1] == str(tid):
                    found.append(int(name))
    return found
