"""The driver layer below the hook: argument layouts, result codes, the CLI fallback.

The ctypes layouts are checked against cuda.h's sizes; ``LibcudaDriver`` runs over a stand-in
for ``libcuda.so.1`` that answers what driver 580 answered on the GPU machine; the
``cuda-checkpoint`` fallback runs a scripted binary that keeps state in a file.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.gpu import driver as driver_module
from jupyter_gpu_snapshot.gpu.driver import (
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_OPERATING_SYSTEM,
    CudaCheckpointCli,
    DriverCallError,
    LibcudaDriver,
    ProcessState,
    load_driver,
    uuid_bytes,
)


def test_argument_layouts_match_cuda_h():
    assert ctypes.sizeof(driver_module._LockArgs) == 64
    assert ctypes.sizeof(driver_module._ReservedArgs) == 64
    assert ctypes.sizeof(driver_module._RestoreArgs) == 64
    assert ctypes.sizeof(driver_module._GpuPair) == 32
    assert driver_module._RestoreArgs.gpuPairsCount.offset == 8
    assert driver_module._LockArgs.timeoutMs.offset == 0


def test_uuid_bytes():
    raw = uuid_bytes("GPU-d4b6458e-d207-bb5a-b539-350cb102ad99")
    assert raw.hex() == "d4b6458ed207bb5ab539350cb102ad99"
    with pytest.raises(ValueError):
        uuid_bytes("GPU-1")


class FakeLib:
    """Answers like libcuda.so.1 of driver 580: NOT_INITIALIZED before cuInit, then per pid."""

    def __init__(self, states: dict[int, int]) -> None:
        self.states = states
        self.initialised = False
        self.lock_timeouts: list[int] = []

    def cuDriverGetVersion(self, out: Any) -> int:
        out._obj.value = 13000
        return 0

    def cuInit(self, flags: int) -> int:
        self.initialised = True
        return 0

    def cuCheckpointProcessGetState(self, pid: int, out: Any) -> int:
        if not self.initialised:
            return CUDA_ERROR_NOT_INITIALIZED
        if pid in self.states:
            out._obj.value = self.states[pid]
            return 0
        # No CUDA state: NOT_INITIALIZED; no such process: OPERATING_SYSTEM (measured).
        if Path(f"/proc/{pid}").exists():
            return CUDA_ERROR_NOT_INITIALIZED
        return CUDA_ERROR_OPERATING_SYSTEM

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> int:
        self.lock_timeouts.append(args._obj.timeoutMs)
        return self._move(pid, 0, 1)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> int:
        return self._move(pid, 1, 2)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
        return self._move(pid, 2, 1)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> int:
        return self._move(pid, 1, 0)

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int, out: Any) -> int:
        out._obj.value = pid
        return 0

    def _move(self, pid: int, needs: int, becomes: int) -> int:
        if self.states.get(pid) != needs:
            return CUDA_ERROR_ILLEGAL_STATE
        self.states[pid] = becomes
        return 0


def test_libcuda_driver_maps_states_and_codes():
    me = os.getpid()
    lib = FakeLib({me: 0})
    driver = LibcudaDriver(lib)
    assert driver.info.has_api and driver.info.cuda_version == 13000
    assert driver.state(me) == ProcessState.RUNNING  # cuInit happened first
    assert driver.state(1) is None  # alive, no CUDA state
    assert driver.state(2**22 + 12345) is None  # gone
    driver.lock(me, 2500)
    assert lib.lock_timeouts == [2500]
    driver.checkpoint(me)
    assert driver.state(me) == ProcessState.CHECKPOINTED
    with pytest.raises(DriverCallError, match="CUDA_ERROR_ILLEGAL_STATE"):
        driver.unlock(me)
    driver.restore(me)
    driver.unlock(me)
    assert driver.state(me) == ProcessState.RUNNING


def test_lib_without_the_api_is_reported():
    class OldLib:
        def cuDriverGetVersion(self, out: Any) -> int:
            out._obj.value = 12020
            return 0

    assert not LibcudaDriver(OldLib()).info.has_api


FAKE_CLI = """#!/usr/bin/env python3
import json, os, sys
state_file = os.environ["FAKE_CLI_STATE"]
states = json.load(open(state_file)) if os.path.exists(state_file) else {}
args = sys.argv[1:]
log = open(state_file + ".log", "a")
log.write(" ".join(args) + "\\n")
if args[0] in ("-h", "--help"):
    print("usage: cuda-checkpoint --toggle --pid PID" + ("" if os.environ.get("FAKE_OLD")
          else " | --action {lock,checkpoint,restore,unlock} --pid PID [--timeout MS]"))
    sys.exit(0)
pid = args[args.index("--pid") + 1]
if args[0] == "--get-state":
    print(states.get(pid, "running")); sys.exit(0)
if args[0] == "--get-restore-tid":
    print(pid); sys.exit(0)
moves = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
         "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}
if args[0] == "--toggle":
    now = states.get(pid, "running")
    states[pid] = "checkpointed" if now == "running" else "running"
else:
    action = args[1]
    need, become = moves[action]
    if states.get(pid, "running") != need:
        print(f"Could not {action} process {pid}: illegal state"); sys.exit(1)
    states[pid] = become
json.dump(states, open(state_file, "w"))
"""


@pytest.mark.parametrize("old", [False, True], ids=["action", "toggle-only"])
def test_cli_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bool):
    exe = tmp_path / "cuda-checkpoint"
    exe.write_text(FAKE_CLI)
    exe.chmod(0o755)
    state = tmp_path / "state.json"
    monkeypatch.setenv("FAKE_CLI_STATE", str(state))
    if old:
        monkeypatch.setenv("FAKE_OLD", "1")
    cli = CudaCheckpointCli(str(exe))
    assert cli.toggle_only == old
    pid = os.getpid()
    assert cli.state(pid) == ProcessState.RUNNING
    cli.lock(pid, 3000)
    cli.checkpoint(pid)
    assert cli.state(pid) == ProcessState.CHECKPOINTED
    cli.restore(pid)
    cli.unlock(pid)
    assert cli.state(pid) == ProcessState.RUNNING
    assert cli.restore_thread_id(pid) == pid
    calls = [line for line in (tmp_path / "state.json.log").read_text().splitlines()
             if not line.startswith(("--get", "--help"))]
    if old:
        assert calls == [f"--toggle --pid {pid}"] * 2
    else:
        assert calls[0] == f"--action lock --pid {pid} --timeout 3000"
        assert [c.split()[1] for c in calls] == ["lock", "checkpoint", "restore", "unlock"]
        state.write_text(json.dumps({str(pid): "running"}))
        with pytest.raises(DriverCallError, match="illegal state"):
            cli.unlock(pid)


def test_load_driver_says_what_is_missing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    status = load_driver()
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert status.driver is None
        assert "libcuda.so.1 cannot be loaded" in status.problem
    else:  # a machine with a driver: the in-process backend is chosen
        assert status.driver is not None and status.driver.info.backend == "libcuda"
